"""DeepSeek-V4 on qkv (qkv.models.family_deepseek_v4) against HF transformers' ``DeepseekV4ForCausalLM``.

The float64 reference is HF's own source with its float32 casts lifted to float64 (tests/_hf_float64.py: HF's V4
computes norms, rotary angles, mHC weights, compressor softmax and indexer scores in float32 even in a float64 model).
One tiny config exercises every layer kind (sliding only, CSA with an indexer keeping 3 of up to 7 entries, HCA),
hash-routed and score-routed MoE layers, mHC with 3 streams and a YaRN rotary on the compressed layers. The indexer
has 16 heads so that no two entries tie at the top-k boundary (checked). Checks: float64 logits equal HF's (relative
error < 1e-8), float32 within the error budget, a left-padded batch equal to each row alone, greedy generation of a
left-padded batch on qkv's multi-pool cache equal to HF's tokens of each row alone, cached decode equal to full
recomputation, the selection matters, bad configs refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import randomize_weights, within_budget
from _hf_float64 import float64_module
from qkv.cache import CompressedCache, KVCache
from qkv.models import CheckpointError, from_hf
from qkv.models.generate import generate

V4_CASTS = {".to(torch.float32)": 1, ".float()": 15, "dtype=torch.float32": 23, "dtype=torch.float)": 2}
N_PROMPT, N_PAD, N_NEW, VOCAB = 14, 4, 6, 96
FIELDS = dict(vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
              head_dim=16, q_lora_rank=12, n_routed_experts=6, num_experts_per_tok=2, o_groups=2, o_lora_rank=8,
              index_n_heads=16, index_head_dim=8, index_topk=3, sliding_window=5, partial_rotary_factor=0.5,
              hc_mult=3, hc_sinkhorn_iters=5, swiglu_limit=2.0, routed_scaling_factor=1.5,
              max_position_embeddings=64, rope_theta=10000.0, compress_rope_theta=40000.0,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
              compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
              layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                           "compressed_sparse_attention"],
              mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"])

_MODELS: dict[str, tuple] = {}


def _models():
    """(hf float32, hf float64 lifted, qkv float64, qkv float32), built once."""
    transformers = pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")
    if not _MODELS:
        cfg = transformers.DeepseekV4Config(**FIELDS)
        torch.manual_seed(0)
        hf = transformers.DeepseekV4ForCausalLM._from_config(cfg, attn_implementation="eager",
                                                              experts_implementation="eager").eval()
        randomize_weights(hf, 0)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("hc.scale") or name.endswith("hc_scale"):
                    p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            for layer in hf.model.layers:
                if layer.mlp.is_hash:
                    table = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(VOCAB)])
                    layer.mlp.gate.tid2eid.copy_(table)
        lifted = float64_module("deepseek_v4", V4_CASTS)
        ref = lifted.DeepseekV4ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="eager",
                                                        experts_implementation="eager").eval()
        ref.load_state_dict(hf.state_dict())
        ref = ref.double()
        for m in (hf, ref):
            m.generation_config.eos_token_id = None
            m.generation_config.pad_token_id = 0
        ours64 = from_hf(hf, dtype=torch.float64, optimize=False).eval()
        ours32 = from_hf(hf, optimize=False).eval()
        _MODELS["m"] = (hf, ref, ours64, ours32)
    return _MODELS["m"]


def _prompt(padded: bool):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (2, N_PROMPT), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :N_PAD], mask[1, :N_PAD] = 0, 0
    return ids, mask


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_float64_logits_equal_hf():
    hf, ref, ours64, ours32 = _models()
    ids, _ = _prompt(False)
    with torch.no_grad():
        truth = ref(ids).logits
        rel = _rel(ours64(ids).logits, truth)
        assert rel < 1e-8, f"float64 logits: relative error {rel:.3g}"
        assert truth.std() > 0.5, "logits must be O(1) for the comparison to mean anything"
        within_budget(ours32(ids).logits, truth, hf(ids).logits, what="float32 prefill logits")
        kept = ours64(ids, logits_to_keep=3).logits
        assert _rel(kept, truth[:, -3:]) < 1e-8


def test_left_padded_rows_equal_each_row_alone():
    _, ref, ours64, _ = _models()
    ids, mask = _prompt(True)
    real = mask.bool()
    with torch.no_grad():
        ours = ours64(ids, attention_mask=mask).logits
        truth = torch.cat([ref(ids[b, real[b]][None]).logits[0] for b in range(2)])
    rel = _rel(ours[real], truth)
    assert rel < 1e-8, f"left-padded logits: relative error {rel:.3g}"


def test_greedy_generation_with_left_padding_equals_hf_tokens():
    """qkv: the padded batch through qkv.models.generate on a CompressedCache; HF: each row alone."""
    _, ref, ours64, _ = _models()
    ids, mask = _prompt(True)
    real = mask.bool()
    with torch.no_grad():
        expected = [ref.generate(ids[b, real[b]][None], max_new_tokens=N_NEW, do_sample=False)[0, -N_NEW:]
                    for b in range(2)]
        out = generate(ours64, ids, max_new_tokens=N_NEW, attention_mask=mask,
                       cache=CompressedCache(ours64.cache_specs()))
    assert out.new_tokens.tolist() == torch.stack(expected).tolist()


def test_hf_route_equals_eager(monkeypatch):
    """HF's own V4 (the float64 lifted source) with ``attn_implementation="qkv"``: the "qkv" mask function hands V4
    eager's additive mask, which each compressed layer extends with its block bias (compressed-causal visibility and
    the indexer's selection), so the logits equal eager's (< 1e-8 on the unpadded batch and on each left-padded
    row's real tokens) and greedy tokens of a padded row equal eager's. Poisoned: handing V4 qkv's mask object, every
    compressed entry becomes visible and the logits move."""
    qhf = pytest.importorskip("qkv.integrations.transformers")
    _, ref, _, _ = _models()
    cand = qhf.use(copy.deepcopy(ref))
    ids, mask = _prompt(True)
    real = mask.bool()
    with torch.no_grad():
        truth = ref(ids[:1]).logits
        assert _rel(cand(ids[:1]).logits, truth) < 1e-8
        got = cand(ids, attention_mask=mask).logits
        rel = _rel(got[real], ref(ids, attention_mask=mask).logits[real])
        assert rel < 1e-8, f"attn_implementation='qkv' padded logits: relative error {rel:.3g}"
        row = ids[1, real[1]][None]
        want = ref.generate(row, max_new_tokens=N_NEW, do_sample=False)
        assert torch.equal(cand.generate(row, max_new_tokens=N_NEW, do_sample=False), want)
        reports = qhf.explain(cand, ids, attention_mask=mask)
        assert len(reports) == FIELDS["num_hidden_layers"]
        monkeypatch.setattr(qhf, "TENSOR_MASK_MODELS", frozenset())
        wrong = cand(ids[:1]).logits
    assert _rel(wrong, truth) > 1e-3, "the poisoned route must differ: the test would not catch it"


@pytest.mark.parametrize("steps", [(1,) * 8, (3, 1, 4)], ids=["one-by-one", "pieces"])
def test_cached_decode_equals_full_recompute(steps):
    """A left-padded prefill of 6 columns, then 8 more tokens in the given steps: every step's logits equal the full
    recomputation's (float64, < 1e-10), across window, CSA entry (rate 2) and HCA entry (rate 4) completions."""
    _, _, ours64, _ = _models()
    ids, mask = _prompt(True)
    with torch.no_grad():
        full = ours64(ids, attention_mask=mask).logits
        cache = CompressedCache(ours64.cache_specs())
        got = [ours64(ids[:, :6], attention_mask=mask[:, :6], cache=cache).logits]
        start = 6
        for n in steps:
            got.append(ours64(ids[:, start:start + n], attention_mask=mask[:, :start + n], cache=cache).logits)
            start += n
    got = torch.cat(got, 1)
    real = mask.bool()
    rel = _rel(got[real], full[real])
    assert rel < 1e-10, f"cached decode vs full recompute: relative error {rel:.3g}"
    assert cache.seq_length == N_PROMPT


def test_the_indexer_selection_matters_and_has_no_boundary_tie():
    _, _, ours64, _ = _models()
    ids, _ = _prompt(False)
    scores = []

    def hook(mod, args, out):
        scores.append(out)

    layer = ours64.layers[1].self_attn
    handle = layer.compressor.indexer.weights_proj.register_forward_hook(hook)
    try:
        with torch.no_grad():
            base = ours64(ids).logits
            every = copy.deepcopy(ours64)
            for lay in every.layers:
                lay.self_attn.topk = 64
            gap = (every(ids).logits - base).abs().max()
    finally:
        handle.remove()
    assert gap > 1e-2, f"attending to every entry changes the logits by only {gap:.3g}"
    sel = layer._select(torch.zeros(1, 8, 32, dtype=torch.float64), torch.zeros(1, 8, 12, dtype=torch.float64),
                        *layer._cos_sin(torch.arange(8), torch.float64), torch.zeros(1, 4, 8, dtype=torch.float64),
                        torch.arange(8))
    assert sel.shape == (1, 1, 8, 3) and int(sel[0, 0, 0].max()) == -1  # position 0 sees no complete entry


def test_bad_inputs_refused():
    hf, _, ours64, _ = _models()
    base = hf.config.to_dict()
    bad = {"scoring_func": "softmax", "num_key_value_heads": 2, "o_groups": 3, "hidden_act": "gelu",
           "compress_rates": {"compressed_sparse_attention": 0, "heavily_compressed_attention": 4},
           "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    from qkv.models.family_deepseek_v4 import decoder_config

    for key, value in bad.items():
        with pytest.raises(CheckpointError, match=key if key != "layer_types" else "layer_types must list"):
            decoder_config({**base, key: value})
    with pytest.raises(CheckpointError, match="is not deepseek_v4"):
        decoder_config({**base, "model_type": "deepseek_v3"})
    ids, _ = _prompt(False)
    with pytest.raises(ValueError, match="CompressedSpec .*planned"):
        KVCache(ours64.cache_specs())
    with pytest.raises(ValueError, match="keeps its pools in a qkv.cache.CompressedCache"):
        ours64(ids, cache=KVCache([]))
    with pytest.raises(ValueError, match="continue its positions from 14"):
        cache = CompressedCache(ours64.cache_specs())
        ours64(ids, cache=cache)
        ours64(ids[:, :1], positions=torch.tensor([[20], [20]]), cache=cache)
    with pytest.raises(ValueError, match="CompressedSpec or a one-head SlidingWindowSpec"):
        CompressedCache([])
    with pytest.raises(ValueError, match="continue its positions from 0"):
        ours64(ids, positions=torch.arange(3, 3 + N_PROMPT))


#: DeepSeek-V4-Pro's published shape where it differs from HF's DeepseekV4Config defaults (which are V4-Flash's):
#: 61 layers of width 7168, 128 heads, q_lora_rank 1536, 384 experts of 3072, 16 output groups, index_topk 1024
#: (DeepSeek-AI 2026, DeepSeek-V4 report; model card deepseek-ai/DeepSeek-V4-Pro).
PRO = dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, n_routed_experts=384,
           moe_intermediate_size=3072, o_groups=16, index_topk=1024)


@pytest.mark.slow
@pytest.mark.parametrize("name,fields,total,active", [("V4-Flash", {}, 284e9, 13e9), ("V4-Pro", PRO, 1.6e12, 49e9)])
def test_published_sizes_and_kv_bytes(name, fields, total, active):
    """Parameters of the model qkv builds (on the meta device) against the published totals (V4-Flash 284B with 13B
    active, V4-Pro 1.6T with 49B; qkv builds no multi-token-prediction module, about 1.6% of Pro), and the cache
    bytes per token at 1M tokens against DeepSeek-V3.2's (the report: about 10% for Pro)."""
    transformers = pytest.importorskip("transformers")
    from qkv.cache.describe import cache_specs_of
    from qkv.models.family_deepseek_v4 import decoder_config
    from qkv.nn import DecoderLM

    c = decoder_config(transformers.DeepseekV4Config(**fields).to_dict())
    with torch.device("meta"):
        lm = DecoderLM(c)
    n = sum(p.numel() for p in lm.parameters())
    m = c.moe
    expert = 3 * c.hidden_size * m.moe_intermediate_size
    act = n - c.num_hidden_layers * (m.n_routed_experts - m.num_experts_per_tok) * expert - c.vocab_size * c.hidden_size
    assert abs(n / total - 1) < 0.02 and abs(act / active - 1) < 0.03, f"{name}: {n / 1e9:.1f}B ({act / 1e9:.2f}B)"
    per_token = sum(s.bytes_for(1 << 20, "bfloat16") for s in cache_specs_of(c)) / (1 << 20)
    v32 = 61 * (512 + 64 + 128) * 2  # DeepSeek-V3.2: a 576-wide latent and a 128-wide indexer key per layer
    if name == "V4-Pro":
        assert 0.08 < per_token / v32 < 0.13, f"{name}: {per_token:.0f} bytes/token, {per_token / v32:.3f} of V3.2"



def test_head_gate_scales_each_head():
    _, _, ours64, _ = _models()
    ids, _ = _prompt(False)
    layer = ours64.layers[2].self_attn
    with torch.no_grad():
        base = ours64(ids).logits
        try:
            layer.head_gate = torch.ones(4, dtype=torch.float64)
            same = ours64(ids).logits
            layer.head_gate = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
            pruned = ours64(ids).logits
        finally:
            layer.head_gate = None
    assert torch.equal(same, base) and (pruned - base).abs().max() > 1e-3


def test_float64_gradients_equal_hf():
    """Weight gradients of a random linear function of the logits, qkv float64 against HF's lifted float64, through
    the window and compressed attention, the compressors, mHC and the experts (rel err < 1e-8)."""
    _, ref, ours64, _ = _models()
    ref, ours = copy.deepcopy(ref), copy.deepcopy(ours64)
    ids, _ = _prompt(False)
    w = torch.randn(2, N_PROMPT, VOCAB, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for m in (ref, ours):
        (m(ids).logits * w).sum().backward()
    theirs, mine = dict(ref.named_parameters()), dict(ours.named_parameters())
    pairs = {"layers.1.self_attn.q_a_proj.weight": "model.layers.1.self_attn.q_a_proj.weight",
             "layers.2.self_attn.compressor.kv_proj.weight": "model.layers.2.self_attn.compressor.kv_proj.weight",
             "layers.3.self_attn.compressor.gate_proj.weight": "model.layers.3.self_attn.compressor.gate_proj.weight",
             "layers.1.self_attn.sinks": "model.layers.1.self_attn.sinks",
             "layers.3.attn_residual.fn": "model.layers.3.attn_hc.fn", "residual.fn": "model.hc_head.hc_fn",
             "layers.0.mlp.experts.gate_up_proj": "model.layers.0.mlp.experts.gate_up_proj",
             "embed_tokens.weight": "model.embed_tokens.weight"}
    for ours_name, hf_name in pairs.items():
        g, want = mine[ours_name].grad, theirs[hf_name].grad
        assert want is not None and want.abs().max() > 0, hf_name
        rel = _rel(g, want)
        assert rel < 1e-8, f"d{ours_name}: relative error {rel:.3g}"
