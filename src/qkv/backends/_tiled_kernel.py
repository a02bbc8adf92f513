"""The tiled backend's inner loops: online-softmax forward and recomputing backward over a plan.

Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness";
Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning".

Shape legend: nb batch rows in this slice, Hkv key/value heads, G query heads per kv head, TQ/TK tile
counts, R query tiles in a row batch (``nact`` of them active in a chunk), bq/bk tile sizes, GB = G*bq
rows of one query tile, W = C * bk key columns of a chunk, D/Dv head dims, E any trailing width.

Layouts:
- Per-query tensors (q, out, lse; dO, delta, dq) stay in their (nb, Hq, Nq_pad, E) order, read
  through a flat [nb*Hq*TQ, bq*E] view. A row batch gathers its rows into a reused buffer as
  ``[nb, Hkv, R*GB, E]``: tile by tile, each tile holding its G heads' rows back to back, so one
  matmul covers a whole GQA group without repeating K/V. Results are scattered back the same way.
- Keys/values as ``[nb, Hkv, TK * bk, D]`` (zero-padded only when bk does not divide Nk).
Fresh multi-megabyte tensors cost page faults that on CPU can take as long as the matmuls filling
them, so every per-step tensor lives in a reused workspace and no full-size copy of q is made.
"""

from __future__ import annotations

import torch

from .._dropout import keep_mask
from ..masks.base import Mask
from ..mods.base import ScoreMod
from ._tiled_plan import Chunk, RowBatch, TilePlan

__all__ = ["Problem", "forward_slice", "backward_slice", "pad_rows", "pad_keys", "unpad_rows"]

_NEG_INF = float("-inf")


def pad_rows(x: torch.Tensor, plan: TilePlan, dtype, fill: float = 0.0) -> torch.Tensor:
    """(nb, Hq, Nq, E) -> (nb, Hq, TQ*bq, E) in ``dtype`` (a copy only when padding or casting)."""
    pad = plan.tq * plan.block_q - x.shape[2]
    x = x.to(dtype)
    return torch.nn.functional.pad(x, (0, 0, 0, pad), value=fill) if pad else x.contiguous()


def pad_keys(x: torch.Tensor, plan: TilePlan, dtype) -> torch.Tensor:
    """(nb, Hkv, Nk, D) -> (nb, Hkv, TK*bk, D) (a copy only when padding or casting)."""
    pad = plan.tk * plan.block_k - x.shape[2]
    x = x.to(dtype)
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x.contiguous()


def unpad_rows(x: torch.Tensor, plan: TilePlan) -> torch.Tensor:
    return x[:, :, : plan.nq].contiguous() if x.shape[2] != plan.nq else x


