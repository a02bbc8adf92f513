"""Learned KV compressors: softmax-gated pooling of every window of ``rate`` tokens into one entry.

DeepSeek-AI 2026, "DeepSeek-V4" technical report, Section 2.3 (eqs. 9-12 for CSA, 20-23 for HCA). A token
contributes a projected value ``kv_j`` and a gate ``gate_j`` (both C channels); a learned per-slot
``position_bias`` (rate, C) is added to the gates; an entry is the per-channel softmax over its slots of the
gates times the values:

    entry[c] = sum_j softmax_j(gate_j[c] + bias_j[c]) * kv_j[c]

- ``overlap=False`` (HCA, m' : 1): C = D, entry ``w`` pools the ``rate`` tokens of window ``w``.
- ``overlap=True`` (CSA, m : 1 with overlapping windows): C = 2D, each token carries two series, ``A`` (the
  first D channels) and ``B`` (the last D). Entry ``w`` pools 2·rate slots: series A of window ``w - 1``'s tokens
  and series B of window ``w``'s tokens, so consecutive entries share a window and each entry spans 2·rate
  tokens with stride ``rate``. Window 0 has no predecessor: its A slots carry weight 0 unless a ``carry``
  supplies the previous window.

Incremental use (prefill in pieces, decode): :func:`compress_kv` returns a :class:`CompressCarry` (the tokens of
the incomplete last window and, with overlap, the A slots of the last complete window); passing it to the next
call continues the sequence exactly, so pieces give the entries of the whole.

The entries come out before the model's norm and RoPE (the caller applies them). The pooling runs in float32
(float64 for float64 inputs) and returns the input dtype; forward and backward are exact (plain autograd).

Shape legend: B batch, N new tokens, P pending tokens (< rate), C channels per token (D, or 2D with overlap),
W complete windows, T = W entries, D entry width.

Example:
    >>> import torch
    >>> from qkv.sparse import compress_kv
    >>> kv, gate = torch.randn(2, 1, 10, 8).unbind(0)
    >>> out = compress_kv(kv, gate, torch.zeros(4, 8), rate=4)
    >>> out.entries.shape, out.carry.kv.shape       # 2 windows of 4; 2 tokens wait for the third
    (torch.Size([1, 2, 8]), torch.Size([1, 2, 8]))
    >>> cat = compress_kv(kv, gate, torch.zeros(4, 8), rate=4, overlap=True)
    >>> cat.entries.shape                              # 2D = 8 channels in, D = 4 out
    torch.Size([1, 2, 4])
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["CompressCarry", "CompressOut", "compress_kv"]


class CompressCarry(NamedTuple):
    """What :func:`compress_kv` needs from earlier tokens to continue a sequence.

    Fields: ``kv`` (B, P, C), the values of the tokens of the incomplete last window (P < rate, possibly 0);
    ``gate`` (B, P, C), their gates (without the position bias); ``prev_kv`` (B, rate, D), with ``overlap``, the
    series-A values of the last complete window's tokens (the first half of entry ``w + 1``), None before the first
    complete window and without overlap; ``prev_gate`` (B, rate, D), their gates (without the position bias), None
    alike.
    """

    kv: torch.Tensor
    gate: torch.Tensor
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None


class CompressOut(NamedTuple):
    """Result of :func:`compress_kv`: ``entries`` (B, T, D) in the input dtype, one per window completed by this
    call (the windows the carry's tokens started included), and the ``carry`` for the next call."""

    entries: torch.Tensor
    carry: CompressCarry


def _check(kv, gate, position_bias, rate, overlap, carry) -> None:
    fn = "compress_kv"
    for name, t in (("kv", kv), ("gate", gate)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.dim() != 3:
            seen = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{fn}: {name} must be a float (B, N, C) tensor, got {seen}")
    if gate.shape != kv.shape:
        raise ValueError(f"{fn}: gate has shape {tuple(gate.shape)} but kv has {tuple(kv.shape)}; both are (B, N, C)")
    if not isinstance(rate, int) or isinstance(rate, bool) or rate < 1:
        raise ValueError(f"{fn}: rate must be an int >= 1 (tokens per compressed entry), got {rate!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"{fn}: overlap must be a bool, got {type(overlap).__name__}")
    C = kv.shape[-1]
    if overlap and C % 2:
        raise ValueError(f"{fn}: overlap=True pools two series of D channels each, so kv must have C = 2D channels; "
                         f"got C={C} (odd)")
    if not isinstance(position_bias, torch.Tensor) or not position_bias.dtype.is_floating_point:
        raise TypeError(f"{fn}: position_bias must be a float (rate, C) tensor, got {type(position_bias).__name__}")
    if tuple(position_bias.shape) != (rate, C):
        raise ValueError(f"{fn}: position_bias must be (rate, C) = ({rate}, {C}), got {tuple(position_bias.shape)}")
    if carry is None:
        return
    if not isinstance(carry, CompressCarry):
        raise TypeError(f"{fn}: carry must be the CompressCarry a previous call returned (or None to start a "
                        f"sequence), got {type(carry).__name__}")
    B, D = kv.shape[0], C // 2
    if carry.kv.dim() != 3 or carry.kv.shape[0] != B or carry.kv.shape[2] != C or carry.kv.shape[1] >= rate \
            or carry.gate.shape != carry.kv.shape:
        raise ValueError(f"{fn}: carry holds pending tokens of shape {tuple(carry.kv.shape)} (gate "
                         f"{tuple(carry.gate.shape)}); expected (B={B}, P < rate={rate}, C={C}) for both: pass the "
                         f"carry of a call with the same batch, rate and channels")
    if (carry.prev_kv is None) != (carry.prev_gate is None):
        raise ValueError(f"{fn}: carry.prev_kv and carry.prev_gate must both be set or both be None")
    if carry.prev_kv is not None:
        if not overlap:
            raise ValueError(f"{fn}: the carry holds a previous window's slots, which only overlap=True reads; pass "
                             f"the carry of a call with the same overlap setting")
        want = (B, rate, D)
        if tuple(carry.prev_kv.shape) != want or tuple(carry.prev_gate.shape) != want:
            raise ValueError(f"{fn}: carry.prev_kv/prev_gate must be (B, rate, D) = {want}, got "
                             f"{tuple(carry.prev_kv.shape)} and {tuple(carry.prev_gate.shape)}")


def compress_kv(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, *, rate: int,
                overlap: bool = False, carry: CompressCarry | None = None) -> CompressOut:
    """Pool every complete window of ``rate`` tokens into one entry (see the module for the math).

    Args:
        kv: (B, N, C) projected values of the new tokens: C = D, or C = 2D with ``overlap``.
        gate: (B, N, C) their gate logits.
        position_bias: (rate, C) learned bias added to the gate of each slot of a window.
        rate: tokens per window (V4: 4 for CSA, 128 for HCA).
        overlap: CSA's overlapping windows (entry ``w`` pools window ``w - 1``'s series A and window ``w``'s
            series B) instead of HCA's disjoint ones.
        carry: the previous call's :attr:`CompressOut.carry` to continue a sequence; None starts one.

    Returns:
        :class:`CompressOut` ``(entries (B, T, D), carry)``: T is the number of windows completed by this call's
        tokens together with the carry's pending ones.

    Example:
        >>> import torch
        >>> from qkv.sparse import compress_kv
        >>> kv, gate, bias = torch.randn(1, 9, 6), torch.randn(1, 9, 6), torch.randn(3, 6)
        >>> whole = compress_kv(kv, gate, bias, rate=3, overlap=True).entries
        >>> first = compress_kv(kv[:, :4], gate[:, :4], bias, rate=3, overlap=True)
        >>> rest = compress_kv(kv[:, 4:], gate[:, 4:], bias, rate=3, overlap=True, carry=first.carry)
        >>> bool(torch.allclose(torch.cat([first.entries, rest.entries], 1), whole))
        True
    """
    _check(kv, gate, position_bias, rate, overlap, carry)
    if carry is not None and carry.kv.shape[1]:
        kv = torch.cat([carry.kv.to(kv.dtype), kv], 1)
        gate = torch.cat([carry.gate.to(gate.dtype), gate], 1)
    B, N, C = kv.shape
    W = N // rate
    used = W * rate
    acc = torch.float64 if kv.dtype == torch.float64 else torch.float32
    kv_w = kv[:, :used].reshape(B, W, rate, C).to(acc)  # (B, W, rate, C)
    gate_w = gate[:, :used].reshape(B, W, rate, C).to(acc) + position_bias.to(acc)  # (B, W, rate, C)
    prev_kv = prev_gate = None
    if W == 0:
        entries = kv_w.new_zeros(B, 0, C // 2 if overlap else C)
    elif not overlap:
        entries = (torch.softmax(gate_w, dim=2) * kv_w).sum(2)  # (B, W, C)
    else:
        D = C // 2
        bias_a = position_bias[:, :D].to(acc)
        if carry is not None and carry.prev_kv is not None:
            first_kv = carry.prev_kv.to(acc).unsqueeze(1)  # (B, 1, rate, D)
            first_gate = carry.prev_gate.to(acc).unsqueeze(1) + bias_a
        else:  # no window before the first: its slots weigh exp(-inf) = 0
            first_kv = kv_w.new_zeros(B, 1, rate, D)
            first_gate = kv_w.new_full((B, 1, rate, D), float("-inf"))
        a_kv = torch.cat([first_kv, kv_w[:, :-1, :, :D]], 1)  # (B, W, rate, D): series A of the window before
        a_gate = torch.cat([first_gate, gate_w[:, :-1, :, :D]], 1)
        slots_kv = torch.cat([a_kv, kv_w[..., D:]], 2)  # (B, W, 2 rate, D)
        slots_gate = torch.cat([a_gate, gate_w[..., D:]], 2)
        entries = (torch.softmax(slots_gate, dim=2) * slots_kv).sum(2)  # (B, W, D)
        prev_kv, prev_gate = kv[:, used - rate:used, :D], gate[:, used - rate:used, :D]
    if overlap and W == 0 and carry is not None:
        prev_kv, prev_gate = carry.prev_kv, carry.prev_gate
    out_carry = CompressCarry(kv[:, used:], gate[:, used:], prev_kv, prev_gate)
    return CompressOut(entries.to(kv.dtype), out_carry)
