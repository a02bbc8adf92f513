"""qkv.attention_stats: column sums, entropy and attention to chosen keys equal the float64 dense computation
(GQA, masks, score modifiers, rows, empty rows, any block size), and the memory stays O(N) at N = 16384."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import qkv
from qkv import masks, mods


def _reference_probs(q, k, mask, scale, softcap=None, window=None):
    """Float64 dense probabilities, written out independently of qkv's code."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(Hq // Hkv, dim=1)
    s = (scale if scale is not None else D ** -0.5) * q.double() @ kk.transpose(-1, -2)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Nq).view(-1, 1) + (Nk - Nq)
    j = torch.arange(Nk).view(1, -1)
    allowed = torch.ones(Nq, Nk, dtype=torch.bool)
    if mask == "causal":
        allowed = j <= i
    if window is not None:
        allowed = allowed & (j >= i - window)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1)
    return torch.nan_to_num(p, nan=0.0)


CASES = {
    "B2-Hq4-Hkv2-N37-causal": dict(B=2, Hq=4, Hkv=2, N=37, mask="causal"),
    "B1-Hq2-Hkv1-N64-window7-softcap": dict(B=1, Hq=2, Hkv=1, N=64, mask="causal", window=7, softcap=2.0),
    "B1-Hq3-Hkv3-N1-full": dict(B=1, Hq=3, Hkv=3, N=1, mask=None),
}


@pytest.mark.parametrize("block_rows", [None, 1, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_stats_equal_the_dense_float64_computation(case, block_rows):
    c = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    q = torch.randn(c["B"], c["Hq"], c["N"], 16, generator=g) * 2
    k = torch.randn(c["B"], c["Hkv"], c["N"], 16, generator=g) * 2
    v = torch.randn(c["B"], c["Hkv"], c["N"], 16, generator=g)
    mask = None
    if c["mask"] == "causal":
        mask = masks.sliding_window(c["window"]) if c.get("window") else masks.causal()
    mod = mods.softcap(c["softcap"]) if c.get("softcap") else None
    pos = [0, c["N"] - 1]
    st = qkv.attention_stats(q, k, v, mask=mask, score_mod=mod, positions=pos, block_rows=block_rows)
    p = _reference_probs(q, k, c["mask"], None, c.get("softcap"), c.get("window"))
    torch.testing.assert_close(st.column_sums.double(), p.sum(2), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(st.entropy.double(), -torch.xlogy(p, p).sum(-1), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(st.to_positions.double(), p[..., pos], atol=2e-6, rtol=1e-5)
    assert p.sum(2).std() > 0 or c["N"] == 1


def test_rows_empty_rows_and_float64():
    q = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    k = v = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    lengths = masks.padding(torch.tensor([0]))  # every key masked: rows are empty, entropy 0, no NaN
    st = qkv.attention_stats(q, k, v, mask=lengths)
    assert (st.column_sums == 0).all() and (st.entropy == 0).all() and st.to_positions is None
    st = qkv.attention_stats(q, k, v, rows=[3, 4])
    p = torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5, -1)
    torch.testing.assert_close(st.column_sums.double(), p[:, :, 3:5].sum(2), atol=1e-6, rtol=1e-6)
    assert (st.entropy[:, :, :3] == 0).all() and (st.entropy[:, :, 3:5] > 0).all()


def test_bad_input():
    q = k = v = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="attention_stats: positions must lie in"):
        qkv.attention_stats(q, k, v, positions=[4])
    with pytest.raises(ValueError, match="block_rows must be a positive int"):
        qkv.attention_stats(q, k, v, block_rows=0)
    with pytest.raises(ValueError, match="lse must be the operator's"):
        qkv.attention_stats(q, k, v, lse=torch.zeros(1, 1, 3))
    with pytest.raises(TypeError, match="attention_stats: rows must be"):
        qkv.attention_stats(q, k, v, rows=1.5)


N = 16384
_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch, qkv
    torch.set_num_threads(1)
    torch.manual_seed(0)
    N = int(sys.argv[1])
    q, k, v = (torch.randn(1, 1, N, 16) for _ in range(3))
    mask = qkv.masks.sliding_window(255)
    small = [t[:, :, :512] for t in (q, k, v)]
    qkv.attention_stats(*small, mask=mask, positions=[0])  # warm up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    st = qkv.attention_stats(q, k, v, mask=mask, positions=[0])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    total = float(st.column_sums.sum())
    print(json.dumps({"growth": after - before, "total": total, "first": float(st.to_positions[0, 0, 0, 0])}))
""")


def test_memory_stays_linear_at_16k():
    """One (N, N) float32 matrix would be 1 GiB; the stats must stay far below it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _SCRIPT, str(N)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert abs(r["total"] - N) < 1e-2 * N ** 0.5 and r["first"] == pytest.approx(1.0), r
    assert r["growth"] < N * N * 4 / 8, f"peak grew {r['growth'] / 2**20:.0f} MiB; limit 128 MiB"
