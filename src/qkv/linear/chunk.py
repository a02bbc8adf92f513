"""Linear attention, chunkwise-parallel form: the fast way to process a whole sequence.

Katharopoulos, Vyas, Pappas, Fleuret, "Transformers are RNNs: Fast Autoregressive Transformers with
Linear Attention", ICML 2020 (arXiv:2006.16236) for the recurrence; the chunkwise split follows
Hua, Dai, Liu, Le, "Transformer Quality in Linear Time", ICML 2022 (arXiv:2202.10447), "mixed chunk attention".

Split the N tokens into ``nc = ceil(N / C)`` chunks of C tokens. For query i in chunk c::

    out_i = phi(q_i)^T (S_0 + sum_{c' < c} K_c'^T V_c')          inter-chunk: the state so far
          + sum_{j in chunk c, j <= i} (phi(q_i)·phi(k_j)) v_j     intra-chunk: a causal C x C product

Chunks are processed in batches: one batched ``K_c^T V_c`` per chunk, a cumulative sum over chunks
gives each chunk's incoming state, then two batched matmuls per chunk (fused into one ``baddbmm``).
The normalizer rides along as an extra all-ones value column, so ``z`` is the last column of the
state. No Python loop runs over tokens or chunks; one runs over blocks of about
``_ROWS_PER_BLOCK / (B H)`` tokens, carrying the state, so that intermediates stay a few MB
(on CPU that beat one pass over a 65536-token sequence: fewer fresh pages, more cache reuse). The
tail chunk is zero-padded (zero features and values add nothing).

Cost per token and head: about ``4 F Dv + 2 C (F + Dv)`` FLOPs, against ``2 N D`` for causal softmax.

Shape legend: B batch, H heads, N tokens, D head dim of q/k, Dv value head dim, F features per head,
C chunk size, nc number of chunks.
"""

from __future__ import annotations

import torch
from torch.nn.functional import pad as _pad

from qkv.linear._common import DEFAULT_EPS, LinearAttentionOutput, LinearState, prepare
from qkv.linear.feature_maps import FeatureMap, elu_plus_one

__all__ = ["DEFAULT_CHUNK_SIZE", "linear_attention_chunked"]

DEFAULT_CHUNK_SIZE = 64
"""Measured on CPU with ``benchmarks/linear.py`` (B=1, H=8, D=64, float32, N=4096..65536)."""

_ROWS_PER_BLOCK = 16384
"""(batch x head x token) rows per sweep block: about 4 MB per float32 intermediate at Dv = 64."""


def linear_attention_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str | FeatureMap | None = elu_plus_one,
    causal: bool = False,
    normalize: bool = True,
    eps: float = DEFAULT_EPS,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: LinearState | None = None,
) -> LinearAttentionOutput:
    """Linear attention in O(N C (F + Dv) + N F Dv) time by chunks of ``chunk_size`` tokens.

    Args:
        q: ``(B, H, Nq, D)`` floating.
        k: ``(B, H, Nk, D)``, same dtype and device. ``Nk == Nq`` when ``causal``.
        v: ``(B, H, Nk, Dv)``, same dtype and device.
        feature_map: ``"elu_plus_one"`` (default), ``"relu"``, a callable ``phi(x_BHND) -> x_BHNF``,
            or ``None`` when q and k already are features.
        causal: query ``i`` sees keys ``j <= i`` (and ``initial_state``). Without it there is nothing
            to chunk: the result is ``phi(Q) (S_0 + phi(K)^T V)``.
        normalize: divide by ``phi(q_i)^T z_i + eps``.
        eps: absolute guard added to the normalizer (see ``linear_attention_parallel``).
        chunk_size: C, tokens per chunk, ``>= 1``; need not divide N.
        initial_state: ``LinearState(S (B, H, F, Dv), z (B, H, F))`` or ``None`` for zeros.

    Returns:
        ``LinearAttentionOutput(out (B, H, Nq, Dv) in the input dtype, state after the last key)``.

    Example:
        >>> import torch
        >>> from qkv.linear.naive import linear_attention_parallel
        >>> q, k, v = torch.randn(3, 2, 4, 100, 16, dtype=torch.float64).unbind(0)
        >>> out = linear_attention_chunked(q, k, v, causal=True, chunk_size=32).out
        >>> torch.allclose(out, linear_attention_parallel(q, k, v, causal=True).out)
        True
    """
    fn = "linear_attention_chunked"
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}; try chunk_size=64")
    fq, fk, v_acc, state0 = prepare(q, k, v, feature_map=feature_map, causal=causal, initial_state=initial_state,
                                     eps=eps, fn=fn)
    if causal:
        out, state = _causal(fq, fk, v_acc, state0, chunk_size, normalize=normalize, eps=eps)
    else:
        out, state = _noncausal(fq, fk, v_acc, state0, normalize=normalize, eps=eps)
    return LinearAttentionOutput(out.to(q.dtype), state)


