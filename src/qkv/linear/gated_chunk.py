"""Gated linear attention and the gated delta rule, chunkwise-parallel: the fast way through a whole sequence.

Yang, Wang, Shen, Panda, Kim, "Gated Linear Attention Transformers with Hardware-Efficient Training", ICML
2024 (arXiv:2312.06635), section 4 (chunkwise form, secondary chunking for per-channel gates); Dao and Gu,
"Transformers are SSMs", ICML 2024 (arXiv:2405.21060), section 6 (SSD's block decomposition); Yang, Kautz,
Hatamizadeh, "Gated Delta Networks", ICLR 2025 (arXiv:2412.06464), section 3.3 (the chunked WY/UT form of
the gated delta rule); Kimi Team, "Kimi Linear", 2025 (arXiv:2510.26692) for per-channel gates in it.

Split the tokens into chunks of C. Inside a chunk, ``b_t`` is the cumulative log-decay from the chunk's
start (per head or per key channel) and ``S`` the state the chunk starts from. With the gated scores
``P[t, s] = sum_d q_td k_sd exp(b_td - b_sd)`` for ``s <= t``::

    gated linear:  O = (Q * e^b) S + P V
                   S' = e^{b_C} * S + (K * e^{b_C - b})^T V
    gated delta:   the writes u_t = beta_t (v_t - (e^{g_t} * S_{t-1})^T k_t) solve (I + A) u = beta V - W0 S with
                   A[t, s] = beta_t sum_d k_td k_sd exp(b_td - b_sd) (s < t), W0 = beta K * e^b, so with
                   [U | W] = (I + A)^{-1} [beta V | W0] (one triangular solve per chunk, the UT transform):
                   u = U - W S,   O = (Q * e^b) S + P u,   S' = e^{b_C} * S + (K * e^{b_C - b})^T u

Everything except the short loop over chunks (three GEMMs per chunk, for the delta rule only) is a batched
matmul over all chunks at once. The gated linear rule has no sequential matmul at all: the chunk states
follow from a scan of ``S' = e^{b_C} * S + H_c`` over chunk sums ``H_c``.

The cumulative log-decays are summed and differenced in float64 (for float32 inputs too) where a chunk's decay
is strong: ``b`` reaches hundreds of nats and ``b_t - b_s`` in float32 would keep only a few digits. Where every
chunk stays within :data:`FLOAT32_LOG_DECAY` nats, float32 sums keep the differences to about ``2e-6`` absolute
(a relative error of the decay factors like float32 rounding of the products) and are kept, which halves the
memory the per-channel decays stream through. The exponentials are taken in the input's accumulation dtype.

Per-channel gates need care: ``exp(b_td - b_sd)`` does not factor into a stable row and column scaling over
a whole chunk (``exp(-b_s)`` overflows when a chunk decays by more than ~80 nats). Chunks are therefore
split into sub-blocks of 16 tokens; for a key sub-block ending at token ``r``, queries after it are scaled
by ``exp(b_t - b_r) <= 1`` and its keys by ``exp(b_r - b_s) <= 1`` (one GEMM per key sub-block), and only
the diagonal 16 x 16 sub-blocks form the full ``(16, 16, Dk)`` product. With a scalar gate per head the
decay is a ``(C, C)`` matrix and ``P`` is one GEMM masked by it.

Cost per token and value head, C = 64, Dk = Dv = D: about ``5 C D + 3 D^2`` multiply-adds for the delta rule
(the four ``C x C x D`` products, the solve, and three ``D x D`` state products), ``2 C D + 2 D^2`` for the
gated linear rule.

Given a ``kernel`` (:class:`ChunkKernel`: ``qkv.cpu.fused.DELTA``, which ``qkv.cpu.optimize`` puts into a model's
recurrent mixers), :func:`gated_delta_chunked` on CPU without autograd runs qkv's compiled kernel
(``qkv/cpu/csrc/gated_delta.cpp``): the same algebra one (batch, head) sequence at a time, each chunk's steps back
to back on buffers that stay in cache, with the per-channel chunks ending early where their log-decays would leave
the factored form's safe range. Everything else (no kernel, gradients, other devices, ``QKV_CPU_KERNELS=0``, a
failed build) runs the torch ops below; :func:`delta_path` says which path a call takes and why.

Shape legend: B batch, Hk query/key heads, H value heads, N tokens, Dk key dim, Dv value dim, C chunk size,
nc chunks, M = B H rows of independent (batch, head) sequences.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.nn.functional import pad as _pad

from qkv.linear._common import LinearAttentionOutput
from qkv.linear._gated import Prepared, expand_heads, prepare_gated
from qkv.linear.gated_recurrent import gated_delta_recurrent, gated_linear_recurrent

__all__ = ["DEFAULT_GATED_CHUNK_SIZE", "KERNEL_CHUNK_SIZE", "ChunkKernel", "gated_linear_chunked",
           "gated_delta_chunked", "delta_path"]


class ChunkKernel(Protocol):
    """A compiled implementation of the chunked gated delta rule, given to :func:`gated_delta_chunked` as its
    ``kernel`` (``qkv.cpu.fused.DELTA``, which ``qkv.cpu.optimize`` puts into a model's recurrent mixers)."""

    def why_not(self, *tensors: torch.Tensor | None) -> str | None:
        """Why it does not run these tensors (``q, k, v, g, beta, state``; None entries absent), or None."""

    def __call__(self, q, k, v, g, beta, state, chunk_size: int, safe_log: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``q, k (B, Hk, N, Dk)``, ``v (B, H, N, Dv)``, ``g (B, H, N[, Dk])``, ``beta (B, H, N)``,
        ``state (B, H, Dk, Dv)``; ``chunk_size`` tokens per chunk; ``safe_log`` the widest log-decay spread a chunk
        keeps in factored form -> ``(out (B, H, N, Dv), state (B, H, Dk, Dv))``."""

DEFAULT_GATED_CHUNK_SIZE = 64
"""Tokens per chunk of the torch ops: large enough that the intra-chunk products are GEMMs over all chunks at once,
small enough that the ``C x C`` matrices and the per-chunk solve stay cheap (the GLA and Gated DeltaNet papers use
64)."""

KERNEL_CHUNK_SIZE = 16
"""Tokens per chunk of the compiled CPU kernel: it works a chunk at a time in cache, so the per-token work of the
intra-chunk products (``5 C D``) matters more than GEMM shapes; 16 was the fastest of 8-64 for head dims 64-256
(``benchmarks/gated_linear.py``)."""

_SUB = 16
"""Sub-block of a chunk for per-channel gates: the diagonal sub-blocks form a ``(16, 16, Dk)`` product."""

#: Largest |cumulative log-decay| inside a chunk (nats) for which float32 inputs keep their log-decays in float32.
FLOAT32_LOG_DECAY = 16.0


#: Log-decays below this are taken as this: ``exp(-1024)`` is 0 in float32 and float64 alike, so a gate of ``-inf``
#: (a full reset of the state) or of ``-1e30`` keeps its meaning, while the cumulative sums stay finite (``-inf``
#: minus ``-inf`` is NaN) and keep the differences of the tokens after it to about ``1e-13``.
RESET_LOG_DECAY = 1024.0


def _defined_gates(p: Prepared) -> Prepared | None:
    """``p`` with its log-decays floored at ``-RESET_LOG_DECAY``, or None when the chunked algebra cannot follow
    the recurrence: a NaN or infinite q, k, v, beta or state, or a NaN or ``+inf`` gate. Inside a chunk the
    products mix every token with every other (``0 * NaN`` is NaN), so a NaN would reach tokens before it; the
    recurrence carries it forward only, as the definition does."""
    rest = [t for t in (p.q, p.k, p.v, p.beta, p.state) if t is not None]
    if not all(bool(torch.isfinite(t).all()) for t in rest):
        return None
    g = p.g
    if g.numel() and not float(g.detach().amin()) >= -RESET_LOG_DECAY:  # NaN compares False
        if bool((g.isnan() | (g == float("inf"))).any()):
            return None
        g = g.clamp_min(-RESET_LOG_DECAY)
    elif g.numel() and not bool(torch.isfinite(g).all()):  # +inf (or NaN above the floor)
        return None
    return Prepared(p.q, p.k, p.v, g, p.beta, p.state, p.out_dtype)


def _log_decays(g: torch.Tensor) -> torch.Tensor:
    """Cumulative log-decays within each chunk, ``g`` (M, nc, C[, Dk]) summed along C: in float32 for float32 gates
    whose chunks stay within :data:`FLOAT32_LOG_DECAY` nats, else in float64 (see the module notes)."""
    if g.dtype == torch.float32:
        b = g.cumsum(2)
        if b.numel() == 0 or float(b.abs().amax()) <= FLOAT32_LOG_DECAY:
            return b
    return g.to(torch.float64).cumsum(2)


def _check_chunk(chunk_size, fn: str) -> None:
    if chunk_size is None:
        return
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"{fn}: chunk_size must be a positive int or None (the path's own), got {chunk_size!r}; "
                         f"try chunk_size=64")


def _kernel_declines(p: Prepared, kernel: ChunkKernel | None) -> str | None:
    """Why the compiled kernel does not run this call (None when it does)."""
    if kernel is None:
        return "no compiled kernel given (qkv.cpu.optimize gives a model's mixers qkv.cpu.fused.DELTA)"
    if p.v.device.type != "cpu":
        return f"inputs on {p.v.device.type}, the kernel is CPU only"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (p.q, p.k, p.v, p.g, p.beta, p.state)):
        return "autograd records this call (the kernel has no backward)"
    return kernel.why_not(p.q, p.k, p.v, p.g, p.beta, p.state)


def delta_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
               initial_state: torch.Tensor | None = None, kernel: ChunkKernel | None = None) -> str:
    """Which path :func:`gated_delta_chunked` takes for these inputs and this ``kernel``, and why.

    Example:
        >>> import torch
        >>> q = k = v = torch.zeros(1, 1, 4, 8)
        >>> delta_path(q, k, v, torch.zeros(1, 1, 4), torch.ones(1, 1, 4))
        "torch ops (no compiled kernel given (qkv.cpu.optimize gives a model's mixers qkv.cpu.fused.DELTA))"
    """
    p = prepare_gated(q, k, v, g, beta, initial_state, fn="delta_path", delta=True)
    why = _kernel_declines(p, kernel)
    return "compiled CPU kernel" if why is None else f"torch ops ({why})"


def _chunks(p: Prepared, C: int):
    """Pad to whole chunks and fold (batch, head) rows: tensors ``(M, nc, C, ...)``.

    Padded tokens have ``k = v = 0``, ``g = 0`` and ``beta = 0``: they leave the state unchanged.
    """
    B, H, N, Dv = p.v.shape
    nc = -(-N // C)
    pad = nc * C - N
    q, k = expand_heads(p.q, H), expand_heads(p.k, H)

    def fold(t):
        if pad:
            t = _pad(t, (0, 0, 0, pad)) if t.dim() == 4 else _pad(t, (0, pad))
        return t.reshape(B * H, nc, C, *t.shape[3:])

    beta = fold(p.beta) if p.beta is not None else None
    return fold(q), fold(k), fold(p.v), fold(p.g), beta


def _gated_scores(x: torch.Tensor, y: torch.Tensor, b: torch.Tensor, *, strict: bool) -> torch.Tensor:
    """``P[t, s] = sum_d x_td y_sd exp(b_td - b_sd)`` for ``s <= t`` (``s < t`` when ``strict``), else 0.

    x, y: ``(M, nc, C, Dk)``; b: ``(M, nc, C)`` (one decay per head) or ``(M, nc, C, Dk)``. Returns
    ``(M, nc, C, C)``.
    """
    C = x.shape[2]
    keep = torch.ones(C, C, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
    if b.dim() == 3:  # one decay per head: a (C, C) decay matrix times one GEMM
        decay = _exp(torch.where(keep, b.unsqueeze(-1) - b.unsqueeze(-2), -torch.inf), x.dtype)
        return (x @ y.transpose(-1, -2)) * decay
    limit = _SAFE_SPREAD[x.dtype]
    if _spread(b) <= limit:  # exp(b_t - b_0) and exp(b_0 - b_s) both stay finite: one GEMM per chunk
        return _factored(x, y, b, b[:, :, :1]) * keep
    c = _SUB if C % _SUB == 0 else C
    cols = []
    for j in range(C // c):
        s0, s1 = j * c, (j + 1) * c
        bj, xj, yj = b[:, :, s0:s1], x[:, :, s0:s1], y[:, :, s0:s1]
        if c < C and _spread(bj) <= limit:
            diag = _factored(xj, yj, bj, bj[:, :, :1]) * keep[s0:s1, s0:s1]
        else:  # the full (c, c, Dk) product: exact whatever the decay
            diff = torch.where(keep[s0:s1, s0:s1, None], bj.unsqueeze(3) - bj.unsqueeze(2), -torch.inf)
            diag = torch.einsum("mntd,mnsd,mntsd->mnts", xj, yj, _exp(diff, x.dtype))  # (M, nc, c, c)
        parts = [diag]
        if s0:
            parts.insert(0, x.new_zeros(*x.shape[:2], s0, c))
        if s1 < C:
            r = b[:, :, s1 - 1:s1]  # (M, nc, 1, Dk): the log-decay at the sub-block's last token
            xs = x[:, :, s1:] * _exp(b[:, :, s1:] - r, x.dtype)  # later queries, scaled by exp(b_t - b_r) <= 1
            ys = yj * _exp(r - bj, x.dtype)  # this sub-block's keys, scaled by exp(b_r - b_s) <= 1
            parts.append(xs @ ys.transpose(-1, -2))  # (M, nc, C - s1, c)
        cols.append(torch.cat(parts, dim=2))
    return torch.cat(cols, dim=3)


_SAFE_SPREAD = {torch.float32: 60.0, torch.float64: 600.0}
"""Largest log-decay spread inside a block for which ``exp(+spread)`` and its products stay finite (e^60 ~ 1e26 in
float32); the compiled kernel ends a per-channel chunk where its cumulative log-decays would exceed it."""


def _spread(b: torch.Tensor) -> float:
    """The largest range of a channel's cumulative log-decay inside one block, over all blocks."""
    return float((b.amax(dim=2) - b.amin(dim=2)).max().detach()) if b.numel() else 0.0


def _factored(x, y, b, r):
    """``(x * exp(b - r)) (y * exp(r - b))^T``: the gated scores when the block's spread allows it."""
    return (x * _exp(b - r, x.dtype)) @ (y * _exp(r - b, x.dtype)).transpose(-1, -2)


def _exp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exp`` of a float64 log-decay difference, in ``dtype``: the difference is exact to float64, so rounding it
    to float32 first costs one float32 rounding of a small number, and the exponential runs in float32."""
    return x.to(dtype).exp()


def _row_scale(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exp(b)`` shaped to scale rows ``(..., C, Dk)``: ``(..., C, 1)`` for per-head decays."""
    e = _exp(b, dtype)
    return e if e.dim() == 4 else e.unsqueeze(-1)


def _end_terms(b: torch.Tensor, dtype: torch.dtype):
    """``exp(b_C - b)`` to carry each key to the chunk's end, and ``exp(b_C)`` to scale the state's rows."""
    b_end = b[:, :, -1:]  # (M, nc, 1[, Dk])
    to_end = _row_scale(b_end - b, dtype)  # (M, nc, C, Dk|1)
    decay = _exp(b_end.squeeze(2), dtype)  # (M, nc[, Dk])
    decay = decay.unsqueeze(-1) if decay.dim() == 3 else decay[..., None, None]  # (M, nc, Dk|1, 1)
    return to_end, decay


def _finish(p: Prepared, out_M: torch.Tensor, S_M: torch.Tensor) -> LinearAttentionOutput:
    B, H, N, Dv = p.v.shape
    out = out_M.reshape(B, H, *out_M.shape[1:])[:, :, :N]  # (M, padded N, Dv): no -1, Dv may be 0
    return LinearAttentionOutput(out.to(p.out_dtype), S_M.reshape(B, H, *S_M.shape[1:]))


def _initial(p: Prepared) -> torch.Tensor:
    B, H, _, Dv = p.v.shape
    Dk = p.k.shape[-1]
    if p.state is not None:
        return p.state.reshape(B * H, Dk, Dv)
    return p.v.new_zeros(B * H, Dk, Dv)


def gated_linear_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    chunk_size: int | None = None,
    initial_state: torch.Tensor | None = None,
) -> LinearAttentionOutput:
    """Causal gated linear attention (GLA with per-channel gates, Mamba2/SSD with one per head) by chunks.

    Args:
        q: ``(B, Hk, N, Dk)`` floating.
        k: ``(B, Hk, N, Dk)``, same dtype and device.
        v: ``(B, H, N, Dv)`` with ``H`` a multiple of ``Hk`` (value head ``h`` reads key head ``h // (H // Hk)``).
        g: log-decay ``(B, H, N)`` or ``(B, H, N, Dk)``.
        chunk_size: C, tokens per chunk, ``>= 1``; need not divide N. ``None``: :data:`DEFAULT_GATED_CHUNK_SIZE`.
        initial_state: ``(B, H, Dk, Dv)`` or ``None`` for zeros.

    Returns:
        ``LinearAttentionOutput(out (B, H, N, Dv) in q's dtype, state (B, H, Dk, Dv))``, the state in
        float32 (float64 for float64 inputs).

    Example:
        >>> import torch
        >>> from qkv.linear import gated_linear_parallel
        >>> q, k, v = torch.randn(3, 1, 2, 100, 8, dtype=torch.float64).unbind(0)
        >>> g = -torch.rand(1, 2, 100, 8, dtype=torch.float64)
        >>> out = gated_linear_chunked(q, k, v, g, chunk_size=32).out
        >>> torch.allclose(out, gated_linear_parallel(q, k, v, g).out)
        True
    """
    fn = "gated_linear_chunked"
    _check_chunk(chunk_size, fn)
    p = prepare_gated(q, k, v, g, None, initial_state, fn=fn, delta=False)
    S = _initial(p)
    if p.v.shape[2] == 0:
        return _finish(p, p.v.new_zeros(S.shape[0], 0, p.v.shape[-1]), S)
    p = _defined_gates(p)
    if p is None:  # NaN or infinite inputs: where they reach is the recurrence's to say
        return gated_linear_recurrent(q, k, v, g, initial_state=initial_state)
    C = min(chunk_size or DEFAULT_GATED_CHUNK_SIZE, p.v.shape[2])  # a short call pads to itself, not to C
    q, k, v, g, _ = _chunks(p, C)
    b = _log_decays(g)  # (M, nc, C[, Dk])
    to_end, decay = _end_terms(b, q.dtype)
    out = _gated_scores(q, k, b, strict=False) @ v  # (M, nc, C, Dv): within each chunk
    sums = (k * to_end).transpose(-1, -2) @ v  # (M, nc, Dk, Dv): each chunk's own contribution at its end
    qe = q * _row_scale(b, q.dtype)  # queries scaled to read the state a chunk starts from
    for c in range(sums.shape[1]):  # each chunk reads its starting state as soon as it is known: no stack
        out[:, c].baddbmm_(qe[:, c], S)
        S = torch.addcmul(sums[:, c], S, decay[:, c])
    return _finish(p, out.flatten(1, 2), S)


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int | None = None,
    initial_state: torch.Tensor | None = None,
    kernel: ChunkKernel | None = None,
) -> LinearAttentionOutput:
    """The gated delta rule (Gated DeltaNet with per-head gates, KDA with per-channel gates) by chunks.

    Args:
        q: ``(B, Hk, N, Dk)`` floating.
        k: ``(B, Hk, N, Dk)``, same dtype and device.
        v: ``(B, H, N, Dv)`` with ``H`` a multiple of ``Hk`` (value head ``h`` reads key head ``h // (H // Hk)``).
        g: log-decay ``(B, H, N)`` or ``(B, H, N, Dk)``.
        beta: ``(B, H, N)`` write strength.
        chunk_size: C, tokens per chunk, ``>= 1``; need not divide N. ``None``: the path's own,
            :data:`KERNEL_CHUNK_SIZE` for the compiled CPU kernel, :data:`DEFAULT_GATED_CHUNK_SIZE` for the torch ops
            (the result is the same up to rounding whatever the chunks).
        initial_state: ``(B, H, Dk, Dv)`` or ``None`` for zeros.
        kernel: a compiled implementation (:class:`ChunkKernel`) tried first, or ``None`` for the torch ops.

    Returns:
        ``LinearAttentionOutput(out (B, H, N, Dv) in q's dtype, state (B, H, Dk, Dv))``.

    Example:
        >>> import torch
        >>> from qkv.linear import gated_delta_parallel
        >>> q, k, v = torch.randn(3, 1, 2, 50, 8, dtype=torch.float64).unbind(0)
        >>> k = torch.nn.functional.normalize(k, dim=-1)
        >>> g, beta = -torch.rand(1, 2, 50, dtype=torch.float64), torch.rand(1, 2, 50, dtype=torch.float64)
        >>> out = gated_delta_chunked(q, k, v, g, beta, chunk_size=16).out
        >>> torch.allclose(out, gated_delta_parallel(q, k, v, g, beta).out)
        True
    """
    fn = "gated_delta_chunked"
    _check_chunk(chunk_size, fn)
    p = prepare_gated(q, k, v, g, beta, initial_state, fn=fn, delta=True)
    S = _initial(p)
    if 0 in (p.v.shape[2], p.k.shape[-1], p.v.shape[-1]):  # no tokens, key or value channel: zeros
        return _finish(p, p.v.new_zeros(S.shape[0], p.v.shape[2], p.v.shape[-1]), S)
    p = _defined_gates(p)
    if p is None:  # NaN or infinite inputs: where they reach is the recurrence's to say
        return gated_delta_recurrent(q, k, v, g, beta, initial_state=initial_state)
    if _kernel_declines(p, kernel) is None:
        B, H, _, Dv = p.v.shape
        out, S = kernel(
            p.q.contiguous(), p.k.contiguous(), p.v.contiguous(), p.g.contiguous(), p.beta.contiguous(),
            S.reshape(B, H, *S.shape[1:]).contiguous(), chunk_size or KERNEL_CHUNK_SIZE, _SAFE_SPREAD[p.v.dtype])
        return LinearAttentionOutput(out.to(p.out_dtype), S)
    C = min(chunk_size or DEFAULT_GATED_CHUNK_SIZE, p.v.shape[2])  # a short call pads to itself, not to C
    q, k, v, g, beta = _chunks(p, C)
    b = _log_decays(g)  # (M, nc, C[, Dk])
    to_end, decay = _end_terms(b, q.dtype)
    e_b = _row_scale(b, q.dtype)
    P = _gated_scores(q, k, b, strict=False)  # (M, nc, C, C)
    bk = beta.unsqueeze(-1)
    A = _gated_scores(k * bk, k, b, strict=True)  # strictly lower: (I + A) is unit lower triangular
    eye = torch.eye(C, dtype=A.dtype, device=A.device).expand_as(A)
    T = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)  # (I + A)^{-1}, the UT transform
    U = T @ (v * bk)  # (M, nc, C, Dv)
    W = T @ (k * (bk * e_b))  # (M, nc, C, Dk)
    K_end = (k * to_end).transpose(-1, -2)  # (M, nc, Dk, C)
    qe = q * e_b  # (M, nc, C, Dk): queries scaled to read the state a chunk starts from
    out = v.new_empty(v.shape[0], v.shape[1], C, v.shape[-1])  # (M, nc, C, Dv)
    for c in range(U.shape[1]):  # each chunk's output as soon as its state is known: no stack of states
        u = torch.baddbmm(U[:, c], W[:, c], S, alpha=-1)  # (M, C, Dv): this chunk's writes U - W S
        out[:, c] = torch.bmm(qe[:, c], S).baddbmm_(P[:, c], u)
        S = torch.baddbmm(S * decay[:, c], K_end[:, c], u)
    return _finish(p, out.flatten(1, 2), S)
