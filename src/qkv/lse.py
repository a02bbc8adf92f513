"""The log-sum-exp contract of qkv, in one place, and conversions to and from the conventions of other kernels.

qkv's contract (every backend, ``qkv.attention(..., return_lse=True)``, ``qkv.merge_states``,
``qkv.attention_probs``, the varlen entry):

- **Natural log**: ``lse[b, h, i] = log(sum_j exp(s[b, h, i, j]))`` over the *allowed* keys ``j`` of row
  ``i``, where ``s`` are the final scores (``scale * q.k``, then every score modifier). A learnable sink
  (``sinks=``) is one more term of that sum: ``lse = log(exp(sink[h]) + sum_j exp(s_ij))``.
- **float32** whatever the input dtype, except **float64 for float64 inputs** (every backend that takes
  float64, ``merge_states`` of float64 parts, ring and context-parallel steps and their backward).
- **NaN is not empty**: a row with a NaN score (or a NaN sink) has a NaN ``lse`` and NaN output.
- **Layout (B, Hq, Nq)**: head-major, the layout of ``out`` minus its last dimension. The varlen entry,
  whose batch is one packed sequence, returns ``(Hq, total_q)``, FlashAttention's varlen layout.
- **-inf for an empty row** (no allowed key and no sink), whose output is zeros.

Other kernels differ, and mixing conventions silently mis-weights merged partials (an ``lse`` in base 2
read as natural log shrinks every weight difference by ``ln 2``). Known conventions:

- base 2 (``log2(sum 2^(s * log2 e))``): FlashInfer's merge kernels and several Triton decode kernels keep
  the log-sum-exp in base 2 because their softmax runs on ``exp2``;
- token-major ``(B, Nq, Hq)``: kernels that work in the ``(B, N, H, D)`` layout (FlashInfer's batch
  decode, some split-KV decoders) store one value per (token, head).

Converting (both directions, exact up to one float32 rounding; ``-inf`` stays ``-inf``)::

    lse = from_base2(lse2)                  # base 2 -> natural
    lse = from_token_major(lse_bnh)         # (B, Nq, Hq) -> (B, Hq, Nq)
    qkv.merge_states([out_a, out_b.transpose(1, 2)], [lse_a, from_token_major(from_base2(lse2_b))])

Example:
    >>> import torch, qkv
    >>> from qkv import lse as L
    >>> q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    >>> a = qkv.attention(q, k[:, :, :4], v[:, :, :4], return_lse=True)
    >>> b = qkv.attention(q, k[:, :, 4:], v[:, :, 4:], return_lse=True)
    >>> foreign = L.to_token_major(L.to_base2(b.lse))          # what a base-2, (B, N, H) kernel hands over
    >>> merged = qkv.merge_states([a.out, b.out], [a.lse, L.from_base2(L.from_token_major(foreign))])
    >>> bool(torch.allclose(merged.out, qkv.attention(q, k, v), atol=1e-5))
    True
"""

from __future__ import annotations

import math

import torch

__all__ = ["LN2", "to_base2", "from_base2", "to_token_major", "from_token_major"]

#: ``ln 2``: a base-2 log-sum-exp times this is the natural one.
LN2 = math.log(2.0)


def _check(lse, name: str, rank: int | None = None) -> torch.Tensor:
    if not isinstance(lse, torch.Tensor) or not lse.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a float tensor of log-sum-exps, got "
                        f"{type(lse).__name__} {getattr(lse, 'dtype', '')}")
    if rank is not None and lse.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-D tensor, got shape {tuple(lse.shape)}")
    return lse


def to_base2(lse: torch.Tensor) -> torch.Tensor:
    """Natural-log log-sum-exp -> base 2 (``lse / ln 2``), any shape; ``-inf`` stays ``-inf``. float32 out
    (float64 stays float64)."""
    lse = _check(lse, "to_base2")
    return lse.to(torch.float64 if lse.dtype == torch.float64 else torch.float32) / LN2


def from_base2(lse2: torch.Tensor) -> torch.Tensor:
    """Base-2 log-sum-exp -> natural log (``lse2 * ln 2``), any shape; ``-inf`` stays ``-inf``. float32 out
    (float64 stays float64)."""
    lse2 = _check(lse2, "from_base2")
    return lse2.to(torch.float64 if lse2.dtype == torch.float64 else torch.float32) * LN2


def to_token_major(lse: torch.Tensor) -> torch.Tensor:
    """qkv's (B, Hq, Nq) -> (B, Nq, Hq), contiguous."""
    return _check(lse, "to_token_major", 3).transpose(1, 2).contiguous()


def from_token_major(lse_bnh: torch.Tensor) -> torch.Tensor:
    """(B, Nq, Hq) -> qkv's (B, Hq, Nq), contiguous."""
    return _check(lse_bnh, "from_token_major", 3).transpose(1, 2).contiguous()
