"""Skinny products: a few rows times a wide weight, as in every decode step.

Shape legend: M rows (tokens in the step), K inputs, N outputs.

A decode step multiplies one row per sequence by every weight, so it streams every weight from memory
once per step; the floor is bytes over bandwidth. ``F.linear`` on CPU falls well short of that floor for
few rows (measured in ``benchmarks/skinny.py``, see ``benchmarks/RESULTS.md``): MKL runs such a product on
one thread whatever ``torch.get_num_threads()`` says, and through a kernel that reads the ``(N, K)``
weight slower than memory allows. :func:`skinny_linear` cuts the outputs into blocks, strided views of the
same storage (no copy), and multiplies them as one batched GEMM, which torch spreads over its threads and
MKL runs through its batched kernel:

- weight in ``nn.Linear``'s standard layout, ``(N, K)`` row-major: row blocks, ``(nb, N/nb, K) @ (nb, K,
  M)``, in ``max(ROW_BLOCKS, threads)`` blocks;
- weight stored input-major (a ``(N, K)`` tensor whose ``.t()`` is contiguous: same shape, names and
  values as ``nn.Linear``): column blocks, ``(nb, M, K) @ (nb, K, N/nb)``, of about ``BLOCK_ROWS`` outputs
  (``BLOCK_ONE_ROW`` for one row; :class:`InputMajorLinear`, or ``qkv.cpu.optimize(model, input_major=True)``).

Row blocks run from C++ where qkv's kernels are built (:func:`rows_linear`: the same ATen calls, one call instead of
about ten from Python). Which rows and shapes take the blocks is the product rule's business (:mod:`qkv.cpu.rule`,
one table that follows ``benchmarks/results/skinny.json``); everywhere else :func:`skinny_linear` is exactly
``F.linear``.

Every output is still one length-K dot product of the same operands; only the BLAS kernel that sums it
differs. :class:`SkinnyLinear` is an ``nn.Linear`` (same parameters, names and layout) that multiplies
through :func:`skinny_linear`; :class:`InputMajorLinear` stores its weight input-major.

Example:
    >>> import torch
    >>> from qkv.cpu.skinny import InputMajorLinear, SkinnyLinear, skinny_linear
    >>> lin = SkinnyLinear.from_linear(torch.nn.Linear(16, 4096))
    >>> lin.weight.is_contiguous()
    True
    >>> x = torch.randn(3, 16)
    >>> torch.allclose(lin(x), x @ lin.weight.t() + lin.bias, atol=1e-5)
    True
    >>> InputMajorLinear.from_linear(torch.nn.Linear(16, 4096)).weight.t().is_contiguous()
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .rule import MEASURED_ROWS, choose

__all__ = ["skinny_linear", "column_blocks", "row_blocks", "by_rows", "by_columns", "SkinnyLinear", "InputMajorLinear",
           "input_major", "standard_layout_state_dict", "sharing_parameters", "blockable", "rows_linear", "block_count"]

MAX_ROWS = MEASURED_ROWS  # more rows: never blocked
ROW_BLOCKS = 4  # row blocks: at least this many (and at least one per thread)
BLOCK_ROWS = 256  # column blocks of ~256 outputs for 2-32 rows,
BLOCK_ONE_ROW = 2048  # of ~2048 for one row (fewer, longer streams), at least one block per thread


def row_blocks(rows: int, n_out: int, k: int, threads: int | None = None) -> int:
    """How many row blocks :func:`skinny_linear` cuts a standard-layout ``(n_out, k)`` weight into for
    ``rows`` rows (1 means ``F.linear``): the rule's ``"row_blocks"`` without oneDNN (:func:`qkv.cpu.rule.choose`)."""
    threads = torch.get_num_threads() if threads is None else threads
    if choose(rows, n_out, k, threads=threads, onednn=False) != "row_blocks":
        return 1
    return block_count(threads)


def block_count(threads: int | None = None) -> int:
    """How many row blocks a product the rule sends to row blocks is cut into: at least :data:`ROW_BLOCKS`, at
    least one per thread (default ``torch.get_num_threads()``)."""
    return max(ROW_BLOCKS, torch.get_num_threads() if threads is None else threads)