class _Rows:
    """Moves one row batch between a padded per-query tensor (nb, Hq, TQ*bq, E) and the batch layout
    [nb, Hkv, R*GB, E]: a single ``index_select`` / ``index_copy_`` along dim 0 of a flat view (one
    parallel copy), or a plain slice when the plan keeps tile order and there is no GQA group."""

    def __init__(self, plan: TilePlan, rb: RowBatch, nb: int, Hkv: int, G: int, device) -> None:
        self.plan, self.rb, self.nb, self.Hkv, self.G = plan, rb, nb, Hkv, G
        self.direct = plan.identity and G == 1
        if not self.direct:
            h = torch.arange(nb * Hkv, device=device).view(-1, 1, 1) * G
            g = torch.arange(G, device=device).view(1, 1, -1)
            tiles = plan.order[rb.r0:rb.r1].view(1, -1, 1)
            self.ids = ((h + g) * plan.tq + tiles).reshape(-1)  # [nb*Hkv*R*G] rows of the flat view

    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        nb, Hq, n = x.shape[:3]
        return x.view(nb * Hq * self.plan.tq, -1)

    def gather(self, x: torch.Tensor, ws: _Workspace, name: str) -> torch.Tensor:
        """x (nb, Hq, TQ*bq, *E) -> [nb, Hkv, R*GB, *E] (a view or a workspace buffer)."""
        bq, extra = self.plan.block_q, x.shape[3:]
        n = (self.rb.r1 - self.rb.r0) * self.G * bq
        if self.direct:
            return x[:, :, self.rb.r0 * bq: self.rb.r1 * bq]
        out = ws.get(name, (self.nb, self.Hkv, n, *extra))
        torch.index_select(self._flat(x), 0, self.ids, out=out.view(self.ids.numel(), -1))
        return out

    def scatter(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Write batch rows [nb, Hkv, R*GB, *E] into x (nb, Hq, TQ*bq, *E)."""
        bq = self.plan.block_q
        if self.direct:
            x[:, :, self.rb.r0 * bq: self.rb.r1 * bq] = rows
        else:
            self._flat(x).index_copy_(0, self.ids, rows.reshape(self.ids.numel(), -1))


def _nan_like_rows(plan: TilePlan, nb: int, Hq: int, extra: tuple[int, ...], dtype, device) -> torch.Tensor:
    """A padded per-query result buffer, poisoned with NaN so rows no step wrote would show."""
    return torch.full((nb, Hq, plan.tq * plan.block_q, *extra), float("nan"), dtype=dtype, device=device)


class Problem:
    """What the loops need besides the tensors: the request's semantics for one batch slice."""

    def __init__(self, *, b_index: torch.Tensor, Hkv: int, G: int, nq: int, nk: int, scale: float,
                 mask: Mask | None, score_mod: ScoreMod | None, dropout_p: float, seed: int, device,
                 fill_masked: bool = True) -> None:
        self.b = b_index.view(-1, 1, 1, 1, 1, 1)  # [nb, 1, 1, 1, 1, 1] true batch index
        self.h = (torch.arange(Hkv, device=device).view(1, -1, 1, 1, 1, 1) * G
                  + torch.arange(G, device=device).view(1, 1, 1, -1, 1, 1))  # [1, Hkv, 1, G, 1, 1] query head
        self.G, self.H = G, Hkv * G
        self.nq, self.nk, self.scale = nq, nk, scale
        self.mask, self.mod = mask, score_mod
        self.dropout_p, self.seed = dropout_p, seed
        self.fill_masked = fill_masked  # scores may be non-finite: fill masked ones (see _mask_)
        self.key = (int(b_index[0]) if b_index.numel() else 0, b_index.numel(), Hkv, G, nq, nk)  # mask-bias key


#: Bytes of mask biases a plan may keep between calls (plans are cached with their mask).
_MASK_CACHE_BYTES = 32 << 20


class _ChunkTiles:
    """One chunk's index tensors and biases, shaped to broadcast against the 6-D score view
    [nb, Hkv, nact, G, bq, W]. Derived tensors are kept in the chunk's cache (the plan is cached
    with its mask, so later calls skip rebuilding them)."""

    def __init__(self, pb: Problem, plan: TilePlan, rb: RowBatch, ch: Chunk) -> None:
        self.pb, self.plan, self.rb, self.ch = pb, plan, rb, ch

    def idx(self):
        qi = self.rb.q_idx[:, :, : self.ch.nact]  # [1, 1, nact, 1, bq, 1]
        return self.pb.b, self.pb.h, qi, self.ch.kj

    def colbias(self, dtype, lo: int) -> torch.Tensor | None:
        """Hides padding slots and keys past Nk over columns ``lo:`` (None if all are valid): a 0 / -inf
        bias, or the bool of disallowed columns when ``dtype`` is None (see :func:`_mask_`)."""
        ch = self.ch
        if ch.colvalid is None:
            return None
        key = ("colbias", dtype, lo)
        if key not in ch.cache:
            ch.cache[key] = _bias(ch.colvalid[..., lo:], dtype)
        return ch.cache[key]

    def mask_bias(self, dtype, pw: int) -> torch.Tensor:
        """The mask predicate (and padding) over the first ``pw`` columns, as for :meth:`colbias`."""
        pb, ch = self.pb, self.ch
        key = ("mask", dtype, pw, pb.key)
        bias = ch.cache.get(key)
        if bias is None:
            b, h, qi, kj = self.idx()
            allowed = pb.mask.allowed(b, h, qi, kj[..., :pw], pb.nq, pb.nk)
            if ch.colvalid is not None:
                allowed = allowed & ch.colvalid[..., :pw]
            bias = _bias(allowed, dtype)
            nbytes = bias.numel() * bias.element_size()
            if self.plan.cached_bytes + nbytes <= _MASK_CACHE_BYTES:
                ch.cache[key] = bias
                self.plan.cached_bytes += nbytes
        return bias

    def flat_ids(self, nbh: int) -> torch.Tensor:
        """Row ids into a [nb*Hkv*TK, bk*D] view for every (head, row, slot), in that order."""
        key = ("flat", nbh)
        if key not in self.ch.cache:
            heads = torch.arange(nbh, device=self.ch.ids.device).view(-1, 1, 1) * self.plan.tk
            self.ch.cache[key] = (heads + self.ch.ids.unsqueeze(0)).reshape(-1)  # [nb*Hkv*nact*C]
        return self.ch.cache[key]

    def may_empty(self) -> bool:
        """Whether some row can have no allowed key in this chunk: where something is masked, or where a score
        modifier may give a whole row -inf (an HF-style additive mask), which must read as a fully masked row."""
        return self.ch.partial_width > 0 or self.ch.colvalid is not None or self.pb.mod is not None

    def keep(self) -> torch.Tensor:
        pb = self.pb
        return keep_mask(pb.seed, pb.dropout_p, *self.idx(), pb.H, pb.nq, pb.nk)


class _Workspace:
    """Step buffers reused across the loop. Fresh multi-megabyte tensors each step cost page faults
    that, on CPU, take as long as the matmuls that fill them."""

    def __init__(self, dtype, device) -> None:
        self.dtype, self.device = dtype, device
        self.bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=self.dtype, device=self.device)
            self.bufs[name] = buf
        return buf[:n].view(shape)


