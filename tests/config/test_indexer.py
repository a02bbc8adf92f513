"""DeepSeek Sparse Attention's indexer as data: ``IndexerConfig``, ``read_indexer`` (the one HF reader),
``indexed_attention`` layers read as full attention, ``DecoderConfig(indexer=...)`` and their refusals."""

from __future__ import annotations

import pytest

from qkv.config import DecoderConfig, LatentConfig, read_layout
from qkv.config.dsa import IndexerConfig
from qkv.config.hf_config import read_indexer

_V32 = {"model_type": "deepseek_v32", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
        "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "layer_types": ["indexed_attention"] * 2}
_LATENT = LatentConfig(hidden_size=64, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=16)


def _decoder(**kw) -> DecoderConfig:
    return DecoderConfig(vocab_size=10, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=32, **kw)


def test_read_indexer_takes_the_config_and_hf_defaults():
    assert read_indexer({**_V32, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 5}) == IndexerConfig(
        index_n_heads=2, index_head_dim=16, index_topk=5)
    assert read_indexer(_V32) == IndexerConfig(index_n_heads=64, index_head_dim=128, index_topk=2048)
    assert read_indexer({**_V32, "model_type": "deepseek_v3"}) is None


def test_indexed_attention_layers_read_as_full_attention_with_the_indexer_key():
    layout = read_layout({**_V32, "index_head_dim": 32})
    assert layout.layer_types == ("full_attention",) * 2 and layout.sliding_window is None
    assert layout.indexer.index_head_dim == 32 and layout.latent.kv_lora_rank == 16
    assert read_layout({**_V32, "model_type": "deepseek_v3", "layer_types": None}).indexer is None


def test_decoder_config_carries_the_indexer():
    cfg = _decoder(latent=_LATENT, indexer=IndexerConfig(index_n_heads=2, index_head_dim=16, index_topk=5))
    assert cfg.replace(name="x").indexer == cfg.indexer


@pytest.mark.parametrize("fields, error, match", [
    (dict(index_n_heads=0), ValueError, "index_n_heads must be a positive int"),
    (dict(index_topk=True), ValueError, "index_topk must be a positive int"),
    (dict(index_head_dim=2.0), ValueError, "index_head_dim must be a positive int"),
], ids=["heads-0", "topk-bool", "dim-float"])
def test_indexer_config_refuses_bad_values(fields, error, match):
    with pytest.raises(error, match=match):
        IndexerConfig(**{"index_n_heads": 2, "index_head_dim": 16, "index_topk": 5, **fields})


def test_bad_indexers_are_refused():
    ok = IndexerConfig(index_n_heads=2, index_head_dim=16, index_topk=5)
    with pytest.raises(ValueError, match="missing index_topk"):
        read_indexer({**_V32, "model_type": "other", "index_n_heads": 2, "index_head_dim": 16})
    with pytest.raises(TypeError, match="indexer must be a qkv.config.dsa.IndexerConfig"):
        _decoder(latent=_LATENT, indexer={"index_n_heads": 2, "index_head_dim": 16, "index_topk": 5})
    with pytest.raises(ValueError, match="needs latent with a q_lora_rank"):
        _decoder(indexer=ok)
    no_q_lora = LatentConfig(hidden_size=64, num_attention_heads=4, kv_lora_rank=16, qk_rope_head_dim=8)
    with pytest.raises(ValueError, match="needs latent with a q_lora_rank"):
        _decoder(latent=no_q_lora, indexer=ok)
    with pytest.raises(ValueError, match="index_head_dim >= its qk_rope_head_dim"):
        _decoder(latent=_LATENT, indexer=IndexerConfig(index_n_heads=2, index_head_dim=4, index_topk=5))
