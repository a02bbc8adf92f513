"""Products with weights stored narrower than float32, for decode: bfloat16, and int8 with per-channel scales.

Shape legend: M rows (tokens in the step), K inputs, N outputs.

A decode step reads every weight once per step, so its time is the weights' bytes over the memory bandwidth;
fewer bytes per weight is the lever left once the products run at that floor. Two formats:

- **bfloat16** weights (a bf16 model): two bytes a weight. Each weight vector is widened to float32 in registers
  and the sums are float32, so the result is that of float32 arithmetic on the bf16 values.
- **bfloat16 values held as float32** (a bf16 checkpoint loaded with ``dtype=float32``, which is how every
  released checkpoint of the 2024-2026 families reaches a float32 model): the weight's low 16 bits are zero, so
  :class:`Bf16ExactLinear` keeps its upper halves, a bfloat16 copy that is the same numbers, and the float32
  products above give float32 arithmetic on exactly the float32 weights, at half their bytes. Lossless: only
  weights that :func:`is_bf16_exact` are converted.
- **int8 weight-only quantization** (Dettmers et al. 2022, "LLM.int8(): 8-bit Matrix Multiplication for
  Transformers at Scale", arXiv:2208.07339, section 3.1: symmetric absmax quantization per output channel, here
  without the outlier split): one byte a weight. Output channel n keeps integers q_n in [-127, 127] and one
  float32 scale s_n = max_k |w_nk| / 127; the product is s_n (x . q_n), in float32. Each weight moves by at most
  s_n / 2, so an output moves by at most |x|_1 s_n / 2 (and by about sqrt(K) |x| s_n / sqrt(12) for typical
  rounding errors): a lossy format, never a default.

The same kernel also streams plain **float32** weights for the one or two rows of a decode step
(:data:`qkv.cpu.rule.STREAM_ROWS`; :func:`qkv.cpu.gemm.linear` takes it there), which ``F.linear`` reads on one
thread at about half the memory's rate.

:func:`weight_linear` is the product, through the compiled kernel ``qkv_cpu::weight_linear`` for up to
:data:`WEIGHT_ROWS` rows (:func:`qkv.cpu.ops.why_not_weight_linear` says when it cannot run) and through its torch-op
twin (:func:`weight_linear_reference`) otherwise. :class:`Int8Linear` is a linear layer holding an int8 weight;
``qkv.cpu.optimize(model, weights="int8")`` puts one in place of every linear layer but the LM head.

Example:
    >>> import torch
    >>> from qkv.cpu.weights import Int8Linear, quantize_int8, weight_linear
    >>> w = torch.randn(64, 32)
    >>> q, s = quantize_int8(w)
    >>> q.dtype, s.shape
    (torch.int8, torch.Size([64]))
    >>> x = torch.randn(2, 32)
    >>> err = (weight_linear(x, q, s) - x @ w.t()).abs().max()
    >>> bool(err <= (x.abs().sum(-1).max() * s.max() / 2))
    True
    >>> Int8Linear.from_linear(torch.nn.Linear(32, 64))(x).shape
    torch.Size([2, 64])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import ops

__all__ = ["WEIGHT_ROWS", "WEIGHT_FORMATS", "quantize_int8", "dequantize", "weight_linear",
           "weight_linear_reference", "Int8Linear", "Bf16ExactLinear", "is_bf16_exact"]

#: Rows up to which :func:`weight_linear` runs the compiled kernel (a decode step's few rows); more rows (a prompt)
#: go through the twin, whose GEMM reuses each widened weight over every row.
WEIGHT_ROWS = 16

#: The weight formats ``qkv.cpu.optimize(model, weights=...)`` converts a model's linear layers to: ``"int8"``
#: (lossy, :class:`Int8Linear`) and ``"bf16-exact"`` (lossless, :class:`Bf16ExactLinear`: only float32 weights whose
#: every value is a bfloat16 value).
WEIGHT_FORMATS = ("int8", "bf16-exact")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of a weight.

    Args:
        weight: (N, K) floating, finite.

    Returns:
        ``(q, scale)``: q (N, K) int8 in [-127, 127] and scale (N,) float32, with ``q[n] * scale[n]`` within
        ``scale[n] / 2`` of ``weight[n]`` (``scale[n] = max |weight[n]| / 127``; 0 for a row of zeros).

    Example:
        >>> import torch
        >>> q, s = quantize_int8(torch.tensor([[1.0, -0.5], [0.0, 0.0]]))
        >>> q.tolist(), s.tolist()
        ([[127, -64], [0, 0]], [0.007874015718698502, 0.0])
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        seen = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"quantize_int8: weight must be a floating (N, K) tensor, got {seen}")
    w = weight.detach().to(torch.float32)
    bad = int((~w.isfinite()).sum())
    if bad:
        raise ValueError(f"quantize_int8: weight has {bad} non-finite values (NaN or inf); an int8 scale cannot hold "
                         f"them: fix the weights or keep this layer unquantized")
    amax = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])
    scale = amax / 127
    q = torch.round(w / torch.where(scale > 0, scale, 1.0).unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``q (N, K) int8`` with per-channel ``scale (N,)`` stands for, as ``(N, K)`` of ``dtype``
    (computed in float32)."""
    return (q.to(torch.float32) * scale.to(torch.float32).unsqueeze(1)).to(dtype)


