"""Attention over a sliding window of tokens and over compressed entries, in one softmax.

DeepSeek-AI 2026, "DeepSeek-V4" technical report, Section 2.3: every CSA and HCA layer attends, per query, to
(a) the last ``window`` tokens (the sliding branch) and (b) compressed KV entries (:func:`qkv.sparse.compress_kv`,
one per ``rate`` tokens): all visible entries (HCA) or the ones an indexer selected (CSA). Both sets share one
softmax, with an optional per-head sink logit in its denominator (gpt-oss, V4).

Positions (absolute, token units)::

    window key j      at  k_start + j                 visible to a query at p when  p - window < k_start + j <= p
    query row i       at  q_start + i                 (default q_start = k_start + Nk - Nq, bottom-right)
    compressed entry t  covers tokens t*rate .. (t+1)*rate - 1: visible once all are, (t + 1) * rate <= p + 1

    rate = 4, window = 3, query at p = 9:
    tokens      0 1 2 3 4 5 6 7 8 9
    window                    . x x x        keys 7, 8, 9
    entries     [  t=0  ][  t=1  ][ t=2      entry 2 (tokens 8..11) is not complete at p = 9

With ``selected`` (B, Hs, Nq, K) int64 entry ids (-1 = none; Hs = 1 shares one list by all heads, Hkv one per KV
head, Hq one per query head) a query sees only the listed entries that are visible; repeats count once. Rows
with nothing visible and no sink give zeros and ``lse = -inf``.

:func:`compressed_attention` computes this in O(Nq·(window + K)·D): query rows in chunks, each chunk's window keys
as one band product, its listed entries gathered (only those), the two merged in one softmax; the backward
recomputes each chunk (FlashAttention's recomputation) and scatters the entries' gradients, so nothing of size
Nq x Nk or Nq x T is ever held. Without ``selected`` (HCA) the entries are attended densely under the
compressed-causal staircase, O(Nq·T·D). :func:`compressed_attention_reference` is the dense float64 definition
(materializes the mask), the test oracle.

Shape legend: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, Nq queries, Nk window keys, T compressed
entries, K listed entries per row, D key width, Dv value width, c query rows of a chunk, R = c·G rows of a chunk
per KV head, L window keys of a chunk.

Example:
    >>> import torch
    >>> from qkv.sparse import compressed_attention, compressed_attention_reference
    >>> q = torch.randn(1, 4, 16, 8)
    >>> k = v = torch.randn(1, 1, 16, 8)                       # K = V, one KV head
    >>> k_cmp = v_cmp = torch.randn(1, 1, 4, 8)                # 16 tokens compressed 4 : 1
    >>> sel = torch.tensor([0, 2, -1]).expand(1, 1, 16, 3)    # every row lists entries 0 and 2
    >>> out = compressed_attention(q, k, v, k_cmp, v_cmp, rate=4, window=4, selected=sel)
    >>> ref = compressed_attention_reference(q, k, v, k_cmp, v_cmp, rate=4, window=4, selected=sel)
    >>> bool(torch.allclose(out.double(), ref, atol=1e-5))
    True
"""

from __future__ import annotations

import torch

from .._request import AttentionOutput

__all__ = ["compressed_attention", "compressed_attention_reference"]

#: Bytes of listed entries gathered at a time: small enough to be read back from cache by the two products.
_GATHER_BYTES = 2 << 20