def _noncausal(fq, fk, v, state0, *, normalize, eps):
    S = fk.transpose(-1, -2) @ v  # (B, H, F, Dv)
    z = fk.sum(-2)  # (B, H, F)
    if state0 is not None:
        S, z = S + state0.S, z + state0.z
    out = fq @ S  # (B, H, Nq, Dv)
    if normalize:
        out = out / ((fq @ z.unsqueeze(-1)) + eps)
    return out, LinearState(S, z)


def _causal(fq, fk, v, state0, C, *, normalize, eps):
    B, H, N, F = fq.shape
    Dv = v.shape[-1]
    # The normalizer state z rides along as one more value column: v1 = [v, 1], S1 = [S, z].
    if state0 is not None:
        S1 = torch.cat([state0.S, state0.z.unsqueeze(-1)], dim=-1)  # (B, H, F, Dv + 1)
    else:
        S1 = fq.new_zeros(B, H, F, Dv + 1)
    # Sweep the sequence in blocks of whole chunks so that intermediates stay cache- and allocator-sized.
    block = max(1, _ROWS_PER_BLOCK // (B * H * C)) * C
    outs = []
    for s in range(0, N, block):
        o, S1 = _causal_block(fq[:, :, s:s + block], fk[:, :, s:s + block], v[:, :, s:s + block], S1, C)
        num, den = o[..., :Dv], o[..., Dv:]  # (B, H, n, Dv), (B, H, n, 1)
        outs.append(num / (den + eps) if normalize else num)
    if not outs:
        outs.append(v.new_zeros(B, H, 0, Dv))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out, LinearState(S1[..., :Dv].contiguous(), S1[..., Dv].contiguous())


def _causal_block(fq, fk, v, S1, C):
    """Causal linear attention over ``n`` tokens from state ``S1``; returns ``([num, den], S1 after)``."""
    B, H, n, F = fq.shape
    Dv = v.shape[-1]
    nc = -(-n // C)
    pad = nc * C - n
    v1 = torch.cat([v, v.new_ones(B, H, n, 1)], dim=-1)  # (B, H, n, Dv + 1)
    if pad:  # zero features and values: padded keys add nothing, padded queries are cut off below
        fq, fk, v1 = (_pad(t, (0, 0, 0, pad)) for t in (fq, fk, v1))
    fq_c = fq.reshape(B * H * nc, C, F)
    fk_c = fk.reshape(B * H * nc, C, F)
    v_c = v1.reshape(B * H * nc, C, Dv + 1)

    kv = torch.bmm(fk_c.transpose(1, 2), v_c).view(B, H, nc, F, Dv + 1)  # each chunk's own sum
    # Inclusive cumsum over [S1, kv_0, .., kv_{nc-2}]: the state each chunk starts from.
    S_in = torch.cat([S1.unsqueeze(2), kv[:, :, :-1]], dim=2).cumsum_(2)  # (B, H, nc, F, Dv + 1)
    A = torch.bmm(fq_c, fk_c.transpose(1, 2)).tril_()  # (B H nc, C, C), causal within the chunk
    o = torch.bmm(fq_c, S_in.view(B * H * nc, F, Dv + 1)).baddbmm_(A, v_c)  # inter + intra
    return o.view(B, H, nc * C, Dv + 1)[:, :, :n], S_in[:, :, -1] + kv[:, :, -1]
