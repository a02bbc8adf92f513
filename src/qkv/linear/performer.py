"""Performer FAVOR+: softmax attention estimated by positive orthogonal random features.

Choromanski, Likhosherstov, Dohan, Song, Gane, Sarlos, Hawkins, Davis, Mohiuddin, Kaiser, Belanger,
Colwell, Weller, "Rethinking Attention with Performers", ICLR 2021 (arXiv:2009.14794), lemma 1 and
section 2.4.

For ``w ~ N(0, I_d)``, ``E[exp(w·x - |x|^2/2) exp(w·y - |y|^2/2)] = exp(x·y)``. With ``m`` draws
``w_1..w_m`` (the rows of ``projection``) and ``x = q * scale**0.5`` (``scale = D**-0.5`` by default)::

    phi(x) = exp(W x - |x|^2 / 2) / sqrt(m)          (m,), every entry > 0
    phi(q')·phi(k') ~= exp(scale * q·k)               unbiased; variance falls like 1/m

and softmax attention becomes linear attention with this feature map. Orthogonal rows (blocks of a
QR-orthogonalized Gaussian matrix, each row rescaled to a chi-distributed norm so its length is
distributed as a Gaussian vector's) lower the variance further (the paper's theorem 2).

Numerical stabilizers (both keep every feature finite in float32; neither sees a future token):

* Queries: each query's features are divided by their own largest value, ``exp(max_r w_r·q')``.
  It is a per-row constant, so it cancels between numerator and normalizer exactly.
* Keys: no data-dependent shift at all, causal or not. The ``-|k'|^2/2`` term already bounds the
  exponent: ``w·k' - |k'|^2/2 <= (w·k̂)^2 / 2``, and ``w·k̂`` is a standard normal for any key not
  chosen with knowledge of ``w`` (``w`` is random and redrawn), so exponents stay near
  ``ln m`` (about 6 for m = 266). As a guard the exponent is clamped at ``40``: it would take a
  9-sigma alignment between a key and a random feature to reach it, and it bounds every key
  feature by ``e^40`` so the float32 state cannot overflow. Because the key map does not depend on
  other keys, the same features serve the causal and non-causal forms, a state from one call can be
  carried into the next, and decoding one token at a time gives the prefill's numbers. (A max over
  all keys of the sequence, as Google's reference uses for causal keys too, would let a later
  token change an earlier output.)

Shape legend: B batch, H heads, N tokens, D head dim of q/k, Dv value head dim, m random features.
"""

from __future__ import annotations

import math

import torch

from qkv.linear._common import LinearAttentionOutput, LinearState, acc_dtype, check_qkv
from qkv.linear.chunk import DEFAULT_CHUNK_SIZE, linear_attention_chunked
from qkv.linear.recurrent import linear_attention_step

__all__ = [
    "PERFORMER_EPS",
    "default_num_features",
    "orthogonal_gaussian",
    "favor_query_features",
    "favor_key_features",
    "performer_attention",
    "performer_attention_step",
]

PERFORMER_EPS = 1e-12
"""Normalizer guard. FAVOR+ features are positive, so the normalizer is zero only on underflow; a
query-stabilized normalizer can be as small as ~1e-3 for one key, so the linear-attention default
1e-6 would bias short prefixes."""

_KEY_EXPONENT_CAP = 40.0


def default_num_features(dim: int) -> int:
    """``round(d ln d)`` random features for head dim ``d`` (the paper's recommendation), at least 1.

    Example:
        >>> default_num_features(64)
        266
    """
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    return max(1, round(dim * math.log(dim)))


