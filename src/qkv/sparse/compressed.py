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

#: Bytes of gathered entries per chunk of query rows (per-chunk torch overheads against cache reuse).
_CHUNK_BYTES = 16 << 20
#: Query rows per chunk, at least and at most (the window band is c + window - 1 keys wide).
_MIN_ROWS, _MAX_ROWS = 8, 128


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


class _Chunk:
    """One chunk of query rows ``r0 .. r0 + c`` laid out per KV head as R = c·G score rows.

    Rows are ordered (c, G) when the entry lists are shared by a KV head's query heads (so a row's G heads read
    one gathered list), (G, c) when each query head has its own list. Holds the window band, the entry ids and
    what the forward and the backward both need."""

    def __init__(self, ctx, r0: int, r1: int):
        B, Hkv, G, acc = ctx.B, ctx.Hkv, ctx.G, ctx.acc
        dev = ctx.q.device
        c = r1 - r0
        self.r0, self.r1, self.c = r0, r1, c
        self.per_head = ctx.per_head
        q = ctx.q[:, :, r0:r1].to(acc).view(B, Hkv, G, c, -1)
        self.qr = (q if self.per_head else q.transpose(2, 3)).reshape(B, Hkv, c * G, -1)  # (B, Hkv, R, D)
        pos = ctx.q_start + r0 + torch.arange(c, device=dev)  # (c,)
        row_pos = (pos.repeat(G) if self.per_head else pos.repeat_interleave(G)).view(c * G, 1)  # (R, 1)
        # window band: key indices j0 .. j1 cover positions (first - window, last]
        self.j0 = min(max(ctx.q_start + r0 - ctx.window + 1 - ctx.k_start, 0), ctx.Nk)
        self.j1 = max(min(ctx.q_start + r1 - ctx.k_start, ctx.Nk), self.j0) if ctx.window else self.j0
        kpos = ctx.k_start + torch.arange(self.j0, self.j1, device=dev).view(1, -1)
        self.band_ok = (kpos <= row_pos) & (kpos > row_pos - ctx.window)  # (R, L)
        self.kb = ctx.k[:, :, self.j0:self.j1].to(acc)  # (B, Hkv, L, D)
        self.vb = self.kb if ctx.kv_same else ctx.v[:, :, self.j0:self.j1].to(acc)  # (B, Hkv, L, Dv)
        limit = (pos + 1) // ctx.rate  # (c,) entries below this are complete
        if ctx.selected is None:  # every complete entry (HCA): a dense staircase over entries 0 .. t1
            self.t1 = min(int(limit[-1]) if c else 0, ctx.T)
            self.cmp_ok = torch.arange(self.t1, device=dev).view(1, -1) < (row_pos + 1) // ctx.rate  # (R, t1)
            self.kc = ctx.k_cmp[:, :, :self.t1].to(acc)
            self.vc = self.kc if ctx.cmp_same else ctx.v_cmp[:, :, :self.t1].to(acc)
            return
        # listed entries: drop repeats, -1 and entries not yet complete; gather only the rest
        ids = ctx.selected[:, :, r0:r1]  # (B, Hs, c, K)
        Hx = Hkv * G if self.per_head else Hkv
        ids = ids.expand(B, Hx, c, ids.shape[-1])  # Hs is 1 or Hx here (Hs = Hq = Hkv when G = 1)
        K = ids.shape[-1]
        safe = torch.where(ids < 0, ctx.T, ids).reshape(-1, K)  # -1 -> a spare column T
        # first occurrences: every row writes each slot number at its entry, then keeps the slots that won
        slot = torch.arange(K, device=dev, dtype=torch.int32).expand(safe.shape)
        stamp = ctx.stamp(safe.shape[0]).scatter_(1, safe, slot)
        first = stamp.gather(1, safe) == slot
        self.ok = first.view(B, Hx, c, K) & (ids >= 0) & (ids < limit.view(1, 1, c, 1))  # (B, Hx, c, K)
        cols = ids.clamp_min(0)
        width = K
        kv_head = torch.arange(Hx, device=dev) // (G if self.per_head else 1)
        base = (torch.arange(B, device=dev).view(B, 1) * Hkv + kv_head.view(1, Hx)) * ctx.T  # (B, Hx)
        self.flat = (base.view(B, Hx, 1, 1) + cols).reshape(-1)  # rows of k_cmp.view(-1, D)
        self.shape5 = (B, Hx, c, width)
        self.gx = 1 if self.per_head else G  # score rows per list
        self.kc = ctx.k_cmp.reshape(-1, ctx.D).index_select(0, self.flat).view(*self.shape5, ctx.D).to(acc)
        self.vc = self.kc if ctx.cmp_same else \
            ctx.v_cmp.reshape(-1, ctx.Dv).index_select(0, self.flat).view(*self.shape5, ctx.Dv).to(acc)

    def scores(self, ctx):
        """Scaled scores (B, Hkv, R, L + K') with -inf where masked."""
        B, Hkv, R = self.qr.shape[:3]
        s_w = ctx.scale * (self.qr @ self.kb.transpose(-1, -2))  # (B, Hkv, R, L)
        s_w = s_w.masked_fill(~self.band_ok, float("-inf"))
        s_c = ctx.scale * self._cmp_product(self.qr, self.kc)  # (B, Hkv, R, K')
        if ctx.selected is None:
            s_c = s_c.masked_fill(~self.cmp_ok, float("-inf"))
        else:
            s_c = s_c.masked_fill(~self._rows(self.ok), float("-inf"))
        return torch.cat([s_w, s_c], -1)

    def _rows(self, x):
        """A per-(list head, row, entry) tensor (B, Hx, c, K') as (B, Hkv, R, K') score rows."""
        B, Hx, c, K = x.shape
        Hkv, R = self.qr.shape[1], self.qr.shape[2]
        if self.per_head:  # (B, Hkv * G, c, K') is already (B, Hkv, G * c, K')
            return x.reshape(B, Hkv, R, K)
        return x.unsqueeze(3).expand(B, Hx, c, R // c, K).reshape(B, Hkv, R, K)

    def _cmp_product(self, rows, mats, transpose=True):
        """rows (B, Hkv, R, X) times each row's entries: the dense entries (B, Hkv, t1, Y), or the gathered ones
        (B, Hx, c, K', Y) per list. ``transpose``: against mats^T (scores) else against mats (P @ V)."""
        if self.shape5 is None:
            return rows @ (mats.transpose(-1, -2) if transpose else mats)
        B, Hx, c, _ = self.shape5
        per = rows.reshape(B, Hx, c, self.gx, rows.shape[-1])  # (B, Hx, c, rows per list, X)
        out = per @ (mats.transpose(-1, -2) if transpose else mats)  # (B, Hx, c, rows per list, .)
        return out.reshape(B, self.qr.shape[1], self.qr.shape[2], out.shape[-1])

    shape5 = None


class _Ctx:
    """The call's operands and settings, shared by the chunks."""

    def __init__(self, q, k, v, k_cmp, v_cmp, selected, rate, window, scale, q_start, k_start, kv_same, cmp_same):
        self.q, self.k, self.v, self.k_cmp, self.v_cmp = q, k, v, k_cmp, v_cmp
        self.B, self.Hq, self.Nq, self.D = q.shape
        self.Hkv, self.Nk, self.T, self.Dv = k.shape[1], k.shape[2], k_cmp.shape[2], v.shape[3]
        self.G = self.Hq // self.Hkv
        self.selected, self.rate, self.window, self.scale = selected, rate, window, scale
        self.q_start, self.k_start = q_start, k_start
        self.kv_same, self.cmp_same = kv_same, cmp_same
        self.per_head = selected is not None and selected.shape[1] == self.Hq and self.G > 1
        self.acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        K = selected.shape[-1] if selected is not None else min(self.T, 4096)
        width = self.D + (0 if cmp_same else self.Dv)  # gathered floats per listed entry
        per_row = max(1, (self.Hkv if not self.per_head else self.Hq) * self.B * K * width * 4)
        self.rows = max(_MIN_ROWS, min(_MAX_ROWS, _CHUNK_BYTES // per_row))
        self._stamp = None

    def stamp(self, rows: int) -> torch.Tensor:
        """A scratch (rows, T + 1) int32 table for finding repeated ids; only slots written before are read."""
        if self._stamp is None or self._stamp.shape[0] < rows:
            self._stamp = torch.empty(rows, self.T + 1, dtype=torch.int32, device=self.q.device)
        return self._stamp[:rows]

    def chunks(self):
        for r0 in range(0, self.Nq, self.rows):
            yield _Chunk(self, r0, min(self.Nq, r0 + self.rows))

    def head_rows(self, x, ch):
        """(B, Hq, c, ...) -> (B, Hkv, R, ...) in the chunk's row order."""
        B, Hkv, G, c = self.B, self.Hkv, self.G, ch.c
        x = x.reshape(B, Hkv, G, c, *x.shape[3:])
        return (x if ch.per_head else x.transpose(2, 3)).reshape(B, Hkv, c * G, *x.shape[4:])

    def unrows(self, x, ch):
        """(B, Hkv, R, ...) in the chunk's row order -> (B, Hq, c, ...)."""
        B, Hkv, G, c = self.B, self.Hkv, self.G, ch.c
        if ch.per_head:
            return x.reshape(B, self.Hq, c, *x.shape[3:])
        return x.reshape(B, Hkv, c, G, *x.shape[3:]).transpose(2, 3).reshape(B, self.Hq, c, *x.shape[3:])


def _softmax(s, sink_rows):
    """Probabilities over the columns of ``s`` (B, Hkv, R, X) with an optional sink logit per row (Hkv, R) in the
    denominator; lse (B, Hkv, R), -inf for an empty row (whose probabilities are 0)."""
    m = s.amax(-1) if s.shape[-1] else s.new_full(s.shape[:-1], float("-inf"))
    if sink_rows is not None:
        m = torch.maximum(m, sink_rows)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m_safe.unsqueeze(-1))
    total = e.sum(-1)
    if sink_rows is not None:
        total = total + torch.exp(sink_rows - m_safe)
    empty = total == 0
    safe = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(safe))
    return e / safe.unsqueeze(-1), lse


def _sink_rows(ctx, ch, sinks):
    if sinks is None:
        return None
    z = sinks.to(ctx.acc).view(1, ctx.Hq, 1).expand(ctx.B, ctx.Hq, ch.c)
    return ctx.head_rows(z, ch)  # (B, Hkv, R)


def _forward(ctx, sinks):
    out = ctx.q.new_empty(ctx.B, ctx.Hq, ctx.Nq, ctx.Dv, dtype=ctx.acc)
    lse = ctx.q.new_empty(ctx.B, ctx.Hq, ctx.Nq, dtype=ctx.acc)
    for ch in ctx.chunks():
        p, l = _softmax(ch.scores(ctx), _sink_rows(ctx, ch, sinks))
        L = ch.kb.shape[2]
        o = p[..., :L] @ ch.vb + ch._cmp_product(p[..., L:], ch.vc, transpose=False)  # (B, Hkv, R, Dv)
        out[:, :, ch.r0:ch.r1] = ctx.unrows(o, ch)
        lse[:, :, ch.r0:ch.r1] = ctx.unrows(l, ch)
    return out, lse


class _CompressedAttention(torch.autograd.Function):
    """Forward by chunks; backward recomputes each chunk's probabilities from the saved lse."""

    @staticmethod
    def forward(fctx, q, k, v, k_cmp, v_cmp, sinks, selected, rate, window, scale, q_start, k_start, kv_same,
                cmp_same):
        ctx = _Ctx(q, k, v, k_cmp, v_cmp, selected, rate, window, scale, q_start, k_start, kv_same, cmp_same)
        out, lse = _forward(ctx, sinks)
        fctx.save_for_backward(q, k, v, k_cmp, v_cmp, sinks, selected, out, lse)
        fctx.settings = (rate, window, scale, q_start, k_start, kv_same, cmp_same)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(fctx, dout, dlse):
        q, k, v, k_cmp, v_cmp, sinks, selected, out, lse = fctx.saved_tensors
        rate, window, scale, q_start, k_start, kv_same, cmp_same = fctx.settings
        ctx = _Ctx(q, k, v, k_cmp, v_cmp, selected, rate, window, scale, q_start, k_start, kv_same, cmp_same)
        acc = ctx.acc
        dout = dout.to(acc)
        # d lse / d s = p, so the lse's gradient enters as a shift of delta = rowsum(dout * out)
        delta = (dout * out).sum(-1)  # (B, Hq, Nq)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        dq = torch.zeros_like(q, dtype=acc)
        dk = torch.zeros_like(k, dtype=acc)
        dv = dk if kv_same else torch.zeros_like(v, dtype=acc)
        dkc = torch.zeros_like(k_cmp, dtype=acc)
        dvc = dkc if cmp_same else torch.zeros_like(v_cmp, dtype=acc)
        dsinks = torch.zeros(ctx.Hq, dtype=acc, device=q.device) if sinks is not None else None
        for ch in ctx.chunks():
            s = ch.scores(ctx)
            lr = ctx.head_rows(lse[:, :, ch.r0:ch.r1], ch)  # (B, Hkv, R)
            p = torch.exp(s - torch.where(torch.isneginf(lr), 0.0, lr).unsqueeze(-1))  # (B, Hkv, R, X)
            do = ctx.head_rows(dout[:, :, ch.r0:ch.r1], ch)  # (B, Hkv, R, Dv)
            dl = ctx.head_rows(delta[:, :, ch.r0:ch.r1], ch)  # (B, Hkv, R)
            L = ch.kb.shape[2]
            pw, pc = p[..., :L], p[..., L:]
            ds_w = pw * (do @ ch.vb.transpose(-1, -2) - dl.unsqueeze(-1))  # (B, Hkv, R, L)
            ds_c = pc * (ch._cmp_product(do, ch.vc) - dl.unsqueeze(-1))  # (B, Hkv, R, K')
            dqr = scale * (ds_w @ ch.kb + ch._cmp_product(ds_c, ch.kc, transpose=False))
            dq[:, :, ch.r0:ch.r1] = ctx.unrows(dqr, ch)
            dk[:, :, ch.j0:ch.j1] += scale * (ds_w.transpose(-1, -2) @ ch.qr)
            dv[:, :, ch.j0:ch.j1] += pw.transpose(-1, -2) @ do
            if ch.shape5 is None:
                dkc[:, :, :ch.t1] += scale * (ds_c.transpose(-1, -2) @ ch.qr)
                dvc[:, :, :ch.t1] += pc.transpose(-1, -2) @ do
            else:
                dk_sel = scale * _per_entry(ch, ds_c, ch.qr)  # (B, Hx, c, K', D)
                dkc.view(-1, ctx.D).index_add_(0, ch.flat, dk_sel.reshape(-1, ctx.D))
                dvc.view(-1, ctx.Dv).index_add_(0, ch.flat, _per_entry(ch, pc, do).reshape(-1, ctx.Dv))
            if sinks is not None:
                p_sink = torch.exp(_sink_rows(ctx, ch, sinks) - torch.where(torch.isneginf(lr), 0.0, lr))
                dsinks -= ctx.unrows(p_sink * dl, ch).sum((0, 2))
        grads = [dq.to(q.dtype), dk.to(k.dtype), None if kv_same else dv.to(v.dtype), dkc.to(k_cmp.dtype),
                 None if cmp_same else dvc.to(v_cmp.dtype), None if sinks is None else dsinks.to(sinks.dtype)]
        if kv_same:
            grads[2] = torch.zeros_like(v)  # the key gradient holds both uses of the one tensor
        if cmp_same:
            grads[4] = torch.zeros_like(v_cmp)
        return (*grads, None, None, None, None, None, None, None, None)


def _per_entry(ch, w, rows):
    """sum over a list's score rows of w (B, Hkv, R, K') times rows (B, Hkv, R, X): (B, Hx, c, K', X)."""
    B, Hx, c, K = ch.shape5
    w5 = w.reshape(B, Hx, c, ch.gx, K)
    r5 = rows.reshape(B, Hx, c, ch.gx, rows.shape[-1])
    return w5.transpose(-1, -2) @ r5


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