def _check(fn, q, k, v, k_cmp, v_cmp, rate, window, selected, sinks, scale, q_start, k_start):
    """Validate the arguments; returns (B, Hq, Hkv, Nq, Nk, T, q_start)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cmp", k_cmp), ("v_cmp", v_cmp)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            seen = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{fn}: {name} must be a float tensor, got {seen}")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} has dtype {t.dtype} but q has {q.dtype}; cast them to one dtype")
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q on {q.device}; move them to one device")
    B, Hq, Nq, D = q.shape
    Hkv, Nk, T = k.shape[1], k.shape[2], k_cmp.shape[2]
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, k_cmp {tuple(k_cmp.shape)}, " \
             f"v_cmp {tuple(v_cmp.shape)}"
    if any(t.shape[0] != B for t in (k, v, k_cmp, v_cmp)) or any(t.shape[1] != Hkv for t in (v, k_cmp, v_cmp)):
        raise ValueError(f"{fn}: k, v, k_cmp, v_cmp must share q's batch and one KV head count; got {shapes}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{fn}: q's {Hq} heads must be a multiple of the {Hkv} KV heads; got {shapes}")
    if k.shape[3] != D or k_cmp.shape[3] != D or v_cmp.shape[3] != v.shape[3]:
        raise ValueError(f"{fn}: k and k_cmp must have q's width D={D}, v_cmp v's width; got {shapes}")
    if v.shape[2] != Nk or v_cmp.shape[2] != T:
        raise ValueError(f"{fn}: v must have k's length and v_cmp k_cmp's; got {shapes}")
    for name, x, lo in (("rate", rate, 1), ("window", window, 0), ("k_start", k_start, 0)):
        if not isinstance(x, int) or isinstance(x, bool) or x < lo:
            raise ValueError(f"{fn}: {name} must be an int >= {lo}, got {x!r}")
    if q_start is None:
        q_start = k_start + Nk - Nq
        if q_start < 0:
            raise ValueError(f"{fn}: {Nq} queries after {Nk} window keys from k_start={k_start} would start at "
                             f"position {q_start}; pass q_start (the first query's absolute position)")
    elif not isinstance(q_start, int) or isinstance(q_start, bool) or q_start < 0:
        raise ValueError(f"{fn}: q_start must be an int >= 0 (the first query's absolute position), got {q_start!r}")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise TypeError(f"{fn}: scale must be a float or None, got {type(scale).__name__}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
            raise TypeError(f"{fn}: sinks must be a float (Hq,) tensor, got {type(sinks).__name__}")
        if tuple(sinks.shape) != (Hq,):
            raise ValueError(f"{fn}: sinks must be one logit per query head, shape ({Hq},), got {tuple(sinks.shape)}")
    if selected is not None:
        if not isinstance(selected, torch.Tensor) or selected.dtype.is_floating_point or selected.dtype == torch.bool:
            seen = f"a {selected.dtype} tensor" if isinstance(selected, torch.Tensor) else type(selected).__name__
            raise TypeError(f"{fn}: selected must be an int64 tensor (B, Hs, Nq, K) of entry ids (-1 = none), "
                            f"got {seen}")
        if selected.dim() != 4 or selected.shape[0] != B or selected.shape[2] != Nq \
                or selected.shape[1] not in (1, Hkv, Hq):
            raise ValueError(f"{fn}: selected must be (B={B}, Hs, Nq={Nq}, K) with Hs in (1, Hkv={Hkv}, Hq={Hq}), "
                             f"got {tuple(selected.shape)}")
        if selected.numel():
            lo, hi = int(selected.min()), int(selected.max())
            if lo < -1 or hi >= T:
                raise ValueError(f"{fn}: selected lists entry ids from {lo} to {hi} but there are {T} compressed "
                                 f"entries (valid ids 0 .. {T - 1}, or -1 for none)")
    return B, Hq, Hkv, Nq, Nk, T, q_start


def compressed_attention_reference(q, k, v, k_cmp, v_cmp, *, rate, window, selected=None, sinks=None, scale=None,
                                   q_start=None, k_start=0, return_lse=False):
    """The dense float64 definition of :func:`compressed_attention` (same arguments): the (Nq, Nk + T) mask
    materialized, one softmax over window keys, entries and the sink. O(Nq·(Nk + T)) memory, a test oracle.

    Returns:
        out (B, Hq, Nq, Dv) float64, or :class:`qkv.AttentionOutput` ``(out, lse (B, Hq, Nq) float64)`` with
        ``return_lse``.
    """
    B, Hq, Hkv, Nq, Nk, T, q_start = _check("compressed_attention_reference", q, k, v, k_cmp, v_cmp, rate, window,
                                            selected, sinks, scale, q_start, k_start)
    G = Hq // Hkv
    dev = q.device
    q = q.double()
    keys = torch.cat([k, k_cmp], 2).double().repeat_interleave(G, 1)  # (B, Hq, Nk + T, D)
    vals = torch.cat([v, v_cmp], 2).double().repeat_interleave(G, 1)  # (B, Hq, Nk + T, Dv)
    p = (q_start + torch.arange(Nq, device=dev)).view(Nq, 1)
    kpos = (k_start + torch.arange(Nk, device=dev)).view(1, Nk)
    in_window = (kpos <= p) & (kpos > p - window)  # (Nq, Nk)
    complete = (torch.arange(T, device=dev).view(1, T) + 1) * rate <= p + 1  # (Nq, T)
    allowed_cmp = complete.expand(B, Hq, Nq, T)
    if selected is not None:
        listed = torch.zeros(B, selected.shape[1], Nq, T + 1, dtype=torch.bool, device=dev)
        listed.scatter_(-1, torch.where(selected < 0, T, selected.long()), True)  # -1 lands in the dropped column
        listed = listed[..., :T].repeat_interleave(Hq // selected.shape[1], 1)  # (B, Hq, Nq, T)
        allowed_cmp = allowed_cmp & listed
    allowed = torch.cat([in_window.expand(B, Hq, Nq, Nk), allowed_cmp], -1)  # (B, Hq, Nq, Nk + T)
    s = (q.shape[-1] ** -0.5 if scale is None else scale) * (q @ keys.transpose(-1, -2))
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)], -1)
    lse = torch.logsumexp(s, -1)  # (B, Hq, Nq); -inf for an empty row
    probs = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = probs[..., :Nk + T] @ vals
    return AttentionOutput(out, lse) if return_lse else out


class _Call:
    """The operands and settings of one call, shared by the forward and the backward."""

    def __init__(self, q, k, v, k_cmp, v_cmp, sinks, selected, rate, window, scale, q_start, k_start, kv_same,
                 cmp_same):
        self.q, self.k, self.v, self.k_cmp, self.v_cmp, self.sinks = q, k, v, k_cmp, v_cmp, sinks
        self.selected, self.rate, self.window, self.scale = selected, rate, window, scale
        self.q_start, self.k_start, self.kv_same, self.cmp_same = q_start, k_start, kv_same, cmp_same
        self.B, self.Hq, self.Nq, self.D = q.shape
        self.Hkv, self.Nk, self.T, self.Dv = k.shape[1], k.shape[2], k_cmp.shape[2], v.shape[3]
        self.G = self.Hq // self.Hkv
        self.acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        # gathered lists: one per KV head (shared by its G query heads, or by all heads), or one per query head
        self.Hx = self.Hq if selected is not None and selected.shape[1] == self.Hq else self.Hkv
        self.gx = self.Hq // self.Hx  # query heads reading one list

    def sink_rows(self, c: int) -> torch.Tensor | None:
        """The sink logit of each (B, Hkv, G·c) band row, rows ordered (G, c): (1, Hkv, G·c)."""
        if self.sinks is None:
            return None
        return self.sinks.to(self.acc).view(1, self.Hkv, self.G, 1).expand(1, self.Hkv, self.G, c).reshape(1, self.Hkv,
                                                                                                         -1)


class _Band:
    """Part A of rows r0 .. r1: the window band and, without lists, the complete entries (HCA), per KV head with
    the chunk's rows ordered (G, c): scores (B, Hkv, G·c, L + t1)."""

    def __init__(self, call: _Call, r0: int, r1: int):
        B, Hkv, G, acc, dev = call.B, call.Hkv, call.G, call.acc, call.q.device
        c = r1 - r0
        self.r0, self.r1, self.c = r0, r1, c
        self.qr = call.q[:, :, r0:r1].to(acc).reshape(B, Hkv, G * c, call.D)  # (B, Hkv, R, D)
        pos = (call.q_start + r0 + torch.arange(c, device=dev)).view(c, 1)
        first = call.q_start + r0 - call.window + 1 - call.k_start
        self.j0 = min(max(first, 0), call.Nk)
        self.j1 = max(min(call.q_start + r1 - call.k_start, call.Nk), self.j0) if call.window else self.j0
        kpos = call.k_start + torch.arange(self.j0, self.j1, device=dev).view(1, -1)
        ok = [(kpos <= pos) & (kpos > pos - call.window)]  # (c, L)
        keys = [call.k[:, :, self.j0:self.j1]]
        vals = [call.v[:, :, self.j0:self.j1]]
        self.t1 = 0
        if call.selected is None:  # every complete entry: a staircase over entries 0 .. t1
            self.t1 = min((call.q_start + r1) // call.rate, call.T) if c else 0
            ok.append(torch.arange(self.t1, device=dev).view(1, -1) < (pos + 1) // call.rate)  # (c, t1)
            keys.append(call.k_cmp[:, :, :self.t1])
            vals.append(call.v_cmp[:, :, :self.t1])
        self.L = self.j1 - self.j0
        self.ok = torch.cat(ok, 1) if len(ok) > 1 else ok[0]  # (c, L + t1)
        self.keys = (torch.cat(keys, 2) if len(keys) > 1 else keys[0]).to(acc)  # (B, Hkv, L + t1, D)
        same = call.kv_same and (call.selected is not None or call.cmp_same)
        self.vals = self.keys if same else (torch.cat(vals, 2) if len(vals) > 1 else vals[0]).to(acc)

    def scores(self, call: _Call) -> torch.Tensor:
        B, Hkv, R, _ = self.qr.shape
        s = call.scale * (self.qr @ self.keys.transpose(-1, -2))  # (B, Hkv, R, X)
        return s.view(B, Hkv, call.G, self.c, -1).masked_fill_(~self.ok, float("-inf")).view(B, Hkv, R, -1)


def _band_forward(call: _Call, out: torch.Tensor, lse: torch.Tensor, rows: int) -> None:
    """Part A of every row into ``out`` (B, Hq, Nq, Dv) and ``lse`` (B, Hq, Nq), the sinks included."""
    B, Hq = call.B, call.Hq
    for r0 in range(0, call.Nq, rows):
        band = _Band(call, r0, min(call.Nq, r0 + rows))
        s = band.scores(call)
        m = s.amax(-1) if s.shape[-1] else s.new_full(s.shape[:-1], float("-inf"))
        z = call.sink_rows(band.c)
        if z is not None:
            m = torch.maximum(m, z)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # an empty row: keep exp(-inf) = 0
        p = torch.exp(s - m.unsqueeze(-1))
        total = p.sum(-1)
        if z is not None:
            total = total + torch.exp(z - m)
        o = p @ band.vals  # (B, Hkv, R, Dv), unnormalized
        safe = torch.where(total == 0, torch.ones_like(total), total)
        out[:, :, band.r0:band.r1] = (o / safe.unsqueeze(-1)).view(B, Hq, band.c, -1)
        lse[:, :, band.r0:band.r1] = torch.where(total == 0, float("-inf"), m + torch.log(safe)).view(B, Hq, band.c)


def _band_backward(call, lse, delta, dout, grads, rows: int) -> None:
    """Part A's gradients, recomputing its probabilities from the final ``lse``; ``delta`` = rowsum(dO·O) - dlse."""
    B, Hkv, G = call.B, call.Hkv, call.G
    dq, dk, dv, dkc, dvc, dsinks = grads
    for r0 in range(0, call.Nq, rows):
        band = _Band(call, r0, min(call.Nq, r0 + rows))
        c, R, L = band.c, G * band.c, band.L
        lr = lse[:, :, r0:band.r1].reshape(B, Hkv, R, 1)
        lr = torch.where(torch.isneginf(lr), torch.zeros_like(lr), lr)
        p = torch.exp(band.scores(call) - lr)  # (B, Hkv, R, X)
        do = dout[:, :, r0:band.r1].reshape(B, Hkv, R, -1)
        dl = delta[:, :, r0:band.r1].reshape(B, Hkv, R, 1)
        ds = p * (do @ band.vals.transpose(-1, -2) - dl)
        dq[:, :, r0:band.r1] = (call.scale * (ds @ band.keys)).view(B, call.Hq, c, -1)
        dkeys = call.scale * (ds.transpose(-1, -2) @ band.qr)  # (B, Hkv, X, D)
        dvals = p.transpose(-1, -2) @ do  # (B, Hkv, X, Dv)
        dk[:, :, band.j0:band.j1] += dkeys[:, :, :L]
        dv[:, :, band.j0:band.j1] += dvals[:, :, :L]
        if band.t1:
            dkc[:, :, :band.t1] += dkeys[:, :, L:]
            dvc[:, :, :band.t1] += dvals[:, :, L:]
        if dsinks is not None:
            p_sink = torch.exp(call.sink_rows(c) - lr.squeeze(-1))  # (B, Hkv, R)
            dsinks -= (p_sink * dl.squeeze(-1)).view(B, call.Hq, c).sum((0, 2))


class _Lists:
    """Rows r0 .. r1 of part B laid out list-major: n = c·B·Hx lists ordered (row, batch, list), each read by gx
    query heads, so the rows of a gather are one contiguous slice. ``flat`` (n, K) row ids into
    ``k_cmp.view(-1, D)``; ``bias`` (n, 1, K) 0 to read, -inf for -1, repeats and entries not complete yet."""

    def __init__(self, call: _Call, r0: int, r1: int):
        B, Hx, dev = call.B, call.Hx, call.q.device
        c = r1 - r0
        self.r0, self.r1, self.c = r0, r1, c
        ids = call.selected[:, :, r0:r1].expand(B, Hx, c, call.selected.shape[-1]).permute(2, 0, 1, 3)  # (c,B,Hx,K)
        K = ids.shape[-1]
        safe = torch.where(ids < 0, call.T, ids).reshape(-1, K)  # -1 -> a spare column T
        # first occurrences: each list writes each slot number at its entry, then keeps the slots that won
        slot = torch.arange(K, device=dev, dtype=torch.int32).expand(safe.shape)
        stamp = torch.empty(safe.shape[0], call.T + 1, dtype=torch.int32, device=dev).scatter_(1, safe, slot)
        limit = ((call.q_start + r0 + torch.arange(c, device=dev)) + 1) // call.rate  # entries below are complete
        ok = (stamp.gather(1, safe) == slot).view(c, B, Hx, K) & (ids >= 0) & (ids < limit.view(c, 1, 1, 1))
        self.bias = torch.zeros(ok.shape, dtype=call.acc, device=dev).masked_fill_(~ok, float("-inf"))
        self.bias = self.bias.view(-1, 1, K)
        self.bias_t = self.bias.transpose(1, 2)  # (n, K, 1)
        kv_head = torch.arange(Hx, device=dev) // (call.Hq // call.Hkv if Hx == call.Hq else 1)
        base = (torch.arange(B, device=dev).view(B, 1) * call.Hkv + kv_head.view(1, Hx)) * call.T  # (B, Hx)
        self.flat = (base.view(1, B, Hx, 1) + ids.clamp_min(0)).reshape(-1, K)  # (n, K)

    def rows(self, x: torch.Tensor, call: _Call) -> torch.Tensor:
        """(B, Hq, Nq, ...) rows r0 .. r1 as (n, gx, ...), list-major (a copy)."""
        B, Hx, gx, c = call.B, call.Hx, call.gx, self.c
        part = x[:, :, self.r0:self.r1].reshape(B, Hx, gx, c, *x.shape[3:])
        return part.movedim(3, 0).reshape(c * B * Hx, gx, *x.shape[3:])

    def put(self, x: torch.Tensor, call: _Call, val: torch.Tensor) -> None:
        """Inverse of :meth:`rows`: write ``val`` (n, gx, ...) into rows r0 .. r1 of ``x``."""
        B, Hx, gx, c = call.B, call.Hx, call.gx, self.c
        x[:, :, self.r0:self.r1] = val.reshape(c, B, Hx, gx, *x.shape[3:]).movedim(0, 3).reshape(
            B, call.Hq, c, *x.shape[3:])

    def gather(self, call: _Call, a: int, b: int):
        """Entries of lists a .. b: keys (b - a, K, D), values (b - a, K, Dv) and the flat ids (b - a) * K."""
        flat = self.flat[a:b].reshape(-1)
        kc = call.k_cmp.reshape(-1, call.D).index_select(0, flat).view(b - a, -1, call.D).to(call.acc)
        vc = kc if call.cmp_same else \
            call.v_cmp.reshape(-1, call.Dv).index_select(0, flat).view(b - a, -1, call.Dv).to(call.acc)
        return flat, kc, vc


def _lists_forward(call: _Call, out: torch.Tensor, lse: torch.Tensor, rows: int, sub: int) -> None:
    """Part B (the gathered entries) merged into part A's ``out``/``lse`` in place; ``sub`` rows per gather."""
    per_row = call.B * call.Hx
    for r0 in range(0, call.Nq, rows):
        lists = _Lists(call, r0, min(call.Nq, r0 + rows))
        qs = lists.rows(call.q, call).to(call.acc) * call.scale  # (n, gx, D)
        n = qs.shape[0]
        ob = qs.new_empty(n, call.gx, call.Dv)
        mb = qs.new_empty(n, call.gx)
        lb = qs.new_empty(n, call.gx)
        for a in range(0, n, sub * per_row):
            b = min(n, a + sub * per_row)
            _, kc, vc = lists.gather(call, a, b)
            st = torch.bmm(kc, qs[a:b].transpose(1, 2)).add_(lists.bias_t[a:b])  # (m, K, gx): K-major is faster
            m = torch.amax(st, 1, keepdim=True).clamp_min_(-1e30)  # a list with nothing visible: exp(-inf) = 0
            pt = st.sub_(m).exp_()
            torch.sum(pt, 1, out=lb[a:b])
            torch.bmm(pt.transpose(1, 2), vc, out=ob[a:b])  # unnormalized
            mb[a:b] = m.squeeze(1)
        # merge with part A (out, lse of the window band and the sinks), exactly, by the two log-sum-exps
        la = lists.rows(lse, call)  # (n, gx)
        m = torch.maximum(mb, la)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        wa, wb = torch.exp(la - m), lb * torch.exp(mb - m)
        total = wa + wb
        safe = torch.where(total == 0, torch.ones_like(total), total)
        merged = (lists.rows(out, call) * wa.unsqueeze(-1) + ob * torch.exp(mb - m).unsqueeze(-1)) / safe.unsqueeze(-1)
        lists.put(out, call, merged)
        lists.put(lse, call, torch.where(total == 0, float("-inf"), m + torch.log(safe)))


def _lists_backward(call, lse, delta, dout, grads, rows: int, sub: int) -> None:
    """Part B's gradients: probabilities recomputed from the final lse; entries' gradients scattered by id."""
    dq, _, _, dkc, dvc, _ = grads
    dkc_flat, dvc_flat = dkc.view(-1, call.D), dvc.view(-1, call.Dv)
    per_row = call.B * call.Hx
    for r0 in range(0, call.Nq, rows):
        lists = _Lists(call, r0, min(call.Nq, r0 + rows))
        qs = lists.rows(call.q, call).to(call.acc) * call.scale  # (n, gx, D)
        lr = lists.rows(lse, call)
        lr = torch.where(torch.isneginf(lr), torch.zeros_like(lr), lr).unsqueeze(-1)  # (n, gx, 1)
        do = lists.rows(dout, call)  # (n, gx, Dv)
        dl = lists.rows(delta, call).unsqueeze(-1)  # (n, gx, 1)
        dqb = torch.empty_like(qs)
        for a in range(0, qs.shape[0], sub * per_row):
            b = min(qs.shape[0], a + sub * per_row)
            flat, kc, vc = lists.gather(call, a, b)
            p = torch.bmm(qs[a:b], kc.transpose(1, 2)).add_(lists.bias[a:b]).sub_(lr[a:b]).exp_()  # (m, gx, K)
            ds = torch.bmm(do[a:b], vc.transpose(1, 2)).sub_(dl[a:b]).mul_(p)  # dS = P (dP - delta)
            torch.bmm(ds, kc, out=dqb[a:b])
            if call.cmp_same:  # one product for both uses: [dS; P]^T [scale q; dO]
                both = torch.bmm(torch.cat([ds, p], 1).transpose(1, 2), torch.cat([qs[a:b], do[a:b]], 1))
                dkc_flat.index_add_(0, flat, both.view(-1, call.D))
            else:
                dkc_flat.index_add_(0, flat, torch.bmm(ds.transpose(1, 2), qs[a:b]).view(-1, call.D))
                dvc_flat.index_add_(0, flat, torch.bmm(p.transpose(1, 2), do[a:b]).view(-1, call.Dv))
        lists.put(dq, call, lists.rows(dq, call) + dqb * call.scale)


def _sizes(call: _Call) -> tuple[int, int, int]:
    """Rows per band chunk, per list chunk, per gather."""
    band = max(16, min(256, call.window // 4 or 64))
    if call.selected is None:
        return band, 0, 0
    per_row = call.B * call.Hx * call.selected.shape[-1] * (call.D + (0 if call.cmp_same else call.Dv)) * 4
    sub = max(1, min(64, _GATHER_BYTES // max(per_row, 1)))
    return band, max(sub, 256), sub


class _CompressedAttention(torch.autograd.Function):
    """Forward: part A (window band, and the entries without lists) by chunks, then part B (gathered lists) merged
    into it row by row. Backward: both parts recompute their probabilities from the saved final lse."""

    @staticmethod
    def forward(fctx, q, k, v, k_cmp, v_cmp, sinks, selected, rate, window, scale, q_start, k_start, kv_same,
                cmp_same):
        call = _Call(q, k, v, k_cmp, v_cmp, sinks, selected, rate, window, scale, q_start, k_start, kv_same,
                     cmp_same)
        band, rows, sub = _sizes(call)
        out = q.new_empty(call.B, call.Hq, call.Nq, call.Dv, dtype=call.acc)
        lse = q.new_empty(call.B, call.Hq, call.Nq, dtype=call.acc)
        _band_forward(call, out, lse, band)
        if selected is not None:
            _lists_forward(call, out, lse, rows, sub)
        fctx.save_for_backward(q, k, v, k_cmp, v_cmp, sinks, selected, out, lse)
        fctx.settings = (rate, window, scale, q_start, k_start, kv_same, cmp_same)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(fctx, dout, dlse):
        q, k, v, k_cmp, v_cmp, sinks, selected, out, lse = fctx.saved_tensors
        call = _Call(q, k, v, k_cmp, v_cmp, sinks, selected, *fctx.settings)
        acc = call.acc
        dout = dout.to(acc)
        # d lse / d s = p, so the lse's gradient enters as a shift of delta = rowsum(dout * out)
        delta = (dout * out).sum(-1)  # (B, Hq, Nq)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        dq = torch.zeros_like(q, dtype=acc)
        dk = torch.zeros_like(k, dtype=acc)
        dv = dk if call.kv_same else torch.zeros_like(v, dtype=acc)
        dkc = torch.zeros_like(k_cmp, dtype=acc)
        dvc = dkc if call.cmp_same else torch.zeros_like(v_cmp, dtype=acc)
        dsinks = torch.zeros(call.Hq, dtype=acc, device=q.device) if sinks is not None else None
        grads = (dq, dk, dv, dkc, dvc, dsinks)
        band, rows, sub = _sizes(call)
        _band_backward(call, lse, delta, dout, grads, band)
        if selected is not None:
            _lists_backward(call, lse, delta, dout, grads, rows, sub)
        res = [dq.to(q.dtype), dk.to(k.dtype), None if call.kv_same else dv.to(v.dtype), dkc.to(k_cmp.dtype),
               None if call.cmp_same else dvc.to(v_cmp.dtype), None if sinks is None else dsinks.to(sinks.dtype)]
        if call.kv_same:
            res[2] = torch.zeros_like(v)  # the key gradient holds both uses of the one tensor
        if call.cmp_same:
            res[4] = torch.zeros_like(v_cmp)
        return (*res, None, None, None, None, None, None, None, None)


def compressed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cmp: torch.Tensor,
                         v_cmp: torch.Tensor, *, rate: int, window: int, selected: torch.Tensor | None = None,
                         sinks: torch.Tensor | None = None, scale: float | None = None, q_start: int | None = None,
                         k_start: int = 0, return_lse: bool = False) -> torch.Tensor | AttentionOutput:
    """One softmax over a sliding window of keys and over the visible (selected) compressed entries.

    Args:
        q: (B, Hq, Nq, D) queries at absolute positions ``q_start + i``.
        k: (B, Hkv, Nk, D) window keys at positions ``k_start + j``; v: (B, Hkv, Nk, Dv). K = V models pass one
            tensor twice (its gradient then holds both uses).
        k_cmp: (B, Hkv, T, D) compressed entries; v_cmp: (B, Hkv, T, Dv) (the same tensor for K = V).
        rate: tokens per entry: entry ``t`` is visible to a query at ``p`` once ``(t + 1) * rate <= p + 1``.
        window: window keys per query, the query's own position included (HF ``sliding_window``); 0 for none.
        selected: (B, Hs, Nq, K) int64 entry ids per query row, ``-1`` = none, Hs in {1, Hkv, Hq}; None attends
            every visible entry (HCA).
        sinks: (Hq,) per-head logits in the softmax denominator only (gpt-oss, V4), or None.
        scale: score scale, default ``D ** -0.5``.
        q_start: the first query's absolute position; default ``k_start + Nk - Nq`` (bottom-right).
        k_start: the first window key's absolute position.
        return_lse: also return the log-sum-exp (the sink included).

    Returns:
        out (B, Hq, Nq, Dv) in q's dtype, or :class:`qkv.AttentionOutput` ``(out, lse (B, Hq, Nq))`` with
        ``return_lse`` (lse float32, float64 for float64 inputs; ``-inf`` for an empty row).

    Example:
        >>> import torch
        >>> from qkv.sparse import compressed_attention
        >>> q, kv = torch.randn(1, 8, 32, 16), torch.randn(1, 1, 32, 16)
        >>> cmp = torch.randn(1, 1, 8, 16)                 # 32 tokens at rate 4, every entry attended (HCA)
        >>> compressed_attention(q, kv, kv, cmp, cmp, rate=4, window=8, sinks=torch.zeros(8)).shape
        torch.Size([1, 8, 32, 16])
    """
    fn = "compressed_attention"
    _, _, _, _, _, _, q_start = _check(fn, q, k, v, k_cmp, v_cmp, rate, window, selected, sinks, scale, q_start,
                                       k_start)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    sel = None if selected is None else selected.to(torch.int64)
    out, lse = _CompressedAttention.apply(q, k, v, k_cmp, v_cmp, sinks, sel, rate, window, scale, q_start, k_start,
                                          k is v, k_cmp is v_cmp)
    if not return_lse:
        return out
    return AttentionOutput(out, lse if lse.dtype == torch.float64 else lse.to(torch.float32))
