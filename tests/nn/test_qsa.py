"""QSA, Qwen4-Exp's indexed attention (:mod:`qkv.nn.qsa`), against HF transformers' ``Qwen4ExpTextAttention`` in
float64 (HF's float32 islands, norms and softmax, lifted by ``tests/_hf.float64_throughout`` and its RoPE angles
given in float64, so HF's layer is a float64 oracle: relative error < 1e-10), against a
per-query loop of the selection rule, with left padding equal to each row alone, and bad inputs refused.
"""

from __future__ import annotations

import math

import pytest
import torch

from _hf import float64_throughout
from qkv.config import RopeParams
from qkv.config.qsa import QSAConfig
from qkv.nn import DecoderConfig, IndexedAttention
from qkv.nn.decoder import RopeTable, _ForwardContext
from qkv.nn.self_attention import SelfAttention
from qkv.pos.rope import RotaryEmbedding
from qkv.sparse.select import qsa_select

transformers = pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")
hf_mod = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

D_MODEL, HQ, HKV, D = 32, 4, 2, 8

# id -> (indexer heads, indexer head dim, budget, block, partial rotary factor, tokens)
CASES = {
    "Hi2-Di8-budget4-block2-rot0.5-N17": (2, 8, 4, 2, 0.5, 17),
    "Hi3-Di12-budget6-block3-rot1-N20": (3, 12, 6, 3, 1.0, 20),
    "Hi1-Di8-budget4-block4-rot0.5-N13": (1, 8, 4, 4, 0.5, 13),
}


def _exact_rms_forward(self, x):
    return (self._norm(x) * (1.0 + self.weight.to(x.dtype))).type_as(x)


@pytest.fixture
def exact_norms(monkeypatch):
    monkeypatch.setattr(hf_mod.Qwen4ExpTextRMSNorm, "forward", _exact_rms_forward)