def _raw_scores(step: _ChunkTiles, q_act: torch.Tensor, kt: torch.Tensor, scale: float, ws: _Workspace):
    """``s = scale * q k^T`` for a chunk: [nb, Hkv, nact, GB, W], and the chunk's queries and keys as
    3-D matmul operands: shared chunks [nb*Hkv, nact*GB, D] x [nb*Hkv, W, D]; gathered chunks
    [nb*Hkv*nact, GB, D] x [nb*Hkv*nact, W, D]."""
    nb, Hkv, rows, D = q_act.shape
    ch = step.ch
    bk, W, nact = step.plan.block_k, ch.width * step.plan.block_k, ch.nact
    GB = rows // nact
    if ch.start is not None:  # every active row reads the same contiguous key tiles: one big matmul
        q3 = q_act.reshape(nb * Hkv, rows, D)
        k3 = kt[:, :, ch.start * bk: ch.start * bk + W].reshape(nb * Hkv, W, D)
        s = ws.get("s", (nb * Hkv, rows, W))
    else:
        if q_act.is_contiguous():  # the row batch's gathered queries, every row active: a view
            q3 = q_act.view(-1, GB, D)
        else:
            q3 = ws.get("q", (nb, Hkv, nact, GB, D))
            q3.copy_(q_act.view(nb, Hkv, nact, GB, D))
            q3 = q3.view(-1, GB, D)
        k3 = _gather(kt, step, ws, "k").view(-1, W, D)
        s = ws.get("s", (nb * Hkv * nact, GB, W))
    torch.baddbmm(s, q3, k3.transpose(1, 2), beta=0.0, alpha=scale, out=s)  # beta=0 ignores s's contents
    return s.view(nb, Hkv, nact, GB, W), q3, k3


def _values(step: _ChunkTiles, vt: torch.Tensor, ws: _Workspace) -> torch.Tensor:
    """The chunk's values as a 3-D matmul operand (see :func:`_raw_scores`)."""
    nb, Hkv, _, Dv = vt.shape
    ch = step.ch
    bk, W = step.plan.block_k, ch.width * step.plan.block_k
    if ch.start is not None:
        return vt[:, :, ch.start * bk: ch.start * bk + W].reshape(nb * Hkv, W, Dv)
    return _gather(vt, step, ws, "v").view(-1, W, Dv)


