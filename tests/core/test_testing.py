"""``qkv.testing``: the error-budget helper every numerical test relies on must itself fail when it should."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import qkv.testing
from qkv.testing import DEFAULT_FLOOR, DEFAULT_K, assert_within_budget, budget, max_error

REF = torch.randn(64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
def test_rounding_passes_and_a_real_error_fails(dtype):
    base = REF.to(dtype)
    b = budget(REF.to(dtype), REF, base)
    assert b.ok and b.k == DEFAULT_K[dtype] and b.baseline_error > 0, str(b)
    wrong = REF.to(dtype).clone()
    wrong[5, 3] += 30 * b.allowed  # one element off by far more than rounding
    with pytest.raises(AssertionError, match=r"wrong-one: candidate err .* vs allowed"):
        assert_within_budget(wrong, REF, base, what="wrong-one")


def test_allowance_is_k_times_baseline_plus_floor_at_scale():
    ref = REF * 50  # |ref| >> 1: the floor scales with it
    base = ref.float()
    b = budget(base, ref, base)
    scale = float(ref.abs().max())
    assert b.floor == pytest.approx(DEFAULT_FLOOR[torch.float32] * scale)
    assert b.allowed == pytest.approx(b.k * b.baseline_error + b.floor)
    assert budget(base, ref, base, k=3.0, floor=0.0).allowed == pytest.approx(3.0 * b.baseline_error)


def test_nan_or_inf_in_the_candidate_is_an_error():
    base = REF.float()
    for bad in (float("nan"), float("inf")):
        cand = REF.float().clone()
        cand[0, 0] = bad
        assert not budget(cand, REF, base).ok, bad
    both_inf = REF.clone()
    both_inf[1, 1] = -math.inf
    assert max_error(both_inf.float(), both_inf) < 1e-6, "equal infinities agree"


def test_reference_must_be_float64_without_nan():
    with pytest.raises(TypeError, match="reference must be float64"):
        budget(REF.float(), REF.float(), REF.float())
    nan = REF.clone()
    nan[0, 0] = math.nan
    with pytest.raises(AssertionError, match="reference contains NaN"):
        budget(REF.float(), nan, REF.float())


@pytest.mark.parametrize("which", ["candidate", "baseline"])
def test_shapes_must_match_without_broadcasting(which):
    row = REF[:1].float()  # (1, 16) would broadcast against (64, 16)
    args = {"candidate": REF.float(), "baseline": REF.float(), which: row}
    with pytest.raises(ValueError, match=f"{which} shape"):
        budget(args["candidate"], REF, args["baseline"])


def test_a_baseline_that_disagrees_in_meaning_is_refused():
    """A baseline computed with another meaning (here: every value shifted) would set an allowance large
    enough to pass a wrong candidate; the ceiling catches it, by default and when given."""
    shifted = (REF + 0.5).float()
    wrong = (REF + 1.0).float()
    with pytest.raises(AssertionError, match="exceeds its ceiling"):
        budget(wrong, REF, shifted)
    with pytest.raises(AssertionError, match="exceeds its ceiling"):
        budget(REF.float(), REF, REF.float(), baseline_ceiling=0.0)
    assert budget(wrong, REF, shifted, baseline_ceiling=math.inf).ok, "the check off: what the ceiling prevents"
    bad = REF.float().clone()
    bad[2, 2] = math.nan
    with pytest.raises(AssertionError, match="baseline's error is"):
        budget(REF.float(), REF, bad)


def test_docstring_example_runs():
    result = doctest.testmod(qkv.testing)
    assert result.attempted > 0 and result.failed == 0, result
