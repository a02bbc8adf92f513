"""One element_bytes: the cache's byte counts and the cost tables' read the same function, which takes dtype names
and torch dtypes alike and agrees with torch's own element sizes."""

from __future__ import annotations

import pytest
import torch

import qkv.cache
import qkv.cache.specs
import qkv.costs


def test_the_cache_and_the_costs_share_one_element_bytes():
    assert qkv.cache.element_bytes is qkv.costs.element_bytes is qkv.cache.specs.element_bytes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8,
                                   torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_torch_dtypes_count_their_element_size(dtype):
    assert qkv.costs.element_bytes(dtype) == torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("name, size", [("fp64", 8.0), ("float64", 8.0), ("bf16", 2.0), ("int4", 0.5),
                                        ("int2", 0.25)])
def test_names_count_packed_sizes(name, size):
    assert qkv.costs.element_bytes(name) == size


@pytest.mark.parametrize("bad", [torch.int64, torch.bool, "int3", ""], ids=str)
def test_unknown_dtypes_are_refused_with_the_list(bad):
    with pytest.raises(ValueError, match=r"not understood; use one of fp32, fp16, bf16"):
        qkv.costs.element_bytes(bad)


def test_group_scales_only_for_integer_caches():
    with pytest.raises(ValueError, match=r"group_size applies to int8/int4/int2 caches, not 'fp64'"):
        qkv.costs.element_bytes("fp64", group_size=32)
