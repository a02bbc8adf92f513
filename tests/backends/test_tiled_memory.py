"""The tiled backend's memory is O(N) beyond its inputs: at N = 16384 its forward peaks far below one
N x N float32 score matrix (1 GiB). Measured in a fresh subprocess as the growth of the resident-set
high-water mark (``ru_maxrss``) across the call, after inputs are allocated and the code is warm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

N = 16384
SCORE_MATRIX_BYTES = N * N * 4  # one float32 (N, N) matrix: 1 GiB

_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch, qkv
    torch.set_num_threads(1)  # like the test session (tests/conftest.py): one thread per xdist worker
    torch.manual_seed(0)
    N, mask_name, backward = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    mask = {"window": qkv.masks.sliding_window(255), "causal": qkv.masks.causal()}[mask_name]
    q, k, v = (torch.randn(1, 4, N, 64, requires_grad=backward) for _ in range(3))
    small = [t.detach()[:, :, :512].clone().requires_grad_(backward) for t in (q, k, v)]
    out = qkv.attention(*small, mask=mask, backend="tiled")  # warm up: imports, allocator pools
    if backward:
        out.sum().backward()
    del out
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = qkv.attention(q, k, v, mask=mask, backend="tiled")
    if backward:
        out.sum().backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"growth": after - before, "finite": bool(torch.isfinite(out).all())}))
""")


def _peak_growth(mask_name: str, backward: bool, n: int = N) -> dict:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _SCRIPT, str(n), mask_name, "1" if backward else "0"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_forward_memory_sliding_window_16k():
    r = _peak_growth("window", backward=False)
    assert r["finite"]
    assert r["growth"] < SCORE_MATRIX_BYTES / 8, f"peak grew {r['growth'] / 2**20:.0f} MiB; limit 128 MiB"


def test_forward_backward_memory_causal_8k():
    """The CI size of the test below: at N = 8192 one (N, N) float32 matrix is 256 MiB, and an implementation
    that kept the scores (or probabilities) for backward would grow by at least that much."""
    n = 8192
    r = _peak_growth("causal", backward=True, n=n)
    assert r["finite"]
    limit = n * n * 4 / 2
    assert r["growth"] < limit, f"peak grew {r['growth'] / 2**20:.0f} MiB; limit {limit / 2**20:.0f} MiB"


@pytest.mark.slow
def test_forward_backward_memory_causal_16k():
    """Dense causal work (half of N^2) forward and backward: still O(N) memory."""
    r = _peak_growth("causal", backward=True)
    assert r["finite"]
    # Gradients of q, k, v (48 MiB) and the saved output are O(N) too; all far below 1 GiB.
    assert r["growth"] < SCORE_MATRIX_BYTES / 4, f"peak grew {r['growth'] / 2**20:.0f} MiB; limit 256 MiB"
