"""What the recurrent mixers (:class:`qkv.nn.GatedDeltaNet`, :class:`qkv.nn.KimiDeltaAttention`,
:class:`qkv.nn.Mamba2Mixer`) share: their state, the short causal depthwise convolution that carries the last
``K - 1`` inputs from call to call, the L2 normalisation of q and k, padding, and input checks.

The short convolution comes from H3 and Mamba (Fu et al. 2023, arXiv:2212.14052; Gu and Dao 2023,
arXiv:2312.00752); every layer here uses a kernel of K = 4 taps per channel, causal, followed by SiLU.

Shape legend: B batch, N tokens, E model width, Cc convolution channels, K kernel taps, H value heads,
Dk key dim, Dv value dim.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from qkv.linear import gated_delta_chunked, gated_delta_step

__all__ = ["RecurrentState", "DeltaKernel", "causal_conv", "l2norm", "mask_padding", "check_input", "check_state",
           "fused_delta_step", "delta_mix"]


class RecurrentState(NamedTuple):
    """What a recurrent mixer keeps between calls, whatever the context length.

    Attributes:
        conv: ``(B, Cc, K - 1)`` the convolution's last ``K - 1`` inputs (zeros before the first token).
        recurrent: ``(B, H, Dk, Dv)`` the state of the gated rule (float32, float64 for float64 inputs).
    """

    conv: torch.Tensor
    recurrent: torch.Tensor


class DeltaKernel(Protocol):
    """Faster implementations of the gated delta rule for a recurrent mixer's ``delta_kernel`` slot, put there from
    outside (``qkv.cpu.optimize``: qkv's compiled kernels). It is also the ``kernel`` of
    :func:`qkv.linear.gated_delta_chunked` (``why_not`` and the call)."""

    def why_not(self, *tensors: torch.Tensor | None) -> str | None:
        """Why the chunked rule's kernel does not run these tensors, or None."""

    def __call__(self, q, k, v, g, beta, state, chunk_size: int, safe_log: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunked rule over contiguous prepared tensors -> ``(out (B, H, N, Dv), state (B, H, Dk, Dv))``."""

    def step_declines(self, *tensors: torch.Tensor | None) -> str | None:
        """Why :meth:`step` does not run these tensors, or None."""

    def step(self, mixed, conv_state, conv_weight, g, beta, state, Hk: int, q_scale: float,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step after the projections: ``mixed (B, Cc)``, ``conv_state (B, Cc, K - 1)``, ``conv_weight
        (Cc, K)``, ``g (B, H[, Dk])``, ``beta (B, H)``, ``state (B, H, Dk, Dv)``, all contiguous -> ``(o (B, H, Dv),
        conv_state, state)``."""


def causal_conv(x_BNC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prev_BCK: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the causal depthwise convolution of ``x`` continuing from ``prev`` (its last ``K - 1`` inputs).

    Args:
        x_BNC: ``(B, N, Cc)`` inputs.
        weight: ``(Cc, 1, K)`` as ``nn.Conv1d(Cc, Cc, K, groups=Cc).weight``.
        bias: ``(Cc,)`` or None.
        prev_BCK: ``(B, Cc, K - 1)`` or None for zeros (a fresh sequence).

    Returns:
        ``(y (B, N, Cc), the last K - 1 inputs (B, Cc, K - 1))``.
    """
    B, N, Cc = x_BNC.shape
    K = weight.shape[-1]
    x_BCN = x_BNC.transpose(1, 2)
    if prev_BCK is None:
        prev_BCK = x_BCN.new_zeros(B, Cc, K - 1)
    full = torch.cat([prev_BCK.to(x_BCN.dtype), x_BCN], dim=-1)  # (B, Cc, K - 1 + N)
    if N == 1:  # a decode step: one dot of K taps per channel (F.conv1d costs ~100 us of setup for it on CPU)
        y = (full * weight.to(full.dtype).view(Cc, K)).sum(-1, keepdim=True)
        if bias is not None:
            y = y + bias.to(full.dtype).unsqueeze(-1)
    else:
        y = F.conv1d(full, weight.to(full.dtype), None if bias is None else bias.to(full.dtype), groups=Cc)
    return F.silu(y).transpose(1, 2), full[:, :, full.shape[-1] - (K - 1):]


def fused_delta_step(mixed: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                     g: torch.Tensor, beta: torch.Tensor, state: RecurrentState | None, *, Hk: int, Dk: int, Dv: int,
                     q_scale: float, kernel: DeltaKernel | None) -> tuple[torch.Tensor, RecurrentState] | None:
    """A gated-delta mixer's decode step after its projections by ``kernel.step`` (qkv's compiled CPU kernel
    ``qkv/cpu/csrc/delta_decode.cpp`` where ``qkv.cpu.optimize`` set it): :func:`causal_conv` of one token,
    :func:`l2norm` of q and k (q times ``q_scale``) and ``qkv.linear.gated_delta_step``, in one call instead of some
    35 operator calls.

    Args:
        mixed: ``(B, 1, Cc)`` the projections ``[q (Hk Dk) | k (Hk Dk) | v (H Dv)]`` before the convolution.
        conv_weight: ``(Cc, 1, K)``; conv_bias: must be None (the layers that use this have none).
        g: ``(B, H, 1)`` or ``(B, H, 1, Dk)`` log-decays; beta: ``(B, H, 1)``.
        state: the mixer's state, or None for a fresh sequence.
        kernel: a :class:`DeltaKernel`, or None (then this returns None).

    Returns:
        ``(o (B, H, 1, Dv), the new RecurrentState)``, or ``None`` where the kernel does not run this call (no
        kernel, a bias, or ``kernel.step_declines`` the tensors: not CPU, not float32/float64 throughout, autograd
        recording, the kernels unavailable): the caller then runs the torch ops, which give the same values.
    """
    B, _, Cc = mixed.shape
    H = beta.shape[1]
    tensors = [mixed, conv_weight, g, beta] + ([] if state is None else [state.conv, state.recurrent])
    if kernel is None or conv_bias is not None or kernel.step_declines(*tensors) is not None:
        return None
    K = conv_weight.shape[-1]
    if state is None:
        conv, rec = mixed.new_zeros(B, Cc, K - 1), mixed.new_zeros(B, H, Dk, Dv)
    else:
        conv, rec = state.conv.contiguous(), state.recurrent.contiguous()
    o, conv, rec = kernel.step(mixed.reshape(B, Cc).contiguous(), conv, conv_weight.reshape(Cc, K).contiguous(),
                                    g.reshape(B, H, -1).contiguous() if g.dim() == 4 else g.reshape(B, H).contiguous(),
                                    beta.reshape(B, H).contiguous(), rec, Hk, q_scale, L2_EPS)
    return o.unsqueeze(2), RecurrentState(conv, rec)


def delta_mix(mixed: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: RecurrentState | None, *, Hk: int, Dk: int, Dv: int, chunk_size: int | None,
              one_token: bool, kernel: DeltaKernel | None = None) -> tuple[torch.Tensor, RecurrentState]:
    """The gated-delta part of a mixer (Gated DeltaNet, KDA) after its projections: the short convolution, L2-normed
    q (times ``Dk ** -0.5``) and k, then the rule by :func:`~qkv.linear.gated_delta_step` for one token (one
    compiled call, :func:`fused_delta_step`, where it applies) or :func:`~qkv.linear.gated_delta_chunked`.

    Args:
        mixed: ``(B, N, Cc)`` the projections ``[q (Hk Dk) | k (Hk Dk) | v (H Dv)]``; conv_weight ``(Cc, 1, K)``.
        g: ``(B, H, N)`` or ``(B, H, N, Dk)`` log-decays; beta: ``(B, H, N)``; state: or None for a fresh sequence.
        kernel: the mixer's ``delta_kernel`` (:class:`DeltaKernel`), or None for torch's ops throughout.

    Returns:
        ``(o (B, H, N, Dv), RecurrentState after the last token)``.
    """
    H = beta.shape[1]
    if one_token:
        fused = fused_delta_step(mixed, conv_weight, None, g, beta, state, Hk=Hk, Dk=Dk, Dv=Dv, q_scale=Dk ** -0.5,
                                 kernel=kernel)
        if fused is not None:
            return fused
    B, N, _ = mixed.shape
    mixed, conv = causal_conv(mixed, conv_weight, None, None if state is None else state.conv)
    q, k, v = mixed.split([Hk * Dk, Hk * Dk, H * Dv], dim=-1)
    q = l2norm(q.view(B, N, Hk, Dk)).transpose(1, 2) * Dk ** -0.5  # (B, Hk, N, Dk)
    k = l2norm(k.view(B, N, Hk, Dk)).transpose(1, 2)  # (B, Hk, N, Dk)
    v = v.reshape(B, N, H, Dv).transpose(1, 2)  # (B, H, N, Dv)
    rec = None if state is None else state.recurrent
    if one_token:
        o, rec = gated_delta_step(q, k, v, g, beta, rec)
    else:
        o, rec = gated_delta_chunked(q, k, v, g, beta, chunk_size=chunk_size, initial_state=rec, kernel=kernel)
    return o, RecurrentState(conv, rec)


L2_EPS = 1e-6
"""Added to the sum of squares under the root in :func:`l2norm` (fla's and HF's value)."""


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and HF's form: eps inside the root)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def mask_padding(x: torch.Tensor, attention_mask: torch.Tensor | None, *, fn: str) -> torch.Tensor:
    """Zero padded positions (``attention_mask`` 0/False), as HF does before a mixer: padding then writes nothing
    into the recurrent state, so a left-padded row ends in the state its real tokens alone would leave."""
    if attention_mask is None:
        return x
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{fn}: attention_mask must be a tensor (B, N) = {tuple(x.shape[:2])} with 1 for real tokens "
                         f"and 0 for padding, got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    return x * attention_mask.to(x.dtype).unsqueeze(-1)


def check_input(x, width: int, *, fn: str, one_token: bool = False) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor (B, N, hidden_size), got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != width:
        raise ValueError(f"{fn}: x must have shape (B, N, hidden_size={width}), got {tuple(x.shape)}")
    if one_token and x.shape[1] != 1:
        raise ValueError(f"{fn}: x must hold one token (B, 1, hidden_size), got {tuple(x.shape)}; use "
                         f"forward(x, state=state) for several tokens")


def check_state(state, *, B: int, conv: tuple[int, int], rec: tuple[int, int, int], fn: str) -> None:
    if state is None:
        return
    if not isinstance(state, RecurrentState):
        raise TypeError(f"{fn}: state must be a qkv.nn.RecurrentState(conv, recurrent) or None, got "
                        f"{type(state).__name__}")
    if tuple(state.conv.shape) != (B, *conv) or tuple(state.recurrent.shape) != (B, *rec):
        raise ValueError(f"{fn}: state must have conv (B, Cc, K - 1) = {(B, *conv)} and recurrent (B, H, Dk, Dv) = "
                         f"{(B, *rec)}, got conv {tuple(state.conv.shape)}, recurrent {tuple(state.recurrent.shape)}; "
                         f"pass the state this layer returned for the same batch")
