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
reordering of sums: it is the specification. It also holds the types and input checks that the
chunked and recurrent forms share.

Dtypes: inputs may be any floating dtype; q, k and v are cast to the accumulation dtype (float64 for
float64 inputs, float32 otherwise) before ``phi`` is applied, the state is kept in that dtype, and the
output is cast back to the input dtype.

Shape legend: B batch, H heads, N tokens (Nq queries, Nk keys), D head dim of q/k, Dv value head dim,
F features per head (``phi``'s output size; ``F = D`` for elu+1 and relu).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qkv.linear.feature_maps import FeatureMap, elu_plus_one, resolve_feature_map

__all__ = ["DEFAULT_EPS", "LinearState", "LinearAttentionOutput", "linear_attention_parallel"]

DEFAULT_EPS = 1e-6


class LinearState(NamedTuple):
    """The recurrent state after some tokens: everything later tokens need to know about them.

    Attributes:
        S: ``(B, H, F, Dv)`` sum of ``phi(k_j) v_j^T``; float32 (float64 for float64 inputs).
        z: ``(B, H, F)`` sum of ``phi(k_j)``, the normalizer state; same dtype as ``S``.
    """

    S: torch.Tensor
    z: torch.Tensor


class LinearAttentionOutput(NamedTuple):
    """Every linear-attention function returns this.

    Attributes:
        out: ``(B, H, N, Dv)``, the input dtype.
        state: ``LinearState`` after the last token, to pass as ``initial_state`` to the next call.
    """

    out: torch.Tensor
    state: LinearState


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums accumulate in: float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, fn: str, causal: bool) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument, what was seen and the fix."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{fn}: {name} must be a floating tensor, got dtype {t.dtype}; cast it with .float()")
        if t.dim() != 4:
            raise ValueError(
                f"{fn}: {name} must have rank 4 (B, H, N, D), got shape {tuple(t.shape)}; "
                f"the layout is (batch, heads, tokens, head_dim), e.g. x.view(B, N, H, D).transpose(1, 2)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"{fn}: q, k, v must share (B, H), got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
            f"for grouped-query heads repeat k and v with k.repeat_interleave(Hq // Hkv, dim=1)"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"{fn}: k and v must have the same number of tokens, got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"{fn}: causal=True needs as many queries as keys, got Nq={q.shape[2]}, Nk={k.shape[2]}; "
            f"to continue a sequence pass the earlier tokens' state as initial_state"
        )


def _check_features(name: str, f: torch.Tensor, x: torch.Tensor, *, fn: str) -> None:
    if not isinstance(f, torch.Tensor):
        raise TypeError(f"{fn}: feature_map({name}) must return a torch.Tensor, got {type(f).__name__}")
    if f.dim() != 4 or f.shape[:3] != x.shape[:3]:
        raise ValueError(
            f"{fn}: feature_map({name}) must return (B, H, N, F) with the input's (B, H, N) = {tuple(x.shape[:3])}, "
            f"got shape {tuple(f.shape)}; map only the last dim"
        )
    if not f.is_floating_point():
        raise TypeError(f"{fn}: feature_map({name}) must return a floating tensor, got dtype {f.dtype}")


def _check_state(state: LinearState | tuple | None, *, B: int, H: int, F: int, Dv: int, dtype: torch.dtype,
                 device: torch.device, fn: str, name: str = "initial_state") -> LinearState | None:
    """Validate a state's shapes and cast it to the accumulation ``dtype``."""
    if state is None:
        return None
    if not (isinstance(state, tuple) and len(state) == 2):
        raise TypeError(f"{fn}: {name} must be a LinearState(S, z) or None, got {type(state).__name__}")
    S, z = state
    if not (isinstance(S, torch.Tensor) and isinstance(z, torch.Tensor)):
        raise TypeError(f"{fn}: {name}.S and {name}.z must be tensors, got {type(S).__name__}, {type(z).__name__}")
    if tuple(S.shape) != (B, H, F, Dv) or tuple(z.shape) != (B, H, F):
        raise ValueError(
            f"{fn}: {name} must have S (B, H, F, Dv) = {(B, H, F, Dv)} and z (B, H, F) = {(B, H, F)}, "
            f"got S {tuple(S.shape)}, z {tuple(z.shape)}; pass the state returned by a call with the same "
            f"batch, heads, feature map and value dim"
        )
    if S.device != device or z.device != device:
        raise ValueError(f"{fn}: {name} is on {S.device}, inputs are on {device}; move it with .to(device)")
    return LinearState(S.to(dtype), z.to(dtype))


def _check_eps(eps: float, *, fn: str) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"{fn}: eps must be a float >= 0, got {eps!r}")


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, feature_map: str | FeatureMap | None,
             causal: bool, initial_state: LinearState | None, eps: float, fn: str, state_name: str = "initial_state"):
    """Check inputs, cast to the accumulation dtype, apply ``phi``; return ``(fq, fk, v, state0)``.

    ``fq``: (B, H, Nq, F), ``fk``: (B, H, Nk, F), ``v``: (B, H, Nk, Dv), all in the accumulation dtype;
    ``state0`` is the validated ``initial_state`` or ``None``.
    """
    _check_qkv(q, k, v, fn=fn, causal=causal)
    _check_eps(eps, fn=fn)
    phi = resolve_feature_map(feature_map)
    dt = _acc_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if phi is None:
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"{fn}: with feature_map=None q and k are features and must share F, got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}"
            )
        fq, fk = q, k
    else:
        fq, fk = phi(q), phi(k)
        _check_features("q", fq, q, fn=fn)
        _check_features("k", fk, k, fn=fn)
        if fq.shape[-1] != fk.shape[-1]:
            raise ValueError(
                f"{fn}: feature_map gave q {fq.shape[-1]} features and k {fk.shape[-1]}; they must match "
                f"(q is {tuple(q.shape)}, k is {tuple(k.shape)})"
            )
        fq, fk = fq.to(dt), fk.to(dt)
    B, H = q.shape[:2]
    state0 = _check_state(initial_state, B=B, H=H, F=fq.shape[-1], Dv=v.shape[-1], dtype=dt, device=q.device, fn=fn,
                          name=state_name)
    return fq, fk, v, state0


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
    fq, fk, v, state0 = _prepare(q, k, v, feature_map=feature_map, causal=causal, initial_state=initial_state,
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
