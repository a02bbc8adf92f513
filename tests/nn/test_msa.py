"""qkv.nn.MSAIndexer (MiniMax-M3's sparse-attention indexer) against HF transformers' ``MiniMaxM3VLIndexer`` in
float64 with the same random weights (HF's source with its float32 casts lifted, tests/_hf_float64.py, so its norms
and rotary table are float64 too): the same indexer keys to float64 rounding and the same blocks per KV group for a
prefill, a chunk and a decode step over a history; a left-padded row picks what it picks alone (blocks anchored to
positions); bad arguments refused."""

from __future__ import annotations

import math

import pytest
import torch

from _hf_float64 import float64_module
from qkv.nn.msa import MSAIndexer
from qkv.nn.self_attention import SelfAttention

F64 = torch.float64
M3_CASTS = {".float()": 9, "dtype=torch.float32": 5, "dtype=torch.float)": 4}


def _rows(idx):
    return [[[sorted({int(v) for v in r if v >= 0}) for r in h] for h in b] for b in idx]


def _pair(Di, R, seed):
    transformers = pytest.importorskip("transformers")
    hf = float64_module("minimax_m3_vl", M3_CASTS)

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
    err = (keys - layer.idx_keys.squeeze(1)).abs().max().item()
    assert err < 1e-12, f"the cached indexer keys differ by {err:.3g}"
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


# The MSA layer (qkv.nn.msa.BlockSparseAttention) against HF's MiniMaxM3VLAttention: id -> (Di, rot, block,
# topk_blocks, local_blocks, tokens)
LAYER_CASES = {
    "Di16-rot0.5-block4-top3-local1-N22": (16, 0.5, 4, 3, 1, 22),
    "Di12-rot0.75-block3-top2-local2-N17": (12, 0.75, 3, 2, 2, 17),
}
HQ, HKV, HD, DM = 4, 2, 16, 32


def _layer_pair(case: str, seed: int = 0):
    from qkv.config import RopeParams
    from qkv.config.msa import MSAConfig
    from qkv.nn import DecoderConfig
    from qkv.nn.decoder import RopeTable
    from qkv.nn.msa import BlockSparseAttention
    from qkv.pos.rope import RotaryEmbedding

    transformers = pytest.importorskip("transformers")
    hf = float64_module("minimax_m3_vl", M3_CASTS)
    Di, rot, block, top, local, _ = LAYER_CASES[case]
    cfg = transformers.MiniMaxM3VLTextConfig(
        hidden_size=DM, num_hidden_layers=1, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=HD,
        index_n_heads=HKV, index_head_dim=Di, index_block_size=block, index_topk_blocks=top,
        index_local_blocks=local, vocab_size=64, layer_types=["minimax_m3_sparse"], rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": rot})
    cfg._attn_implementation = "eager"
    theirs = hf.MiniMaxM3VLAttention(cfg, 0).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            scale = 0.3 if "norm" in name else 1 / math.sqrt(p.shape[-1])
            p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=F64))
    c = DecoderConfig(vocab_size=64, hidden_size=DM, num_hidden_layers=1, num_attention_heads=HQ,
                      num_key_value_heads=HKV, head_dim=HD, intermediate_size=16, qk_norm=True, norm_offset=1.0,
                      rms_norm_eps=1e-6, rope={"full_attention": RopeParams(theta=1000.0, partial_rotary_factor=rot)},
                      msa=MSAConfig(index_n_heads=HKV, index_head_dim=Di, block=block, topk_blocks=top,
                                    local_blocks=local, layers=(0,)))
    table = RopeTable(RotaryEmbedding.from_params(c.rope_for("full_attention"), HD, c.max_position_embeddings))
    table.reserve(64)
    ours = BlockSparseAttention.for_decoder(c, 0, table).double()
    sd = theirs.state_dict()
    sd["qkv_proj.weight"] = torch.cat([sd.pop(f"{n}_proj.weight") for n in "qkv"])
    ours.load_state_dict(sd)
    return hf, theirs, ours, hf.MiniMaxM3VLRotaryEmbedding(cfg)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_msa_layer_matches_hf_in_float64(case):
    """Float64 throughout (HF's float32 casts lifted): relative error < 1e-10; attending every key instead moves
    the output (the selection matters, so the test can fail)."""
    from qkv.nn.decoder import _ForwardContext

    _, theirs, ours, rotary = _layer_pair(case)
    N = LAYER_CASES[case][-1]
    x = torch.randn(2, N, DM, generator=torch.Generator().manual_seed(1), dtype=F64)
    pos = torch.arange(N).expand(2, N)
    causal = torch.zeros(2, 1, N, N, dtype=F64).masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(),
                                                             torch.finfo(F64).min)
    with torch.no_grad():
        truth = theirs(x, rotary(x, pos), causal, position_ids=pos)[0]
        got = ours(x, _ForwardContext(None, None, N, F64))
        ours.backend = "auto"  # every key, on any backend
        dense = SelfAttention.forward(ours, x, _ForwardContext(None, None, N, F64))
    assert _rel(got, truth) < 1e-10, f"{case}: relative error {_rel(got, truth):.2e}"
    assert _rel(dense, truth) > 1e-3, "the selection must matter at this length (else the test cannot fail)"


