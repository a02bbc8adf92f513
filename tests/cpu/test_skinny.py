"""qkv.cpu.skinny: the blocked few-row products (row blocks of a standard weight, column blocks of an
input-major one) equal F.linear (float64 reference, error budget), take the blocked path only where they
should, and SkinnyLinear / InputMajorLinear keep nn.Linear's parameters and layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.cpu import skinny as skinny_module
from qkv.cpu.skinny import InputMajorLinear, SkinnyLinear, column_blocks, input_major, row_blocks, skinny_linear
from qkv.testing import assert_within_budget


def _check(x, w, b):
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = skinny_linear(x, w, b)
    assert got.shape == ref.shape and got.dtype == x.dtype
    assert_within_budget(got, ref, F.linear(x, w.contiguous(), b), what="skinny_linear")


@pytest.mark.parametrize("layout", ["standard", "input_major"])
@pytest.mark.parametrize("lead", [(1,), (3,), (4,), (8, 1), (2, 16), (33,)])
@pytest.mark.parametrize("n_out", [4096, 4100, 1100, 700])  # 4100: blocks plus a remainder; 1100: two column
# blocks; 700: narrow, F.linear
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(two_threads, layout, lead, n_out, bias):
    g = torch.Generator().manual_seed(n_out + len(lead))
    K = 48
    x = torch.randn(*lead, K, generator=g)
    w = torch.randn(n_out, K, generator=g) / K ** 0.5
    w = input_major(w) if layout == "input_major" else w
    b = torch.randn(n_out, generator=g) if bias else None
    _check(x, w, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,K", [(1, 1024), (2, 300), (4, 64)])
def test_row_blocks_match_linear(threads, dtype, rows, K, row_block_table):
    """The standard-layout path at one and two threads, in both BLAS dtypes, taken (checked) and exact to budget."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert row_blocks(rows, 2050, K) > 1
        g = torch.Generator().manual_seed(rows + K)
        x = torch.randn(rows, K, generator=g, dtype=dtype)
        w = torch.randn(2050, K, generator=g, dtype=dtype) / K ** 0.5
        _check(x, w, torch.randn(2050, generator=g, dtype=dtype))
    finally:
        torch.set_num_threads(before)


def test_blocking_rules(row_block_table):
    """The block counts a product table (here the one that takes row blocks, tests/cpu/conftest.py) implies,
    without oneDNN."""
    assert row_blocks(1, 32000, 512, threads=1) == 4  # one thread: short rows still blocked
    assert row_blocks(1, 32000, 4096, threads=1) == 1  # ... wide rows read faster through F.linear
    assert row_blocks(4, 32000, 4096, threads=2) == 4  # at least ROW_BLOCKS blocks
    assert row_blocks(1, 32000, 512, threads=16) == 16  # ... and one per thread
    assert row_blocks(32, 32000, 512, threads=2) == 4  # up to 32 rows with several threads
    assert row_blocks(33, 32000, 512, threads=2) == 1  # more rows: F.linear
    assert row_blocks(9, 32000, 512, threads=1) == 1  # one thread: up to 8 rows
    assert row_blocks(2, 256, 512, threads=1) == 4  # narrow weights, one thread, 1-2 rows: whole decode steps
    assert row_blocks(3, 256, 512, threads=1) == 1  # ... more rows: F.linear
    assert row_blocks(2, 512, 1376, threads=2) == 4  # narrow, 2 threads, 1-4 rows: decided on whole decode steps
    assert row_blocks(5, 512, 1376, threads=2) == 1  # ... 5 rows and more: F.linear
    assert column_blocks(8, 32000, 512, threads=1) == 125  # input-major, one thread: ~256 outputs per block
    assert column_blocks(8, 32000, 512, threads=2) == 125
    assert column_blocks(1, 32000, 512, threads=2) == 16  # one row: ~2048 per block
    assert column_blocks(1, 1100, 512, threads=2) == 2  # at least one block per thread
    assert column_blocks(33, 32000, 512, threads=2) == 1  # many rows: BLAS parallelizes itself
    assert column_blocks(8, 512, 1376, threads=2) == 1  # narrow weights: F.linear


