"""Ring attention across processes (gloo on CPU) equals single-device attention, forward and backward."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qkv
from qkv.distributed import ring_attention

WORLD = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONFIGS = [(False, None), (True, None), (True, 5)]


def _worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for causal, window in CONFIGS:
            _one(rank, causal, window, results)
    finally:
        dist.destroy_process_group()


def _one(rank, causal, window, results):
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, n, D = 2, 4, 2, 7, 8
    q = torch.randn(B, Hq, WORLD * n, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, WORLD * n, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, WORLD * n, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, Hq, WORLD * n, D, generator=g, dtype=torch.float64)
    sl = slice(rank * n, (rank + 1) * n)
    ql, kl, vl = (t[:, :, sl].clone().requires_grad_(True) for t in (q, k, v))
    res = ring_attention(ql, kl, vl, causal=causal, window=window)
    res.out.backward(dout[:, :, sl])
    results[(rank, causal, window)] = (res.out.detach(), res.lse.detach(), ql.grad, kl.grad, vl.grad)


@pytest.fixture(scope="module")
def ring_results():
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    return dict(results)


@pytest.mark.parametrize("causal,window", CONFIGS, ids=["full", "causal", "causal-window5"])
def test_ring_equals_single_device(ring_results, causal, window):
    results = {r: ring_results[(r, causal, window)] for r in range(WORLD)}
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, n, D = 2, 4, 2, 7, 8
    q = torch.randn(B, Hq, WORLD * n, D, generator=g, dtype=torch.float64).requires_grad_(True)
    k = torch.randn(B, Hkv, WORLD * n, D, generator=g, dtype=torch.float64).requires_grad_(True)
    v = torch.randn(B, Hkv, WORLD * n, D, generator=g, dtype=torch.float64).requires_grad_(True)
    dout = torch.randn(B, Hq, WORLD * n, D, generator=g, dtype=torch.float64)
    mask = None
    if causal:
        mask = qkv.masks.causal() if window is None else qkv.masks.sliding_window(window - 1)
    ref = qkv.attention(q, k, v, mask=mask, return_lse=True, backend="reference")
    ref.out.backward(dout)
    out = torch.cat([results[r][0] for r in range(WORLD)], dim=2)
    lse = torch.cat([results[r][1] for r in range(WORLD)], dim=2)
    assert torch.allclose(out, ref.out, atol=1e-6), float((out - ref.out).abs().max())
    assert torch.allclose(lse, ref.lse, atol=1e-5)
    for i, full in ((2, q.grad), (3, k.grad), (4, v.grad)):
        got = torch.cat([results[r][i] for r in range(WORLD)], dim=2)
        assert torch.allclose(got, full, atol=1e-6), (i, float((got - full).abs().max()))


def test_ring_needs_initialized_process_group():
    x = torch.randn(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(x, x, x)