def test_msa_layer_left_padding_gives_the_row_alone():
    from qkv.nn.decoder import _ForwardContext

    _, _, ours, _ = _layer_pair(next(iter(LAYER_CASES)))
    N, pad = 19, 3
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, N, DM, generator=gen, dtype=F64)
    xp = torch.cat((torch.randn(1, pad, DM, generator=gen, dtype=F64), x), 1)
    pos = torch.cat((torch.full((1, pad), -1), torch.arange(N)[None]), 1)
    with torch.no_grad():
        alone = ours(x, _ForwardContext(None, None, N, F64))
        padded = ours(xp, _ForwardContext(pos, None, N + pad, F64))
    assert _rel(padded[:, pad:], alone) < 1e-12


def test_msa_config_and_layer_refuse_bad_inputs():
    from qkv.cache import FullSpec, KVCache
    from qkv.config.msa import MSAConfig
    from qkv.nn import DecoderConfig
    from qkv.nn.decoder import _ForwardContext

    kw = dict(index_n_heads=2, index_head_dim=8, block=4, topk_blocks=2, local_blocks=1, layers=(0,))
    with pytest.raises(ValueError, match="local_blocks=3 forced blocks do not fit"):
        MSAConfig(**{**kw, "local_blocks": 3})
    with pytest.raises(ValueError, match="block must be an int >= 1"):
        MSAConfig(**{**kw, "block": 0})
    with pytest.raises(ValueError, match="layers must be layer indices"):
        MSAConfig(**{**kw, "layers": (-1,)})
    base = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=16)
    with pytest.raises(ValueError, match=r"one indexer head per KV head \(num_key_value_heads=1\)"):
        DecoderConfig(**{**base, "num_key_value_heads": 1}, msa=MSAConfig(**kw))
    with pytest.raises(ValueError, match="msa"):
        DecoderConfig(**base, msa=MSAConfig(**{**kw, "layers": (2,)}))
    with pytest.raises(ValueError, match="rotary dim 8 must fit the indexer head"):
        from qkv.nn.decoder import RopeTable
        from qkv.nn.msa import BlockSparseAttention
        from qkv.pos.rope import RotaryEmbedding

        c = DecoderConfig(**base, msa=MSAConfig(**{**kw, "index_head_dim": 4}))
        BlockSparseAttention.for_decoder(c, 0, RopeTable(RotaryEmbedding(8)))
    _, _, ours, _ = _layer_pair(next(iter(LAYER_CASES)))
    with pytest.raises(ValueError, match=r"layer 0 \(MSA\) caches its indexer key .* needs IndexedSpec"):
        ours(torch.zeros(1, 2, DM, dtype=F64), _ForwardContext(torch.arange(2)[None], KVCache([FullSpec(HKV, HD)]),
                                                                 2, F64))