def _pair(case: str, seed: int = 0):
    Hi, Di, budget, block, rot, _ = CASES[case]
    rope = {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": rot}
    hf_cfg = transformers.Qwen4ExpTextConfig(
        vocab_size=50, hidden_size=D_MODEL, num_hidden_layers=2, num_attention_heads=HQ, num_key_value_heads=HKV,
        head_dim=D, num_experts=2, num_experts_per_tok=1, hc_count=2, hc_lowrank=4, eos_token_id=1,
        indexer_n_heads=Hi, indexer_kv_heads=1, indexer_head_dim=Di, indexer_budget=budget,
        indexer_compress_ratio=block, rope_parameters=rope, layer_types=["linear_attention", "indexed_attention"])
    hf_cfg._attn_implementation = "eager"
    hf = hf_mod.Qwen4ExpTextAttention(hf_cfg, layer_idx=1).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 0.3 if "norm" in name else 1.0 / math.sqrt(p.shape[-1])
            p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    c = DecoderConfig(vocab_size=50, hidden_size=D_MODEL, num_hidden_layers=1, num_attention_heads=HQ,
                      num_key_value_heads=HKV, head_dim=D, intermediate_size=16, qk_norm=True, norm_offset=1.0,
                      attn_output_gate=True, rope={"full_attention": RopeParams(theta=1000.0,
                                                                                partial_rotary_factor=rot)},
                      qsa=QSAConfig(index_n_heads=Hi, index_head_dim=Di, budget=budget, block=block))
    table = RopeTable(RotaryEmbedding.from_params(c.rope_for("full_attention"), D, c.max_position_embeddings))
    table.reserve(64)
    ours = IndexedAttention.for_decoder(c, 0, table).double()
    sd = hf.state_dict()
    q, g = sd.pop("q_proj.weight").view(HQ, 2, D, D_MODEL).unbind(1)
    sd["qkv_proj.weight"] = torch.cat((q.reshape(-1, D_MODEL), sd.pop("k_proj.weight"), sd.pop("v_proj.weight"),
                                       g.reshape(-1, D_MODEL)))
    ours.load_state_dict(sd)
    return hf, ours, table, int(D * rot)


def _hf_forward(hf, rotary_dim, x, pad: int = 0):
    """HF's layer given float64 RoPE angles (HF's rotary module computes them in float32) and an eager mask."""
    B, N, _ = x.shape
    pos = (torch.arange(N) - pad).clamp_min(0)[None].expand(B, N)
    inv_freq = 1.0 / 1000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = pos[..., None].double() * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    allowed = torch.ones(N, N).tril().bool()
    allowed[:, :pad] = False
    mask = torch.zeros(B, 1, N, N, dtype=x.dtype).masked_fill(~allowed, torch.finfo(x.dtype).min)
    return hf(x, (cos, sin), attention_mask=mask)[0]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("case", list(CASES))
def test_qsa_layer_matches_hf_in_float64(case, exact_norms):
    hf, ours, _, rotary = _pair(case)
    N = CASES[case][-1]
    x = torch.randn(2, N, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        with float64_throughout():
            truth = _hf_forward(hf, rotary, x)
        got = ours(x, _ForwardContext(None, None, N, x.dtype))
        err = _rel(got, truth)
        assert err < 1e-10, f"{case}: relative error {err:.2e}"
        ours.backend = ours.decode_backend = "auto"  # the parent's dense attention: no key list for 'gather'
        dense = SelfAttention.forward(ours, x, _ForwardContext(None, None, N, x.dtype))
    assert _rel(dense, truth) > 1e-3, "the selection must matter at this length (else the test cannot fail)"


@pytest.mark.parametrize("case", list(CASES))
def test_qsa_left_padding_gives_the_row_alone(case):
    _, ours, _, _ = _pair(case)
    N, pad = CASES[case][-1], 3
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, N, D_MODEL, generator=gen, dtype=torch.float64)
    xp = torch.cat((torch.randn(1, pad, D_MODEL, generator=gen, dtype=torch.float64), x), 1)
    pos = torch.cat((torch.full((1, pad), -1), torch.arange(N)[None]), 1)
    with torch.no_grad():
        alone = ours(x, _ForwardContext(None, None, N, x.dtype))
        padded = ours(xp, _ForwardContext(pos, None, N + pad, x.dtype))
    assert _rel(padded[:, pad:], alone) < 1e-12


def _lists_by_loop(scores, block, block_topk):
    """The rule per query, written as HF states it: visible tokens 0 .. p, complete blocks, best ones, tail."""
    B, N, T = scores.shape
    out = []
    for b in range(B):
        rows = []
        for p in range(N):
            n_complete = (p + 1) // block
            kept = []
            if n_complete:
                order = sorted(range(n_complete), key=lambda t: (-scores[b, p, t].item(), t))[:block_topk]
                kept = [t * block + j for t in order for j in range(block)]
            kept += list(range(n_complete * block, p + 1))
            rows.append(kept)
        out.append(rows)
    return out


@pytest.mark.parametrize("block,block_topk", [(1, 3), (2, 2), (3, 1), (4, 5)], ids=lambda v: str(v))
def test_token_lists_follow_the_rule(block, block_topk):
    N = 19
    gen = torch.Generator().manual_seed(block * 10 + block_topk)
    scores = torch.randn(2, N, N // block, generator=gen).relu()  # ReLU zeros: ties, the earlier block wins
    pos = torch.arange(N)[None].expand(2, N)
    keys = torch.eye(N // block).expand(2, 1, N // block, N // block)  # one-hot block keys: q . k_t = score of t
    got = qsa_select(scores.unsqueeze(1), keys, budget=block_topk * block, block=block, q_positions=pos,
                     kv_positions=pos, scale=1.0)
    assert got.shape == (2, 1, N, block_topk * block + block - 1)
    want = _lists_by_loop(scores, block, block_topk)
    for b in range(2):
        for p in range(N):
            row = got[b, 0, p]
            assert row[row >= 0].tolist() == want[b][p], (b, p)


def test_qsa_config_and_layer_refuse_bad_inputs():
    with pytest.raises(ValueError, match="budget=5 must be a multiple of block=2"):
        QSAConfig(index_n_heads=2, index_head_dim=8, budget=5, block=2)
    with pytest.raises(ValueError, match="index_n_heads must be a positive int"):
        QSAConfig(index_n_heads=0, index_head_dim=8, budget=4, block=2)
    with pytest.raises(ValueError, match="rotary dim 8 must fit the indexer head"):
        DecoderConfig_ = DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                       head_dim=8, intermediate_size=16,
                                       qsa=QSAConfig(index_n_heads=2, index_head_dim=4, budget=4, block=2))
        IndexedAttention.for_decoder(DecoderConfig_, 0, RopeTable(RotaryEmbedding(8)))
    _, ours, _, _ = _pair(next(iter(CASES)))
    from qkv.cache import FullSpec, KVCache

    with pytest.raises(ValueError, match=r"layer 0 \(QSA\) caches its indexer key .* needs IndexedSpec"):
        ours(torch.zeros(1, 2, D_MODEL, dtype=torch.float64),
             _ForwardContext(torch.arange(2)[None], KVCache([FullSpec(HKV, D)]), 2, torch.float64))