def column_blocks(rows: int, n_out: int, k: int, threads: int | None = None) -> int:
    """How many column blocks :func:`skinny_linear` cuts an input-major ``(n_out, k)`` weight's outputs into
    for ``rows`` rows (1 means ``F.linear``): the rule's ``"columns"`` without oneDNN."""
    threads = torch.get_num_threads() if threads is None else threads
    if choose(rows, n_out, k, threads=threads, input_major=True, onednn=False) != "columns":
        return 1
    target = BLOCK_ONE_ROW if rows == 1 else BLOCK_ROWS
    return max(threads, round(n_out / target))


def by_rows(x2: torch.Tensor, weight: torch.Tensor, nb: int) -> torch.Tensor:
    """x2 (M, K) @ weight (N, K).T through ``nb`` row blocks of a contiguous weight -> (M, N)."""
    rows, K = x2.shape
    N = weight.shape[0]
    block = N // nb
    main = nb * block
    blocks = weight[:main].view(nb, block, K)
    xt = x2.t().expand(nb, K, rows)  # transposed operand: MKL's fast batched kernel for this shape
    out = x2.new_empty(rows, N)
    if rows == 1:
        torch.bmm(blocks, xt, out=out[:, :main].view(nb, block, 1))
    else:
        out[:, :main].copy_(torch.bmm(blocks, xt).view(main, rows).t())
    if main < N:
        out[:, main:] = F.linear(x2, weight[main:])
    return out


def by_columns(x2: torch.Tensor, weight: torch.Tensor, nb: int) -> torch.Tensor:
    """x2 (M, K) @ weight (N, K).T through ``nb`` column blocks of an input-major weight -> (M, N)."""
    rows, K = x2.shape
    N = weight.shape[0]
    wt = weight.t()
    block = N // nb
    main = nb * block
    blocks = wt.as_strided((nb, K, block), (block, N, 1))  # block j: outputs [j * block, (j + 1) * block)
    y = torch.bmm(x2.expand(nb, rows, K), blocks)  # (nb, rows, block)
    out = x2.new_empty(rows, N)
    out[:, :main].view(rows, nb, block).copy_(y.transpose(0, 1))
    if main < N:
        out[:, main:] = x2 @ wt[:, main:]
    return out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x (..., K), weight (N, K), bias (N,) or None; result (..., N).

    Blocked (see the module notes) when x is a float32/float64 CPU tensor with few rows, the weight is
    standard (contiguous) or input-major (``.t()`` contiguous), and no gradient is being recorded; otherwise
    exactly ``F.linear``.
    """
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    N = weight.shape[0]
    if rows > MAX_ROWS or x.device.type != "cpu" or weight.dim() != 2 or weight.shape[1] != K:
        return F.linear(x, weight, bias)
    standard = weight.is_contiguous()
    if standard:
        nb = row_blocks(rows, N, K)
    else:
        nb = column_blocks(rows, N, K) if weight.t().is_contiguous() else 1
    if nb == 1 or not blockable(x, weight):
        return F.linear(x, weight, bias)
    if standard:
        return rows_linear(x, weight, bias, nb)
    out = by_columns(x.reshape(rows, K), weight, nb)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], N)


def blockable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether blocks may multiply ``x`` by ``weight``: float32/float64 alike, no gradient being recorded."""
    return (x.dtype in _BLOCK_DTYPES and weight.dtype == x.dtype
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


_BLOCK_DTYPES = (torch.float32, torch.float64)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, nb: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``nb`` row blocks (:func:`by_rows`, then the bias) for a CPU call
    :func:`blockable` allows with a contiguous weight; from C++ where qkv's kernels are built (the same ATen
    calls in the same order, one call instead of about ten: :mod:`qkv.cpu.ops`)."""
    if ops.available():
        return ops.rows_linear(x, weight, bias, nb)
    K = x.shape[-1]
    out = by_rows(x.reshape(-1, K), weight, nb)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


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


def sharing_parameters(cls: type[nn.Linear], linear: nn.Linear) -> nn.Linear:
    """A ``cls`` (an ``nn.Linear`` subclass) holding ``linear``'s own parameter objects (none drawn anew)."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.weight, new.bias = linear.weight, linear.bias
    return new


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` (same parameters, names and layout) multiplied through :func:`skinny_linear`."""

    computes_linear = True  # F.linear's product and nothing more (an LM head's greedy screen may stand in)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> SkinnyLinear:
        """The same layer, sharing ``linear``'s parameters."""
        return sharing_parameters(cls, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias)


class InputMajorLinear(SkinnyLinear):
    """:class:`SkinnyLinear` with an input-major weight.

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
