"""``qkv.conformance.check``'s arguments (#46 item 8): ``checks="values"`` is one check (it was read letter by
letter), unknown check names and devices this torch cannot reach are refused with a ``ValueError`` before any
battery runs."""

from __future__ import annotations

import pytest
import torch

from qkv import conformance


def test_one_check_by_name_as_a_string():
    by_str = conformance.check("sdpa", checks="values")
    by_list = conformance.check("sdpa", checks=["values"])
    assert [f.check for f in by_str.findings] == [f.check for f in by_list.findings]
    assert "values" in {f.check for f in by_str.findings}
    assert {f.check for f in by_str.findings} <= {"values", "lse_layout", "lse_base"}


@pytest.mark.parametrize("checks", [["valuez"], ("values", "nope"), "v"])
def test_unknown_checks_are_refused(checks):
    with pytest.raises(ValueError, match="unknown check.*in checks; valid: lse_layout"):
        conformance.check("sdpa", checks=checks)


def test_a_device_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="'nope' is not a torch device"):
        conformance.check("sdpa", device="nope", checks="values")


def test_an_unreachable_device_is_refused():
    device = "hpu" if torch.cuda.is_available() else "cuda"  # a device type with no backend here
    with pytest.raises(ValueError, match=f"'{device}' is not available here"):
        conformance.check("sdpa", device=device, checks="values")
