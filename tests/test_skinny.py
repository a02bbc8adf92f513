"""qkv.cpu.skinny: the blocked few-row product equals F.linear (float64 reference, error budget), takes the
blocked path only where it should, and InputMajorLinear keeps nn.Linear's parameters and layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.cpu.skinny import InputMajorLinear, input_major, skinny_blocks, skinny_linear
from qkv.testing import assert_within_budget


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _check(x, w, b):
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = skinny_linear(x, w, b)
    assert got.shape == ref.shape and got.dtype == x.dtype
    assert_within_budget(got, ref, F.linear(x, w.contiguous(), b), what="skinny_linear")


@pytest.mark.parametrize("lead", [(1,), (3,), (8, 1), (2, 16), (33,)])
@pytest.mark.parametrize("n_out", [4096, 4100, 700])  # 4100: blocks plus a remainder; 700: few blocks
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(two_threads, lead, n_out, bias):
    g = torch.Generator().manual_seed(n_out + len(lead))
    K = 48
    x = torch.randn(*lead, K, generator=g)
    w = input_major(torch.randn(n_out, K, generator=g) / K ** 0.5)
    b = torch.randn(n_out, generator=g) if bias else None
    _check(x, w, b)


def test_blocking_rule():
    assert skinny_blocks(8, 32000, threads=1) == 1  # one thread: plain GEMM
    assert skinny_blocks(8, 32000, threads=2) == 125  # ~256 outputs per block
    assert skinny_blocks(1, 32000, threads=2) == 16  # one row: ~2048 per block
    assert skinny_blocks(1, 700, threads=2) == 2  # at least one block per thread
    assert skinny_blocks(33, 32000, threads=2) == 1  # many rows: BLAS parallelizes itself
    assert skinny_blocks(8, 256, threads=2) == 1  # narrow weights


def test_blocked_path_taken_and_plain_otherwise(two_threads, monkeypatch):
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or real_bmm(*a, **k))
    x, w = torch.randn(4, 32), input_major(torch.randn(2048, 32))
    skinny_linear(x, w)
    assert calls, "expected the blocked GEMM for 4 rows, an input-major weight and 2 threads"
    calls.clear()
    skinny_linear(x, w.contiguous())  # nn.Linear layout: plain F.linear
    skinny_linear(torch.randn(64, 32), w)  # many rows
    assert not calls


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