def orthogonal_gaussian(
    num_features: int | None,
    dim: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Random projection ``W (m, d)`` whose rows are orthogonal in blocks of ``d`` and have Gaussian-like norms.

    Each block is the Q factor of a ``d x d`` standard Gaussian matrix (signs fixed by ``diag(R) > 0``
    so the block is Haar distributed and independent of the LAPACK build); the first ``m`` rows of the
    stacked blocks are then rescaled by independent chi(d) norms (norms of ``d``-dim Gaussian vectors).
    Draws happen on the CPU in float64 from ``generator``, so a seed gives the same matrix on any device.

    Args:
        num_features: m, rows; ``None`` for ``default_num_features(dim)``.
        dim: d, the head dim.
        generator: a CPU ``torch.Generator`` (``None`` uses the global RNG).
        dtype: dtype of the result.
        device: device of the result.

    Returns:
        ``(m, d)`` tensor.

    Example:
        >>> import torch
        >>> W = orthogonal_gaussian(40, 16, generator=torch.Generator().manual_seed(0))
        >>> W.shape
        torch.Size([40, 16])
        >>> G = W[:16] @ W[:16].T   # one block: orthogonal rows
        >>> bool((G - torch.diag(torch.diag(G))).abs().max() < 1e-4)
        True
    """
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ValueError(f"orthogonal_gaussian: dim must be a positive int, got {dim!r}")
    m = default_num_features(dim) if num_features is None else num_features
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"orthogonal_gaussian: num_features must be a positive int or None, got {num_features!r}")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(
            f"orthogonal_gaussian: generator must be a CPU torch.Generator, got one on {generator.device}; "
            f"draws are made on the CPU so that a seed gives the same features on every device"
        )
    n_blocks = -(-m // dim)
    g = torch.randn(n_blocks, dim, dim, generator=generator, dtype=torch.float64)
    Q, R = torch.linalg.qr(g)  # (n_blocks, d, d): orthonormal columns
    sign = torch.where(torch.diagonal(R, dim1=-2, dim2=-1) >= 0, 1.0, -1.0).to(Q.dtype)
    rows = (Q * sign.unsqueeze(-2)).transpose(-1, -2).reshape(n_blocks * dim, dim)[:m]  # orthonormal rows
    norms = torch.randn(m, dim, generator=generator, dtype=torch.float64).norm(dim=-1)  # chi(d)
    return (rows * norms.unsqueeze(-1)).to(dtype=dtype, device=device)


def _check_projection(projection: torch.Tensor, D: int, *, fn: str) -> None:
    if not isinstance(projection, torch.Tensor):
        raise TypeError(f"{fn}: projection must be a torch.Tensor (m, D), got {type(projection).__name__}")
    if projection.dim() != 2 or projection.shape[1] != D:
        raise ValueError(
            f"{fn}: projection must have shape (m, D) with D = {D} (the head dim), got {tuple(projection.shape)}; "
            f"build it with orthogonal_gaussian(m, {D}, generator=...)"
        )


def _projected(x: torch.Tensor, projection: torch.Tensor, scale: float | None):
    """``(W x', |x'|^2 / 2)`` in the accumulation dtype, with ``x' = x * scale**0.5``."""
    D = x.shape[-1]
    dt = acc_dtype(x.dtype)
    s = (D**-0.5 if scale is None else scale) ** 0.5
    x = x.to(dt) * s
    wx = x @ projection.to(dt).transpose(0, 1)  # (..., N, m)
    return wx, (x * x).sum(-1, keepdim=True) / 2


def favor_query_features(q: torch.Tensor, projection: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """FAVOR+ query features, each row divided by its largest entry (cancels in the normalizer).

    Args:
        q: ``(..., N, D)`` floating.
        projection: ``(m, D)``, e.g. from ``orthogonal_gaussian``.
        scale: softmax scale the features estimate, ``exp(scale * q·k)``; default ``D ** -0.5``.

    Returns:
        ``(..., N, m)`` in float32 (float64 for float64 inputs); each row's largest entry is
        ``1 / sqrt(m)``, so it is ``phi(q')`` times a positive per-row constant.

    Example:
        >>> import torch
        >>> W = orthogonal_gaussian(None, 8, generator=torch.Generator().manual_seed(0))
        >>> f = favor_query_features(torch.randn(2, 5, 8), W)
        >>> f.shape, bool(torch.allclose(f.amax(-1), torch.full((2, 5), W.shape[0] ** -0.5)))
        (torch.Size([2, 5, 17]), True)
    """
    _check_projection(projection, q.shape[-1], fn="favor_query_features")
    wx, _ = _projected(q, projection, scale)
    # The row's -|q'|^2/2 term and its max are the same constant for every feature of the row.
    stab = wx.amax(-1, keepdim=True).detach()
    return torch.exp(wx - stab) * projection.shape[0] ** -0.5


def favor_key_features(k: torch.Tensor, projection: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """FAVOR+ key features ``exp(W k' - |k'|^2/2) / sqrt(m)``, exponent clamped at 40 (see the module doc).

    Each key's features depend on that key alone: safe for causal attention and for carried state.

    Args:
        k: ``(..., N, D)`` floating.
        projection: ``(m, D)``.
        scale: softmax scale, as for ``favor_query_features``.

    Returns:
        ``(..., N, m)`` in float32 (float64 for float64 inputs), positive.

    Example:
        >>> import torch
        >>> W = orthogonal_gaussian(4096, 8, generator=torch.Generator().manual_seed(0))
        >>> x, y = torch.randn(2, 8, dtype=torch.float64) * 0.5
        >>> Wd = W.double()
        >>> est = favor_key_features(x, Wd) @ favor_key_features(y, Wd)
        >>> bool(abs(est / torch.exp(x @ y / 8**0.5) - 1) < 0.1)
        True
    """
    _check_projection(projection, k.shape[-1], fn="favor_key_features")
    wx, half_sq = _projected(k, projection, scale)
    return torch.exp((wx - half_sq).clamp(max=_KEY_EXPONENT_CAP)) * projection.shape[0] ** -0.5


def performer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    projection: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    eps: float = PERFORMER_EPS,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: LinearState | None = None,
) -> LinearAttentionOutput:
    """FAVOR+ estimate of ``softmax(scale q k^T [+ causal mask]) v``, in O(N) time and memory.

    Args:
        q: ``(B, H, Nq, D)`` floating.
        k: ``(B, H, Nk, D)``, same dtype and device; ``Nk == Nq`` when ``causal``.
        v: ``(B, H, Nk, Dv)``, same dtype and device.
        projection: ``(m, D)`` random features, shared by all heads (``orthogonal_gaussian``).
        causal: query ``i`` sees keys ``j <= i``; computed by prefix sums in chunks, and no output
            depends on a later token (see the module doc on stabilizers).
        scale: softmax scale, default ``D ** -0.5``.
        eps: absolute guard added to the normalizer (``PERFORMER_EPS``).
        chunk_size: tokens per chunk for the causal prefix sums.
        initial_state: ``LinearState(S (B, H, m, Dv), z (B, H, m))`` from an earlier call with the same
            ``projection`` and ``scale``, or ``None``.

    Returns:
        ``LinearAttentionOutput(out (B, H, Nq, Dv) in the input dtype, state)``; the state holds key
        features (not query-stabilized), so it can be passed to the next call or to
        ``performer_attention_step``.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> W = orthogonal_gaussian(256, 16, generator=g)
        >>> q, k, v = (torch.randn(1, 2, 10, 16, generator=g) * 0.5 for _ in range(3))
        >>> out = performer_attention(q, k, v, W, causal=True).out
        >>> exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> bool((out - exact).abs().mean() < 0.1)
        True
    """
    fn = "performer_attention"
    check_qkv(q, k, v, fn=fn, causal=causal)
    _check_projection(projection, q.shape[-1], fn=fn)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{fn}: q and k must share the head dim, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    fq = favor_query_features(q, projection, scale=scale)  # (B, H, Nq, m)
    fk = favor_key_features(k, projection, scale=scale)  # (B, H, Nk, m)
    res = linear_attention_chunked(fq, fk, v.to(fq.dtype), feature_map=None, causal=causal, eps=eps,
                                   chunk_size=chunk_size, initial_state=initial_state)
    return LinearAttentionOutput(res.out.to(q.dtype), res.state)


def performer_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    projection: torch.Tensor,
    state: LinearState | None,
    *,
    scale: float | None = None,
    eps: float = PERFORMER_EPS,
) -> LinearAttentionOutput:
    """Decode one token with causal FAVOR+: O(m Dv) per token whatever the context length.

    Args:
        q: ``(B, H, 1, D)`` floating.
        k: ``(B, H, 1, D)``.
        v: ``(B, H, 1, Dv)``.
        projection: ``(m, D)``, the one that built ``state``.
        state: from ``performer_attention(..., causal=True)`` or an earlier step, or ``None``.
        scale: softmax scale, default ``D ** -0.5``.
        eps: absolute guard added to the normalizer.

    Returns:
        ``LinearAttentionOutput(out (B, H, 1, Dv) in the input dtype, state including this token)``.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> W = orthogonal_gaussian(None, 8, generator=g)
        >>> q, k, v = torch.randn(3, 1, 2, 6, 8, generator=g).unbind(0)
        >>> full = performer_attention(q, k, v, W, causal=True)
        >>> prefix = performer_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], W, causal=True)
        >>> out, _ = performer_attention_step(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], W, prefix.state)
        >>> torch.allclose(out, full.out[:, :, 5:], atol=1e-5)
        True
    """
    fn = "performer_attention_step"
    check_qkv(q, k, v, fn=fn, causal=True)
    if q.shape[2] != 1:
        raise ValueError(
            f"{fn}: q, k, v must hold one token (B, H, 1, D), got q {tuple(q.shape)}; for several tokens "
            f"use performer_attention(..., causal=True, initial_state=state)"
        )
    _check_projection(projection, q.shape[-1], fn=fn)
    fq = favor_query_features(q, projection, scale=scale)
    fk = favor_key_features(k, projection, scale=scale)
    res = linear_attention_step(fq, fk, v.to(fq.dtype), state, feature_map=None, eps=eps)
    return LinearAttentionOutput(res.out.to(q.dtype), res.state)
