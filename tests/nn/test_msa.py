"""qkv.nn.MSAIndexer (MiniMax-M3's sparse-attention indexer) against HF transformers' ``MiniMaxM3VLIndexer`` in
float64 with the same random weights: the same blocks per KV group for a prefill, a chunk and a decode step over a
history; a left-padded row picks what it picks alone (blocks anchored to positions); bad arguments refused."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.nn.msa import MSAIndexer

F64 = torch.float64


def _rows(idx):
    return [[[sorted({int(v) for v in r if v >= 0}) for r in h] for h in b] for b in idx]


def _pair(Di, R, seed):
    transformers = pytest.importorskip("transformers")
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf

    cfg = transformers.MiniMaxM3VLTextConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        index_n_heads=2, index_head_dim=Di, index_block_size=4, index_topk_blocks=3, index_local_blocks=1,
        vocab_size=64, layer_types=["minimax_m3_sparse"], rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": R / 16})
    torch.manual_seed(seed)
    theirs = hf.MiniMaxM3VLIndexer(cfg, 0).to(F64)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3 if p.dim() == 1 else 1 / math.sqrt(p.shape[-1]))
    ours = MSAIndexer(32, index_n_heads=2, index_head_dim=Di, index_block_size=4, index_topk_blocks=3,
                      index_local_blocks=1, rotary_dim=R).to(F64)
    ours.load_state_dict(theirs.state_dict())
    rotary = hf.MiniMaxM3VLRotaryEmbedding(cfg)
    return hf, theirs, ours, rotary


@pytest.mark.parametrize("Di,R", [(16, 16), (12, 8)], ids=["Di16-R16", "Di12-R8-partial"])
@pytest.mark.parametrize("N,Nq", [(22, 22), (22, 6), (17, 1)], ids=["prefill", "chunk", "decode"])
def test_blocks_equal_hfs(Di, R, N, Nq):
    hf, theirs, ours, rotary = _pair(Di, R, seed=N + Nq + Di)
    B = 2
    x = torch.randn(B, N, 32, generator=torch.Generator().manual_seed(N * Nq), dtype=F64)
    pos = torch.arange(N).expand(B, N)
    cos, sin = rotary(x, pos)
    with torch.no_grad():
        layer = hf.MiniMaxM3VLSparseCacheLayer()

        class _Cache:
            layers = [layer]
        if N > Nq:
            theirs(x[:, :N - Nq], (cos[:, :N - Nq], sin[:, :N - Nq]), _Cache(), pos[:, :N - Nq])
        want = theirs(x[:, N - Nq:], (cos[:, N - Nq:], sin[:, N - Nq:]), _Cache(), pos[:, N - Nq:])
        keys = ours.keys(x, pos)
        got = ours(x[:, N - Nq:], keys, q_positions=pos[:, N - Nq:], kv_positions=pos)
    # HF's float64 indexer normalizes and builds its rotary table in float32: its keys are float32-accurate
    err = (keys - layer.idx_keys.squeeze(1)).abs().max().item()
    assert err < 1e-5, f"the cached indexer keys differ by {err:.3g}"
    assert got.blocks.shape == want.shape
    assert _rows(got.blocks) == _rows(want)
    mask = theirs.build_block_mask(want, None, N, F64, x.device, pos[:, N - Nq:]) == 0  # (B, 4, Nq, N)
    from qkv import masks
    from qkv.sparse.select import expand_heads

    assert torch.equal(masks.topk(expand_heads(got.slots, 4)).dense(B, 4, Nq, N), mask)


def test_left_padding_picks_what_the_row_picks_alone():
    _, _, ours, _ = _pair(16, 16, seed=3)
    N, pad = 19, 5
    x = torch.randn(1, N, 32, generator=torch.Generator().manual_seed(1), dtype=F64)
    padded = torch.cat((torch.zeros(1, pad, 32, dtype=F64), x), 1)
    pos = torch.arange(N).view(1, N)
    ppos = torch.cat((torch.full((1, pad), -1), pos), 1)
    with torch.no_grad():
        alone = ours(x, ours.keys(x, pos), q_positions=pos, kv_positions=pos)
        got = ours(padded, ours.keys(padded, ppos), q_positions=ppos, kv_positions=ppos)
    assert torch.equal(got.blocks[:, :, pad:], alone.blocks)
    assert torch.equal(torch.where(got.slots[:, :, pad:] >= 0, got.slots[:, :, pad:] - pad, -1), alone.slots)
    assert bool((got.blocks[:, :, :pad] == -1).all()), "padded queries pick nothing"


def test_bad_arguments_are_refused():
    kw = dict(index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
              rotary_dim=8)
    with pytest.raises(ValueError, match="do not fit"):
        MSAIndexer(32, **{**kw, "index_local_blocks": 3})
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        MSAIndexer(32, **{**kw, "rotary_dim": 10})
    with pytest.raises(ValueError, match="index_block_size must be an int >= 1"):
        MSAIndexer(32, **{**kw, "index_block_size": 0})
    idx = MSAIndexer(32, **kw)
    x, pos = torch.randn(1, 5, 32), torch.arange(5).view(1, 5)
    with pytest.raises(ValueError, match="keys must be"):
        idx(x, torch.randn(1, 5, 6), q_positions=pos, kv_positions=pos)
    with pytest.raises(ValueError, match="contiguous"):
        idx(x, idx.keys(x, pos), q_positions=pos, kv_positions=torch.tensor([[0, 2, 1, 3, 4]]))
