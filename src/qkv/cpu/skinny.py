"""Skinny products: a few rows times a wide weight, as in every decode step.

Shape legend: M rows (tokens in the step), K inputs, N outputs.

A decode step multiplies one row per sequence by every weight. CPU BLAS handles such an ``(M, K) @ (K,
N)`` product poorly in two ways (measured in ``benchmarks/generate.py``, see ``benchmarks/RESULTS.md``):

- it runs it on one thread whatever ``torch.get_num_threads()`` says;
- a weight stored the ``nn.Linear`` way, ``(N, K)`` row-major, is streamed through a one-row product
  slower than the same weight stored input-major, ``(K, N)`` row-major.

:func:`skinny_linear` takes an input-major weight (a ``(N, K)`` tensor whose ``.t()`` is contiguous,
so shape, names and values are those of ``nn.Linear``) and, when torch has more than one thread and
there are few rows, cuts the outputs into column blocks, strided views of the same storage (no copy),
multiplied as one batched GEMM that torch spreads over its threads. Every output is still one length-K
dot product of the same operands; only the BLAS kernel that sums it differs. :class:`InputMajorLinear`
is an ``nn.Linear`` that stores its weight that way and multiplies through :func:`skinny_linear`.

Example:
    >>> import torch
    >>> from qkv.cpu.skinny import InputMajorLinear, skinny_linear
    >>> lin = InputMajorLinear.from_linear(torch.nn.Linear(16, 4096))
    >>> lin.weight.shape, lin.weight.t().is_contiguous()
    (torch.Size([4096, 16]), True)
    >>> x = torch.randn(3, 16)
    >>> torch.allclose(lin(x), x @ lin.weight.t() + lin.bias, atol=1e-5)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["skinny_linear", "skinny_blocks", "InputMajorLinear", "input_major", "standard_layout_state_dict"]

# Measured on a 2-core AMD EPYC (weights cold, ``benchmarks/generate.py``): blocks of ~256 outputs for
# 2-32 rows; for one row, blocks of ~2048 (fewer, longer streams), at least one block per thread.
MAX_ROWS = 32
MIN_OUTPUTS = 512
BLOCK_ROWS = 256
BLOCK_ONE_ROW = 2048


def skinny_blocks(rows: int, n_out: int, threads: int | None = None) -> int:
    """How many column blocks :func:`skinny_linear` cuts ``n_out`` outputs into for ``rows`` rows
    (1 means a plain GEMM)."""
    threads = torch.get_num_threads() if threads is None else threads
    if threads < 2 or not 0 < rows <= MAX_ROWS or n_out < MIN_OUTPUTS:
        return 1
    target = BLOCK_ONE_ROW if rows == 1 else BLOCK_ROWS
    return max(threads, round(n_out / target))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x (..., K), weight (N, K), bias (N,) or None; result (..., N).

    Blocked over torch's threads (see the module notes) when the weight is input-major (``weight.t()``
    contiguous), x is a CPU tensor with at most ``MAX_ROWS`` rows, and no gradient is being recorded;
    otherwise exactly ``F.linear``.
    """
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    N = weight.shape[0]
    nb = skinny_blocks(rows, N)
    wt = weight.t()
    if (nb == 1 or not wt.is_contiguous() or x.device.type != "cpu" or weight.shape[1] != K
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)
    block = N // nb
    main = nb * block
    x2 = x.reshape(rows, K)
    blocks = wt.as_strided((nb, K, block), (block, N, 1))  # block j: outputs [j * block, (j + 1) * block)
    y = torch.bmm(x2.expand(nb, rows, K), blocks)  # (nb, rows, block)
    out = x2.new_empty(rows, N)
    out[:, :main].view(rows, nb, block).copy_(y.transpose(0, 1))
    if main < N:
        out[:, main:] = x2 @ wt[:, main:]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], N)


def input_major(weight: torch.Tensor) -> torch.Tensor:
    """The same (N, K) values stored input-major (``.t()`` contiguous)."""
    return weight.detach().t().contiguous().t()


def standard_layout_state_dict(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """A ``state_dict`` hook: every tensor in standard contiguous layout (input-major weights copied), so
    the state saves with ``safetensors.torch.save_file`` and loads into any model of the same config.
    Register it with ``module._register_state_dict_hook`` on a module that stores such weights."""
    for key, t in state.items():
        if key.startswith(prefix) and isinstance(t, torch.Tensor) and not t.is_contiguous():
            state[key] = t.contiguous()


class InputMajorLinear(nn.Linear):
    """``nn.Linear`` with an input-major weight, multiplied through :func:`skinny_linear`.

    Same parameters, names and values as ``nn.Linear``; ``load_state_dict`` and dtype/device casts keep
    the layout (``copy_`` and ``preserve_format``), and ``state_dict()`` hands out the weight in standard
    (contiguous) layout, so ``safetensors.torch.save_file`` takes it as is.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight = nn.Parameter(input_major(self.weight), requires_grad=self.weight.requires_grad)
        self._register_state_dict_hook(standard_layout_state_dict)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> InputMajorLinear:
        """The same layer (same parameter objects' values, new input-major storage)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = nn.Parameter(input_major(linear.weight), requires_grad=linear.weight.requires_grad)
        new.bias = linear.bias
        new._register_state_dict_hook(standard_layout_state_dict)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias)