def test_blocked_path_taken_and_plain_otherwise(two_threads, monkeypatch, row_block_table):
    calls = []
    for name in ("rows_linear", "by_columns"):  # the two blocked paths
        real = getattr(skinny_module, name)
        monkeypatch.setattr(skinny_module, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    w = torch.randn(2048, 32)
    for x, weight in ((torch.randn(8, 32), w), (torch.randn(16, 32), input_major(w))):
        skinny_linear(x, weight)
        assert calls, f"expected the blocked GEMM for {x.shape[0]} rows and 2 threads"
        calls.clear()
    skinny_linear(torch.randn(33, 32), w)  # standard layout, more rows than the bands cover
    skinny_linear(torch.randn(64, 32), input_major(w))  # many rows
    skinny_linear(torch.randn(1, 32), w[:, ::2].repeat(1, 2))  # a contiguous copy: blocked (the one call below)
    skinny_linear(torch.randn(1, 16), w[:, ::2])  # a strided view, neither layout: F.linear
    skinny_linear(torch.randn(1, 32, dtype=torch.bfloat16), w.bfloat16())  # not a measured dtype
    x = torch.randn(1, 32, requires_grad=True)
    skinny_linear(x, w)  # a gradient is recorded
    assert len(calls) == 1, "only the contiguous copy takes the blocked path"


def test_skinny_linear_shares_parameters():
    ref = torch.nn.Linear(8, 600)
    lin = SkinnyLinear.from_linear(ref)
    assert lin.weight is ref.weight and lin.bias is ref.bias and lin.weight.is_contiguous()
    assert set(lin.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 8)
    assert_within_budget(lin(x), F.linear(x.double(), ref.weight.double(), ref.bias.double()), ref(x),
                         what="SkinnyLinear")


def test_gradients_flow_through_plain_linear(two_threads):
    lin = InputMajorLinear(16, 1024)
    x = torch.randn(2, 16, requires_grad=True)
    lin(x).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    F.linear(x_ref, lin.weight.detach().contiguous(), lin.bias.detach()).sum().backward()
    x64 = x.detach().double().requires_grad_(True)  # the two float32 sums differ in order: budget, not equality
    F.linear(x64, lin.weight.detach().double(), lin.bias.detach().double()).sum().backward()
    assert_within_budget(x.grad, x64.grad, x_ref.grad, what="dx")
    assert lin.weight.grad is not None and lin.weight.grad.shape == lin.weight.shape


def test_input_major_linear_keeps_values_names_and_layout():
    ref = torch.nn.Linear(8, 64)
    lin = InputMajorLinear.from_linear(ref)
    assert set(lin.state_dict()) == {"weight", "bias"}
    torch.testing.assert_close(lin.weight, ref.weight, rtol=0, atol=0)
    assert lin.weight.t().is_contiguous() and not lin.weight.is_contiguous()
    lin.load_state_dict({"weight": torch.zeros(64, 8), "bias": torch.zeros(64)})
    assert lin.weight.t().is_contiguous() and float(lin.weight.detach().abs().sum()) == 0.0
    assert lin.double().weight.t().is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("lead,n_out,k", [((1,), 1030, 64), ((1, 1), 4096, 24), ((2, 3), 2048, 40), ((5,), 7, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_linear_equals_the_python_blocks_bit_for_bit(dtype, lead, n_out, k, bias, monkeypatch):
    """rows_linear (the compiled call where qkv's kernels are built, else Python) equals by_rows plus the bias
    exactly, for any leading shape, outputs that the blocks do not divide, and both dtypes; with the kernels
    switched off (QKV_CPU_KERNELS=0) it runs by_rows itself."""
    from qkv.cpu import kernels
    from qkv.cpu.skinny import by_rows, rows_linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(*lead, k, generator=g, dtype=dtype)
    w = torch.randn(n_out, k, generator=g, dtype=dtype)
    b = torch.randn(n_out, generator=g, dtype=dtype) if bias else None
    want = by_rows(x.reshape(-1, k), w, 4)
    if b is not None:
        want += b
    want = want.view(*lead, n_out)
    got = rows_linear(x, w, b, 4)
    assert got.shape == want.shape and torch.equal(got, want)
    monkeypatch.setenv(kernels.ENV, "0")
    assert torch.equal(rows_linear(x, w, b, 4), want)