def weight_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch-op twin of the kernel: ``x (..., K) @ weight (N, K)^T``, times ``scale (N,)`` where given, plus
    ``bias (N,)``, in float32 (float64 for a float64 x) -> (..., N) in x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.linear(x.to(acc), weight.to(acc))
    if scale is not None:
        y = y * scale.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def _check(x, weight, scale, bias) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_floating_point():
        seen = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"weight_linear: x must be a floating tensor (..., K), got {seen}")
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2
            or weight.dtype not in (torch.int8, torch.bfloat16, torch.float32)):
        seen = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight_linear: weight must be (N, K) int8 (with scale), bfloat16 or float32, got {seen}; "
                         f"a float64 weight takes F.linear")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"weight_linear: x's last dimension must be weight's K = {K}, got x {tuple(x.shape)}")
    if weight.dtype == torch.int8:
        if not isinstance(scale, torch.Tensor) or scale.shape != (N,) or not scale.is_floating_point():
            seen = f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else repr(scale)
            raise ValueError(f"weight_linear: an int8 weight needs scale, a floating (N,) = ({N},) tensor of "
                             f"per-channel scales (qkv.cpu.weights.quantize_int8 gives it), got {seen}")
    elif scale is not None:
        raise ValueError(f"weight_linear: a {str(weight.dtype).removeprefix('torch.')} weight takes no scale "
                         f"(scale=None); scales go with int8 weights")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (N,) or not bias.is_floating_point()):
        seen = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"weight_linear: bias must be None or a floating (N,) = ({N},) tensor, got {seen}")


