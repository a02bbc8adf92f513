"""Issue 29: silent or unclear answers of the state, distributed, integration and CLI layers, one test per item."""

import pytest
import torch

from qkv.cache import FullSpec, KVCache


def _tiny_lm(layers):
    from qkv.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48)).eval()


def test_cache_with_fewer_layers_than_the_model_is_a_value_error_naming_the_fix():
    lm = _tiny_lm(3)
    cache = KVCache(lm.cache_specs()[:2])
    with pytest.raises(ValueError, match=r"cache of 2 layers.*KVCache\(model\)"):
        lm(torch.zeros(1, 4, dtype=torch.long), cache=cache)


def test_fork_refuses_zero_and_negative_copies_and_keeps_the_rows():
    cache = KVCache([FullSpec(2, 8)])
    cache.update(0, torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), positions=torch.arange(3).expand(2, 3))
    for n in (0, -1):
        with pytest.raises(ValueError, match=r"fork\(n\)"):
            cache.fork(n)
        assert cache.batch == 2 and cache.seq_length == 3
