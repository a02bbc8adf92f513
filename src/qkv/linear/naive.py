"""Linear attention, parallel (quadratic) form: the reference every other form is tested against.

Katharopoulos, Vyas, Pappas, Fleuret, "Transformers are RNNs: Fast Autoregressive Transformers with
Linear Attention", ICML 2020 (arXiv:2006.16236), equations 4-9.

With a feature map ``phi`` and (for causal attention) only keys ``j <= i`` allowed::

    S_i = S_0 + sum_j phi(k_j) v_j^T        (F, Dv)   the state
    z_i = z_0 + sum_j phi(k_j)              (F,)      the normalizer state
    out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps)   normalize=True
    out_i = phi(q_i)^T S_i                            normalize=False

``(S_0, z_0)`` is ``initial_state`` (zeros by default): the state left by earlier tokens. This file
computes the sums as the masked ``(N, N)`` matrix ``phi(Q) phi(K)^T``, which is O(N^2) but has no
reordering of sums: it is the specification. The types and input checks every form shares live in
:mod:`qkv.linear._common`.

Dtypes: inputs may be any floating dtype; q, k and v are cast to the accumulation dtype (float64 for
float64 inputs, float32 otherwise) before ``phi`` is applied, the state is kept in that dtype, and the
output is cast back to the input dtype.

Shape legend: B batch, H heads, N tokens (Nq queries, Nk keys), D head dim of q/k, Dv value head dim,
F features per head (``phi``'s output size; ``F = D`` for elu+1 and relu).
"""

from __future__ import annotations

import torch

from qkv.linear._common import DEFAULT_EPS, LinearAttentionOutput, LinearState, prepare
from qkv.linear.feature_maps import FeatureMap, elu_plus_one

__all__ = ["DEFAULT_EPS", "LinearState", "LinearAttentionOutput", "linear_attention_parallel"]

def linear_attention_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str | FeatureMap | None = elu_plus_one,
    causal: bool = False,
    normalize: bool = True,
    eps: float = DEFAULT_EPS,
    initial_state: LinearState | None = None,
) -> LinearAttentionOutput:
    """Linear attention by the masked ``(Nq, Nk)`` product ``phi(Q) phi(K)^T``: the reference.

    O(N^2) time and memory; exact up to one matmul's rounding; works in any dtype including float64.

    Args:
        q: ``(B, H, Nq, D)`` floating.
        k: ``(B, H, Nk, D)``, same dtype and device. ``Nk == Nq`` when ``causal``.
        v: ``(B, H, Nk, Dv)``, same dtype and device.
        feature_map: ``"elu_plus_one"`` (default), ``"relu"``, a callable ``phi(x_BHND) -> x_BHNF``
            (it receives q and k already cast to the accumulation dtype), or ``None`` when q and k
            already are features.
        causal: query ``i`` sees keys ``j <= i`` (and ``initial_state``).
        normalize: divide by ``phi(q_i)^T z_i + eps``; ``False`` returns the unnormalized
            ``phi(q_i)^T S_i``.
        eps: added to the normalizer so that a zero normalizer (e.g. all-zero relu features) gives
            a zero row instead of NaN. It is absolute: keep it well below the normalizer's typical
            size (about ``N`` times the mean ``phi(q)·phi(k)``). Ignored when ``normalize=False``.
        initial_state: ``LinearState(S (B, H, F, Dv), z (B, H, F))`` left by earlier tokens, or
            ``None`` for zeros.

    Returns:
        ``LinearAttentionOutput(out (B, H, Nq, Dv) in the input dtype, state)`` where ``state``
        includes every key of this call (float32, or float64 for float64 inputs).

    Example:
        >>> import torch
        >>> q, k, v = torch.randn(3, 2, 4, 7, 8, dtype=torch.float64).unbind(0)
        >>> out, state = linear_attention_parallel(q, k, v, causal=True)
        >>> out.shape, state.S.shape, state.z.shape
        (torch.Size([2, 4, 7, 8]), torch.Size([2, 4, 8, 8]), torch.Size([2, 4, 8]))
    """
    fn = "linear_attention_parallel"
    fq, fk, v, state0 = prepare(q, k, v, feature_map=feature_map, causal=causal, initial_state=initial_state,
                                eps=eps, fn=fn)
    A = fq @ fk.transpose(-1, -2)  # (B, H, Nq, Nk)
    if causal:
        A = A.tril()
    num = A @ v  # (B, H, Nq, Dv)
    den = A.sum(-1)  # (B, H, Nq)
    S = fk.transpose(-1, -2) @ v  # (B, H, F, Dv)
    z = fk.sum(-2)  # (B, H, F)
    if state0 is not None:
        num = num + fq @ state0.S
        den = den + (fq @ state0.z.unsqueeze(-1)).squeeze(-1)
        S, z = S + state0.S, z + state0.z
    out = num / (den + eps).unsqueeze(-1) if normalize else num
    return LinearAttentionOutput(out.to(q.dtype), LinearState(S, z))
