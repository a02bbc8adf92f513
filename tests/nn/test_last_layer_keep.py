"""``logits_to_keep``: a decoder's last layer stores every column's keys and values (or recurrent state) but
attends and runs its feed-forward for the kept columns only. What it returns equals the last columns of the full
forward, what it leaves in the cache equals the full forward's (the next steps agree), on every kind of layer
and cache; and the skipped work is really skipped (the last feed-forward sees the kept columns only)."""

from __future__ import annotations

import pytest
import torch

from qkv.cache import H2O, KVCache, Paged
from qkv.models.generate import generate
from qkv.nn import DecoderConfig, DecoderLM, LatentConfig, LinearAttentionConfig, get_config
from qkv.nn.moe import MoEConfig

_SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48)
_LIN = LinearAttentionConfig(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=8)
_LATENT = LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=8)
CONFIGS = {
    "tiny-llama": lambda: get_config("tiny-llama"),
    "tiny-mistral (window)": lambda: get_config("tiny-mistral"),
    "tiny-gemma (softcap, sandwich norms)": lambda: get_config("tiny-gemma"),
    "tiny-gpt (learned positions)": lambda: get_config("tiny-gpt"),
    "tiny-bloom (ALiBi)": lambda: get_config("tiny-bloom"),
    "gated attention last, recurrent first": lambda: DecoderConfig(
        **_SMALL, layer_types=("linear_attention", "full_attention"), linear_attention=_LIN, attn_output_gate=True,
        qk_norm=True),
    "recurrent last": lambda: DecoderConfig(**_SMALL, layer_types=("full_attention", "linear_attention"),
                                            linear_attention=_LIN),
    "latent (MLA)": lambda: DecoderConfig(**{**_SMALL, "num_key_value_heads": 4}, latent=_LATENT),
    "sinks + MoE": lambda: DecoderConfig(**_SMALL, attention_sinks=True, moe=MoEConfig(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1)),
    "OLMo-style QK norm over the projection": lambda: DecoderConfig(**_SMALL, qk_norm=True,
                                                                    qk_norm_scope="projection"),
}


def _model(name: str) -> DecoderLM:
    torch.manual_seed(sorted(CONFIGS).index(name))
    lm = DecoderLM(CONFIGS[name]()).double().eval()
    with torch.no_grad():  # away from init scale: gates, sinks and routers matter
        for p in lm.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return lm


def _ids(lm: DecoderLM, B: int = 2, N: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, lm.config.vocab_size, (B, N), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kept_logits_are_the_last_columns_of_the_full_forward(name):
    lm = _model(name)
    ids = _ids(lm)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on one row
    with torch.no_grad():
        full = lm(ids, mask).logits
        for keep in (1, 4, ids.shape[1], ids.shape[1] + 3):
            got = lm(ids, mask, logits_to_keep=keep).logits
            n = min(keep, ids.shape[1])
            assert got.shape == (2, n, lm.config.vocab_size)
            torch.testing.assert_close(got, full[:, -n:], rtol=0, atol=1e-11)


# H2O (eviction by observed attention) on the plain grouped-query configs; beside score modifiers it is refused
_H2O = [n for n in sorted(CONFIGS) if n.startswith(("tiny-llama", "tiny-mistral", "tiny-gpt", "sinks", "OLMo"))]


@pytest.mark.parametrize("name, storage", [(n, s) for n in sorted(CONFIGS) for s in ("dynamic", "paged")]
                         + [(n, "h2o") for n in _H2O])
def test_a_kept_prefill_leaves_the_cache_of_a_full_one(name, storage):
    """Prefill in two chunks with ``logits_to_keep=1``, then three decode steps: the logits of the full path."""
    lm = _model(name)
    ids = _ids(lm, N=13, seed=1)

    def cache():
        if storage == "paged":
            return KVCache(lm.cache_specs(), storage=Paged(block_size=4, num_blocks=32))
        return KVCache(lm.cache_specs(), policy=H2O(heavy=4, recent=4) if storage == "h2o" else None)

    logits = {}
    with torch.no_grad():
        for keep in (0, 1):
            c = cache()
            first = lm(ids[:, :6], cache=c, logits_to_keep=keep).logits[:, -1]
            second = lm(ids[:, 6:10], cache=c, logits_to_keep=keep).logits[:, -1]
            steps = [lm(ids[:, t:t + 1], cache=c).logits[:, -1] for t in range(10, 13)]
            logits[keep] = torch.stack([first, second, *steps], 1)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-11)


@pytest.mark.parametrize("name", ["tiny-llama", "recurrent last", "latent (MLA)"])
def test_the_last_feed_forward_sees_only_the_kept_columns(name):
    lm = _model(name)
    seen: list[tuple[int, ...]] = []
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
             for layer in lm.layers]
    try:
        with torch.no_grad():
            lm(_ids(lm, N=9), logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    d = lm.config.hidden_size
    assert seen == [(2, 9, d)] * (len(lm.layers) - 1) + [(2, 1, d)]


def test_greedy_generation_through_kept_prefills_equals_full_logits():
    """generate prefills with ``logits_to_keep=1``; its tokens are the argmax of full forwards, step by step."""
    lm = _model("tiny-llama")
    ids = _ids(lm, N=7, seed=3)
    out = generate(lm, ids, max_new_tokens=5)
    seq = ids
    with torch.no_grad():
        for _ in range(5):
            seq = torch.cat([seq, lm(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out.new_tokens, seq[:, 7:])
