"""Fixtures of the backend tests."""

from __future__ import annotations

import pytest
import torch

from qkv.backends.paged import blocks_compiled
from qkv.cpu import kernels


@pytest.fixture(params=["compiled", "torch"])
def kernel_path(request, monkeypatch):
    """Runs a test twice: on qkv's compiled CPU kernels (which must build here) and on the torch ops
    (``QKV_CPU_KERNELS=0``); the value names the path."""
    if request.param == "torch":
        monkeypatch.setenv(kernels.ENV, "0")
    elif kernels.unavailable_reason():
        pytest.fail(f"the compiled kernels must build on this machine: {kernels.unavailable_reason()}")
    assert blocks_compiled(torch.zeros(1)) == (request.param == "compiled")
    return request.param