def weight_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T`` (times ``scale``) plus ``bias`` with a float32, bfloat16 or int8 weight, sums in float32.

    Args:
        x: (..., K) floating (the kernel takes float32 and bfloat16; float64 runs the twin in float64).
        weight: (N, K) float32 or bfloat16 (``scale`` None) or int8 (``scale`` required).
        scale: (N,) per-output-channel scales of an int8 weight (:func:`quantize_int8`).
        bias: (N,) or None.

    Returns:
        (..., N) in x's dtype: the compiled kernel's for up to :data:`WEIGHT_ROWS` rows where
        :func:`qkv.cpu.ops.why_not_weight_linear` allows it, else :func:`weight_linear_reference`'s.
    """
    _check(x, weight, scale, bias)
    K = weight.shape[1]
    rows = x.numel() // K if K else 0
    if rows <= WEIGHT_ROWS and ops.why_not_weight_linear(x, weight, scale, bias) is None:
        return ops.weight_linear(x, weight, scale, bias)
    return weight_linear_reference(x, weight, scale, bias)


class Int8Linear(nn.Module):
    """A linear layer with its weight quantized to int8 per output channel (:func:`quantize_int8`), multiplied
    through :func:`weight_linear`; ``activation``, when set, is applied to the output.

    The integers and scales are buffers (``weight_int8`` (N, K) int8, ``weight_scale`` (N,) float32) and the bias
    stays a parameter; ``weight`` reads back the (N, K) weight they stand for, in the original weight's dtype (for
    code that reads a layer's weight; it is computed on every read). Inference only: there is no gradient for
    the integer weight. Build it with :meth:`from_linear`.
    """

    computes_linear = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype = torch.float32,
                 activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.weight_dtype = in_features, out_features, dtype
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.zeros(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.activation = activation

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> Int8Linear:
        """``linear`` (any ``nn.Linear``, float weight) quantized; its bias parameter is kept as is."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Int8Linear.from_linear: linear must be an nn.Linear, got {type(linear).__name__}")
        new = cls(linear.in_features, linear.out_features, bias=False, dtype=linear.weight.dtype,
                  activation=activation)
        q, s = quantize_int8(linear.weight)
        new.weight_int8, new.weight_scale = q.to(linear.weight.device), s.to(linear.weight.device)
        new.bias = linear.bias
        return new

    @property
    def weight(self) -> torch.Tensor:
        """The (N, K) weight the integers and scales stand for, in the original weight's dtype."""
        return dequantize(self.weight_int8, self.weight_scale, self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = weight_linear(x, self.weight_int8, self.weight_scale.float(), self.bias)  # float32 after a model.to()
        return y if self.activation is None else self.activation(y)

    def extra_repr(self) -> str:
        act = f", activation={self.activation!r}" if self.activation is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights=int8 per-channel{act}")


def is_bf16_exact(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is float32 and every value of it is a bfloat16 value (its low 16 bits are zero: a bf16
    checkpoint loaded as float32), so that a bfloat16 copy holds the same numbers. NaN never counts as exact."""
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32:
        return False
    w = weight.detach()
    return bool(torch.equal(w.to(torch.bfloat16).to(torch.float32), w))


class Bf16ExactLinear(nn.Module):
    """A float32 linear layer whose weight values are all bfloat16 values (:func:`is_bf16_exact`), stored as
    bfloat16: the same numbers at half the bytes, multiplied in float32 through :func:`weight_linear` (the compiled
    kernel for a decode step's few rows, widening each weight in registers; ``F.linear`` on the widened weight for
    more). ``activation``, when set, is applied to the output.

    ``weight_bf16`` (N, K) bfloat16 is a buffer; the bias stays a float32 parameter; ``weight`` reads back the
    float32 weight (equal to the original, computed on every read). Inference only: there is no gradient for the
    weight. Build it with :meth:`from_linear`, which refuses a weight that is not exact.
    """

    computes_linear = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_bf16", torch.zeros(out_features, in_features, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.activation = activation

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> Bf16ExactLinear:
        """``linear`` (an ``nn.Linear`` with a float32 weight of bfloat16 values) with its weight held in bfloat16;
        its bias parameter is kept as is. ``ValueError`` for any other weight (converting it would change it)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Bf16ExactLinear.from_linear: linear must be an nn.Linear, got {type(linear).__name__}")
        if not is_bf16_exact(linear.weight):
            what = "not float32" if linear.weight.dtype != torch.float32 else "not all bfloat16 values"
            raise ValueError(f"Bf16ExactLinear.from_linear: the weight ({linear.weight.dtype} "
                             f"{tuple(linear.weight.shape)}) is {what}, so a bfloat16 copy would change it; keep "
                             f"the layer as it is, or quantize it on purpose (weights='int8')")
        new = cls(linear.in_features, linear.out_features, bias=False, activation=activation)
        new.weight_bf16 = linear.weight.detach().to(torch.bfloat16)
        new.bias = linear.bias
        return new

    @property
    def weight(self) -> torch.Tensor:
        """The float32 (N, K) weight, equal to the one converted."""
        return self.weight_bf16.to(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = weight_linear(x, self.weight_bf16, None, self.bias)
        return y if self.activation is None else self.activation(y)

    def extra_repr(self) -> str:
        act = f", activation={self.activation!r}" if self.activation is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights=bfloat16 values held exactly{act}")
