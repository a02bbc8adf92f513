"""Manifold-constrained hyper-connections (qkv.nn.hyper) against HF's DeepSeek-V4 modules in float64 (HF's source with
its float32 casts lifted, tests/_hf_float64.py): the branch weights, the block input, the streams after a branch, the
final collapse; Sinkhorn-Knopp's doubly stochastic output; the refusals."""

from __future__ import annotations

import pytest
import torch

from _hf_float64 import float64_module
from qkv.config.hyper import HyperConfig
from qkv.nn.hyper import HyperConnection, HyperHead, sinkhorn_knopp, widen_streams
from qkv.nn.residual import Residual

V4_CASTS = {".to(torch.float32)": 1, ".float()": 15, "dtype=torch.float32": 23, "dtype=torch.float)": 2}


def _hf_v4():
    pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")
    return float64_module("deepseek_v4", V4_CASTS)


def _config(n: int, iters: int):
    import transformers

    return transformers.DeepseekV4Config(hidden_size=12, hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=1e-6,
                                         rms_norm_eps=1e-6, num_hidden_layers=1, vocab_size=32)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * (0.3 if p.dim() > 1 else 1.0))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("n,iters", [(4, 20), (3, 7), (1, 1)], ids=["n4-it20", "n3-it7", "n1-it1"])
def test_branch_and_head_equal_hf_in_float64(n, iters):
    hf = _hf_v4()
    cfg = _config(n, iters)
    theirs = hf.DeepseekV4HyperConnection(cfg).double()
    head_theirs = hf.DeepseekV4HyperHead(cfg).double()
    _randomize(theirs, n)
    _randomize(head_theirs, 10 + n)
    hc = HyperConfig(hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=1e-6)
    ours, head = HyperConnection(12, hc).double(), HyperHead(12, hc).double()
    ours.load_state_dict(theirs.state_dict())
    head.load_state_dict({"fn": head_theirs.hc_fn, "base": head_theirs.hc_base, "scale": head_theirs.hc_scale})
    assert isinstance(ours, Residual) and isinstance(head, Residual)
    streams = torch.randn(2, 5, n, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(2, 5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        post, comb, collapsed = theirs(streams)
        x, ctx = ours.enter(streams)
        out = ours.leave(streams, y, ctx)
        want = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
        assert _rel(x, collapsed) < 1e-13 and _rel(ctx.post, post) < 1e-13 and _rel(ctx.comb, comb) < 1e-13
        assert _rel(out, want) < 1e-13
        assert _rel(ours.leave(streams, y[:, -2:], ctx), want[:, -2:]) < 1e-13  # the last columns only
        assert _rel(head.collapse(streams), head_theirs(streams)) < 1e-13
        torch.testing.assert_close(head.widen(y), y.unsqueeze(2).expand(-1, -1, n, -1), rtol=0, atol=0)
    assert n == 1 or (comb - comb.mean()).abs().max() > 1e-3, "the mixing must not be uniform for the test to bite"


def test_float32_streams_get_float32_weights_close_to_float64():
    hc = HyperConfig(hc_mult=4)
    ours = HyperConnection(12, hc)
    _randomize(ours, 0)
    streams = torch.randn(1, 3, 4, 12)
    with torch.no_grad():
        x32, w32 = ours.enter(streams)
        x64, w64 = ours.double().enter(streams.double())
    assert x32.dtype == torch.float32 and w32.comb.dtype == torch.float32
    assert _rel(x32.double(), x64) < 1e-5


def test_sinkhorn_knopp_is_doubly_stochastic_and_poison_shows():
    m = torch.rand(5, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.05
    p = sinkhorn_knopp(m, 60, 0.0)
    torch.testing.assert_close(p.sum(-1), torch.ones(5, 4, dtype=torch.float64))
    torch.testing.assert_close(p.sum(-2), torch.ones(5, 4, dtype=torch.float64))
    one = sinkhorn_knopp(m, 1, 0.0)  # one pass: columns only
    torch.testing.assert_close(one.sum(-2), torch.ones(5, 4, dtype=torch.float64))
    assert (one.sum(-1) - 1).abs().max() > 1e-3


def test_refusals():
    hc = HyperConfig(hc_mult=2)
    branch, head = HyperConnection(8, hc), HyperHead(8, hc)
    with pytest.raises(ValueError, match=r"streams must be \(B, N, hc_mult=2, d=8\)"):
        branch.enter(torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match="widen the embedding"):
        head.collapse(torch.zeros(1, 3, 3, 8))
    with pytest.raises(TypeError, match="HyperHead widens"):
        branch.widen(torch.zeros(1, 3, 8))
    with pytest.raises(TypeError, match="enters its HyperConnection"):
        head.enter(widen_streams(torch.zeros(1, 3, 8), 2))
    for bad in (dict(hc_mult=0), dict(hc_mult=2, hc_sinkhorn_iters=0), dict(hc_mult=2, hc_eps=-1.0),
                dict(hc_mult=True)):
        with pytest.raises(ValueError, match="HyperConfig: hc_"):
            HyperConfig(**bad)