def _gather(xt: torch.Tensor, step: _ChunkTiles, ws: _Workspace, name: str) -> torch.Tensor:
    """Rows of ``xt`` [nb, Hkv, TK*bk, D] for the chunk's tile ids: [nb, Hkv, nact*C, bk, D].

    One ``index_select`` along dim 0 of a [nb*Hkv*TK, bk*D] view: a single parallel copy (along
    other dims torch copies index by index)."""
    nb, Hkv, n, D = xt.shape
    ch, bk = step.ch, step.plan.block_k
    out = ws.get(name, (nb, Hkv, ch.nact * ch.width, bk, D))
    torch.index_select(xt.view(-1, bk * D), 0, step.flat_ids(nb * Hkv), out=out.view(-1, bk * D))
    return out


def _modify(s: torch.Tensor, pb: Problem, step: _ChunkTiles) -> torch.Tensor:
    """Apply the score modifier to s [nb, Hkv, nact, GB, W]; returns a fresh tensor of that shape."""
    nb, Hkv, nact, GB, W = s.shape
    s6 = s.view(nb, Hkv, nact, pb.G, GB // pb.G, W)
    out = pb.mod.apply(s6, *step.idx(), pb.nq, pb.nk).to(s.dtype)
    return torch.broadcast_to(out, s6.shape).contiguous().view(s.shape)


def _mask_(s: torch.Tensor, pb: Problem, step: _ChunkTiles) -> None:
    """Set disallowed scores (and padding columns) of s [nb, Hkv, nact, GB, W] to -inf, in place.

    The predicate runs on the chunk's leading PARTIAL columns only; FULL columns see just the
    padding mask (if the chunk has padding). With finite scores, masking adds a 0 / -inf bias: on
    CPU a broadcast add is several times faster than a broadcast ``masked_fill_``. When scores may be
    non-finite (non-finite inputs, e.g. garbage in masked cache slots, or a score modifier), it fills
    instead, so a masked NaN never reaches the softmax (as in the reference)."""
    nb, Hkv, nact, GB, W = s.shape
    s6 = s.view(nb, Hkv, nact, pb.G, GB // pb.G, W)
    pw = step.ch.partial_width * step.plan.block_k if pb.mask is not None else 0
    dtype = None if pb.fill_masked else s.dtype
    for cols, hide in ((slice(0, pw), step.mask_bias(dtype, pw) if pw else None),
                       (slice(pw, W), step.colbias(dtype, pw) if pw < W else None)):
        if hide is None:
            continue
        if dtype is None:
            s6[..., cols].masked_fill_(hide, _NEG_INF)
        else:
            s6[..., cols].add_(hide)


def _bias(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """A 0 / -inf bias from allowed pairs, or (``dtype`` None) the bool of disallowed pairs."""
    if dtype is None:
        return ~allowed
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full((), _NEG_INF, dtype=dtype, device=allowed.device))


def _scores(plan: TilePlan, pb: Problem, step: _ChunkTiles, q_act: torch.Tensor, kt: torch.Tensor, ws: _Workspace):
    s, _, _ = _raw_scores(step, q_act, kt, pb.scale, ws)
    if pb.mod is not None:
        s = _modify(s, pb, step)
    _mask_(s, pb, step)
    return s


def forward_slice(plan: TilePlan, pb: Problem, q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, stats=None):
    """Online-softmax attention over the plan.

    Each chunk's softmax is one fused pass; its log-sum-exp comes from the chunk's row max ``m`` and
    the largest probability (``exp(0) / l``): ``lse_c = m - log(max p)``. Chunks merge as in
    :func:`qkv.merge_states`: ``lse = logaddexp(lse, lse_c)``, ``O = O e^(lse_old - lse) + O_c e^(lse_c - lse)``.

    Args:
        q: (nb, Hq, TQ*bq, D) padded queries (compute dtype).
        kt, vt: (nb, Hkv, TK*bk, D / Dv) padded keys/values.

    Returns:
        out (nb, Hq, TQ*bq, Dv) and lse (nb, Hq, TQ*bq), compute dtype; lse is ``-inf`` on rows with
        no allowed key, whose output is 0. Rows that no step wrote stay NaN.
    """
    nb, Hq, _, _ = q.shape
    Hkv, Dv = kt.shape[1], vt.shape[-1]
    GB = pb.G * plan.block_q
    ws = _Workspace(q.dtype, q.device)
    out = _nan_like_rows(plan, nb, Hq, (Dv,), q.dtype, q.device)
    lse = _nan_like_rows(plan, nb, Hq, (), q.dtype, q.device)
    for rb in plan.batches:
        rows = _Rows(plan, rb, nb, Hkv, pb.G, q.device)
        n = (rb.r1 - rb.r0) * GB
        q_rb = rows.gather(q, ws, "q_rb")  # [nb, Hkv, R*GB, D]
        o_rb = ws.get("o_rb", (nb, Hkv, n, Dv))  # set by the first chunk, merged into by the others
        l_rb = ws.get("l_rb", (nb, Hkv, n))
        first = rb.chunks[0].nact * GB if rb.chunks else 0
        o_rb[:, :, first:] = 0.0  # rows with no key tile at all
        l_rb[:, :, first:] = _NEG_INF
        for i, ch in enumerate(rb.chunks):
            a = ch.nact * GB
            step = _ChunkTiles(pb, plan, rb, ch)
            s = _scores(plan, pb, step, q_rb[:, :, :a], kt, ws)  # [nb, Hkv, nact, GB, W]
            m_c = s.amax(-1)  # [nb, Hkv, nact, GB]
            # In place on CPU, whose fused last-dim softmax reads each row before writing it: the
            # step's working set then fits the cache better.
            p = s if s.device.type == "cpu" else ws.get("p", s.shape)
            torch.softmax(s, -1, out=p)
            lse_c = m_c - p.amax(-1).log_()  # the largest probability is exp(0) / l_c
            if step.may_empty():  # rows with nothing allowed in this chunk: softmax gave NaN
                empty = m_c == _NEG_INF
                if bool(empty.any()):
                    p.masked_fill_(empty.unsqueeze(-1), 0.0)
                    lse_c.masked_fill_(empty, _NEG_INF)
            if pb.dropout_p > 0:  # lse counts every probability; only the output drops some
                p.view(nb, Hkv, ch.nact, pb.G, plan.block_q, -1).mul_(step.keep())
            v3 = _values(step, vt, ws)
            direct = i == 0 and a == n  # the first chunk covers every row: write the output in place
            pv = o_rb if direct else ws.get("pv", (nb, Hkv, a, Dv))
            torch.bmm(p.view(v3.shape[0], -1, v3.shape[1]), v3, out=pv.view(v3.shape[0], -1, Dv))
            lse_c = lse_c.view(nb, Hkv, a)
            if i == 0:
                if not direct:
                    o_rb[:, :, :a] = pv
                l_rb[:, :, :a] = lse_c
                continue
            l_old = l_rb[:, :, :a]
            l_new = torch.logaddexp(l_old, lse_c)
            l_ref = l_new.masked_fill(l_new == _NEG_INF, 0.0)
            w_old = (l_old - l_ref).exp_().unsqueeze(-1)
            w_new = (lse_c - l_ref).exp_().unsqueeze(-1)
            o_rb[:, :, :a].mul_(w_old).addcmul_(pv, w_new)
            l_old.copy_(l_new)
        if pb.dropout_p > 0:
            o_rb.mul_(1.0 / (1.0 - pb.dropout_p))
        rows.scatter(o_rb, out)
        rows.scatter(l_rb, lse)
    if stats is not None:
        stats.add(plan)
    return out, lse


def _tile_probs(pb: Problem, step: _ChunkTiles, s_raw: torch.Tensor, lse_rows: torch.Tensor, track: bool,
                raw_grad: bool):
    """Recompute one chunk's probabilities ``P = exp(S - lse)`` [nb, Hkv, nact, GB, W] from the forward's lse.

    With ``track``, the score modifier is applied under autograd from a leaf of the raw scores (a leaf that
    needs a gradient only for a modifier that is not additive, e.g. softcap), so :func:`_modifier_grads` can
    take the chain rule through it. Returns ``(p, leaf, modified)``; the last two are None without ``track``.
    """
    leaf = modified = None
    if track:
        with torch.enable_grad():
            leaf = s_raw.detach().requires_grad_(raw_grad)
            modified = _modify(leaf, pb, step)
        s = modified.detach().clone()
    elif pb.mod is not None:
        s = _modify(s_raw, pb, step)
    else:
        s = s_raw
    _mask_(s, pb, step)
    nb, Hkv, nact, GB, _ = s.shape
    return s.sub_(lse_rows.view(nb, Hkv, nact, GB, 1)).exp_(), leaf, modified


def _chunk_rows(x_rb: torch.Tensor, step: _ChunkTiles, a: int, nbatch: int, ws: _Workspace, name: str):
    """The chunk's first ``a`` rows of a gathered row-batch tensor [nb, Hkv, R*GB, Dv] as [nbatch, rows, Dv]:
    a view when the layout allows, else a copy into the workspace."""
    rows = x_rb[:, :, :a]
    if step.ch.start is not None or rows.is_contiguous():
        return rows.reshape(nbatch, -1, rows.shape[-1])
    buf = ws.get(name, rows.shape)
    buf.copy_(rows)
    return buf.view(nbatch, -1, rows.shape[-1])


def _drop_(p: torch.Tensor, dp: torch.Tensor, pb: Problem, plan: TilePlan, step: _ChunkTiles, ws: _Workspace):
    """Apply the forward's dropout to ``dp`` in place and return the dropped probabilities that weighted V."""
    if pb.dropout_p == 0:
        return p
    nb, Hkv, nact = p.shape[:3]
    keep, keep_scale = step.keep(), 1.0 / (1.0 - pb.dropout_p)
    pd = ws.get("pd", p.shape)
    pd.copy_(p)
    pd.view(nb, Hkv, nact, pb.G, plan.block_q, -1).mul_(keep).mul_(keep_scale)
    dp.view(nb, Hkv, nact, pb.G, plan.block_q, -1).mul_(keep).mul_(keep_scale)
    return pd


def _modifier_grads(ds: torch.Tensor, leaf, modified, mod_inputs: list[torch.Tensor],
                    mod_grads: list[torch.Tensor | None]) -> torch.Tensor:
    """Backpropagate the score gradient ``ds`` through the modifier: accumulate its tensors' gradients into
    ``mod_grads`` and return the gradient with respect to the raw scores (``ds`` itself for additive terms)."""
    raw_grad = leaf.requires_grad
    inputs = ([leaf] if raw_grad else []) + list(mod_inputs)
    grads = torch.autograd.grad(modified, inputs, grad_outputs=ds, allow_unused=True)
    if raw_grad:
        ds, grads = grads[0], grads[1:]
    for i, g in enumerate(grads):
        if g is not None:
            mod_grads[i] = g if mod_grads[i] is None else mod_grads[i] + g
    return ds


def _accumulate_grads(step: _ChunkTiles, plan: TilePlan, ds3, pd3, q3, k3, do3, dq_rows, dk, dv, scale: float,
                      ws: _Workspace) -> None:
    """Add one chunk's contributions: dQ += scale dS K, dK += scale dSᵀ Q, dV += Pᵀ dO (P dropped as the forward
    dropped it). A chunk of contiguous key columns adds in place; a gathered one scatters into its tiles."""
    ch, bk = step.ch, plan.block_k
    nbatch, W = ds3.shape[0], ds3.shape[-1]
    D, Dv = k3.shape[-1], do3.shape[-1]
    if ch.start is not None:
        dq_rows.view(nbatch, -1, D).baddbmm_(ds3, k3, alpha=scale)
        cols = slice(ch.start * bk, (ch.start + ch.width) * bk)
        dk[:, :, cols].view(nbatch, W, D).baddbmm_(ds3.transpose(1, 2), q3, alpha=scale)
        dv[:, :, cols].view(nbatch, W, Dv).baddbmm_(pd3.transpose(1, 2), do3)
        return
    dq_c = ws.get("dq", (nbatch, ds3.shape[1], D))
    torch.bmm(ds3, k3, out=dq_c)
    dq_rows.add_(dq_c.view(dq_rows.shape), alpha=scale)
    dk_c = ws.get("dk", (nbatch, W, D))
    dv_c = ws.get("dv", (nbatch, W, Dv))
    torch.baddbmm(dk_c, ds3.transpose(1, 2), q3, beta=0.0, alpha=scale, out=dk_c)
    torch.bmm(pd3.transpose(1, 2), do3, out=dv_c)
    # Accumulating index_put_ is one pass on CPU; index_add_ launches a parallel region
    # per index, which stalls whenever another process holds a core.
    flat = (step.flat_ids(dk.shape[0] * dk.shape[1]),)
    dk.view(-1, bk * D).index_put_(flat, dk_c.view(-1, bk * D), accumulate=True)
    dv.view(-1, bk * Dv).index_put_(flat, dv_c.view(-1, bk * Dv), accumulate=True)


def backward_slice(plan: TilePlan, pb: Problem, q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
                   do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, mod_inputs: list[torch.Tensor]):
    """FlashAttention-2 backward over the plan, recomputing each tile's probabilities from ``lse``.

    Per chunk of key tiles: recompute P (:func:`_tile_probs`), dP = dO Vᵀ, apply the forward's dropout
    (:func:`_drop_`), dS = P (dP - delta), take dS through the score modifier (:func:`_modifier_grads`), and add
    the chunk's dQ, dK, dV (:func:`_accumulate_grads`).

    Args:
        q, kt, vt: as in :func:`forward_slice`.
        do: (nb, Hq, TQ*bq, Dv) padded output gradient (compute dtype).
        lse: (nb, Hq, TQ*bq), ``+inf`` on empty and padded rows (so their probabilities are 0).
        delta: (nb, Hq, TQ*bq), ``rowsum(dO * O) - dlse``.
        mod_inputs: score-modifier tensors that need gradients.

    Returns:
        dq (nb, Hq, TQ*bq, D), dk, dv (padded like kt, vt), and a list of gradients for
        ``mod_inputs`` (None where unused).
    """
    nb, Hq, _, D = q.shape
    Hkv = kt.shape[1]
    GB = pb.G * plan.block_q
    ws = _Workspace(q.dtype, q.device)
    dq = _nan_like_rows(plan, nb, Hq, (D,), q.dtype, q.device)
    dk = torch.zeros_like(kt)
    dv = torch.zeros_like(vt)
    mod_grads: list[torch.Tensor | None] = [None] * len(mod_inputs)
    raw_grad = pb.mod is not None and not pb.mod.additive  # the chain rule through e.g. softcap
    track = pb.mod is not None and (raw_grad or bool(mod_inputs))
    for rb in plan.batches:
        rows = _Rows(plan, rb, nb, Hkv, pb.G, q.device)
        q_rb, do_rb = rows.gather(q, ws, "q_rb"), rows.gather(do, ws, "do_rb")
        lse_rb, delta_rb = rows.gather(lse, ws, "lse_rb"), rows.gather(delta, ws, "delta_rb")
        dq_rb = ws.get("dq_rb", q_rb.shape)
        dq_rb.zero_()
        for ch in rb.chunks:
            a = ch.nact * GB
            step = _ChunkTiles(pb, plan, rb, ch)
            s_raw, q3, k3 = _raw_scores(step, q_rb[:, :, :a], kt, pb.scale, ws)
            p, leaf, modified = _tile_probs(pb, step, s_raw, lse_rb[:, :, :a], track, raw_grad)
            v3 = _values(step, vt, ws)
            nbatch, W = v3.shape[0], v3.shape[1]
            do3 = _chunk_rows(do_rb, step, a, nbatch, ws, "do3")  # [nb*Hkv(*nact), rows, Dv]
            dp = ws.get("dp", p.shape)
            torch.bmm(do3, v3.transpose(1, 2), out=dp.view(nbatch, -1, W))
            pd = _drop_(p, dp, pb, plan, step, ws)
            ds = dp.sub_(delta_rb[:, :, :a].view(nb, Hkv, ch.nact, GB, 1)).mul_(p)  # dS = P (dP - D)
            if modified is not None:
                ds = _modifier_grads(ds, leaf, modified, mod_inputs, mod_grads)
            _accumulate_grads(step, plan, ds.reshape(nbatch, -1, W), pd.view(nbatch, -1, W), q3, k3, do3,
                              dq_rb[:, :, :a], dk, dv, pb.scale, ws)
        rows.scatter(dq_rb, dq)
    return dq, dk, dv, mod_grads
