"""Attention rollout, flow, head importance and heatmaps."""

import pytest
import torch

from qkv.interpret import attention_flow, attention_rollout, head_importance, plot_attention


def _maps(L=3, B=2, H=2, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(torch.randn(B, H, N, N, generator=g), -1) for _ in range(L)]


def test_rollout_is_product_of_residual_averaged_maps():
    maps = _maps()
    eye = torch.eye(5, dtype=torch.float64)
    expected = None
    for a in maps:
        m = 0.5 * a.double().mean(1) + 0.5 * eye
        m = m / m.sum(-1, keepdim=True)
        expected = m if expected is None else m @ expected
    out = attention_rollout(maps)
    assert torch.allclose(out.double(), expected, atol=1e-6)
    assert torch.allclose(out.sum(-1), torch.ones(2, 5), atol=1e-5)


def test_rollout_of_identity_attention_is_identity():
    eye = torch.eye(4).expand(1, 3, 4, 4)
    assert torch.allclose(attention_rollout([eye, eye]), torch.eye(4).unsqueeze(0))


def test_flow_single_layer_equals_capacity_and_is_bounded_by_rollout_mass():
    maps = _maps(L=1, B=1, N=4)
    flow = attention_flow(maps, resolution=10**6)
    direct = 0.5 * maps[0].double().mean(1) + 0.5 * torch.eye(4)
    direct = direct / direct.sum(-1, keepdim=True)
    # With one layer the only path from output i to input j is the edge itself.
    assert torch.allclose(flow.double(), direct, atol=1e-5)
    two = attention_flow(_maps(L=2, B=1, N=4))
    assert (two >= 0).all() and (two <= 1 + 1e-6).all()


def test_head_importance_finds_the_useless_head():
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    w = torch.randn(2, 3, 8, 8)
    w[1, 2] = 0  # layer 1, head 2 contributes nothing

    def loss_fn(gates, i):
        h = x
        for l in range(2):
            heads = torch.stack([h @ w[l, j] for j in range(3)])  # (H, N, D)
            h = h + (gates[l].view(3, 1, 1) * heads).sum(0)
        return h.pow(2).mean()

    scores = head_importance(loss_fn, 2, 3)
    assert scores.shape == (2, 3) and scores[1, 2] == 0 and (scores[0] > 0).all()
    assert torch.allclose(scores.norm(dim=-1), torch.ones(2))


def test_plot_attention_writes_png(tmp_path):
    p = plot_attention(torch.softmax(torch.randn(3, 4), -1), tmp_path / "a.png", tokens_q=list("abc"),
                       tokens_k=list("wxyz"), title="t")
    assert p.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="one \\(Nq, Nk\\) map"):
        plot_attention(torch.ones(1, 2, 2), tmp_path / "b.png")
