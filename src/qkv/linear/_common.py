"""What the forms of linear attention share: the state and output types, the input checks, and the
preparation of features and state (``prepare``). :mod:`qkv.linear.naive` (the reference), ``chunk``,
``recurrent`` and ``performer`` import it; the reference itself imports nothing from its peers.

Shape legend: B batch, H heads, N tokens (Nq queries, Nk keys), D head dim of q/k, Dv value head dim,
F features per head.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qkv.linear.feature_maps import FeatureMap, resolve_feature_map

__all__ = ["DEFAULT_EPS", "LinearState", "LinearAttentionOutput", "acc_dtype", "check_qkv", "check_features",
           "check_state", "check_eps", "prepare"]

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
        state: the state after the last token, to pass as ``initial_state`` to the next call: a
            ``LinearState`` for (feature-map) linear attention; a tensor ``(B, H, Dk, Dv)`` for the gated rules
            (``gated_linear_*``, ``gated_delta_*``); a ``qkv.nn.RecurrentState`` from the recurrent mixers.
    """

    out: torch.Tensor
    state: LinearState | torch.Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums accumulate in: float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, fn: str, causal: bool) -> None:
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


def check_features(name: str, f: torch.Tensor, x: torch.Tensor, *, fn: str) -> None:
    if not isinstance(f, torch.Tensor):
        raise TypeError(f"{fn}: feature_map({name}) must return a torch.Tensor, got {type(f).__name__}")
    if f.dim() != 4 or f.shape[:3] != x.shape[:3]:
        raise ValueError(
            f"{fn}: feature_map({name}) must return (B, H, N, F) with the input's (B, H, N) = {tuple(x.shape[:3])}, "
            f"got shape {tuple(f.shape)}; map only the last dim"
        )
    if not f.is_floating_point():
        raise TypeError(f"{fn}: feature_map({name}) must return a floating tensor, got dtype {f.dtype}")


def check_state(state: LinearState | tuple | None, *, B: int, H: int, F: int, Dv: int, dtype: torch.dtype,
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


def check_eps(eps: float, *, fn: str) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"{fn}: eps must be a float >= 0, got {eps!r}")


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, feature_map: str | FeatureMap | None,
             causal: bool, initial_state: LinearState | None, eps: float, fn: str, state_name: str = "initial_state"):
    """Check inputs, cast to the accumulation dtype, apply ``phi``; return ``(fq, fk, v, state0)``.

    ``fq``: (B, H, Nq, F), ``fk``: (B, H, Nk, F), ``v``: (B, H, Nk, Dv), all in the accumulation dtype;
    ``state0`` is the validated ``initial_state`` or ``None``.
    """
    check_qkv(q, k, v, fn=fn, causal=causal)
    check_eps(eps, fn=fn)
    phi = resolve_feature_map(feature_map)
    dt = acc_dtype(q.dtype)
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
        check_features("q", fq, q, fn=fn)
        check_features("k", fk, k, fn=fn)
        if fq.shape[-1] != fk.shape[-1]:
            raise ValueError(
                f"{fn}: feature_map gave q {fq.shape[-1]} features and k {fk.shape[-1]}; they must match "
                f"(q is {tuple(q.shape)}, k is {tuple(k.shape)})"
            )
        fq, fk = fq.to(dt), fk.to(dt)
    B, H = q.shape[:2]
    state0 = check_state(initial_state, B=B, H=H, F=fq.shape[-1], Dv=v.shape[-1], dtype=dt, device=q.device, fn=fn,
                          name=state_name)
    return fq, fk, v, state0
