"""The HF reader never ignores a layout field it does not model (issue 29 item 21): a Llama 4 config as the hub
ships it (``attention_chunk_size``, ``no_rope_layers``, no ``layer_types``) used to read as 48 global layers
(25.77 GB at 128K instead of about 7.6 GB); now it, and every other such field, is refused with a message
naming the field and what it means, by every entry point that reads a config."""

from __future__ import annotations

import json

import pytest

from qkv.config.hf_config import UNREAD_LAYOUT_FIELDS, read_layout

_LLAMA4_TEXT = dict(model_type="llama4_text", num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                    head_dim=128, hidden_size=5120, vocab_size=202048, intermediate_size=8192,
                    rope_theta=500000.0, max_position_embeddings=10485760)
#: meta-llama/Llama-4-Scout-17B-16E-Instruct's config.json layout fields (abridged): multimodal, text_config
#: with a chunk size and NoPE every 4th layer, no layer_types.
LLAMA4_HUB = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
              "text_config": {**_LLAMA4_TEXT, "attention_chunk_size": 8192,
                              "no_rope_layers": [1, 1, 1, 0] * 12}}


def test_llama4_hub_config_is_refused_not_read_as_global_layers():
    with pytest.raises(ValueError, match=r"attention_chunk_size=8192 sets chunked attention.*refused"):
        read_layout(LLAMA4_HUB)


@pytest.mark.parametrize("case", ["chunk-key-absent", "nope-layers-only", "nope-by-default"])
def test_llama4_variants(case):
    """HF's Llama4TextConfig defaults attention_chunk_size to 8192 and NoPE to every 4th layer: leaving the keys
    out does not make a config plain."""
    text = {"chunk-key-absent": {**_LLAMA4_TEXT, "no_rope_layers": [1, 1, 1, 0] * 12},
            "nope-layers-only": {**_LLAMA4_TEXT, "attention_chunk_size": None, "no_rope_layers": [1, 1, 1, 0] * 12},
            "nope-by-default": {**_LLAMA4_TEXT, "attention_chunk_size": None}}[case]
    with pytest.raises(ValueError, match="attention_chunk_size|no_rope_layers"):
        read_layout(text)


def test_rope_on_every_layer_and_no_chunks_reads_plain():
    layout = read_layout({**_LLAMA4_TEXT, "attention_chunk_size": None, "no_rope_layers": [1] * 48})
    assert layout.layer_types == ("full_attention",) * 48


@pytest.mark.parametrize("key,value", [("attention_layers", ["global", "local"]), ("attention_window", [256, 256]),
                                       ("global_attn_every_n_layers", 3), ("attention_chunk_size", 128)])
def test_other_unread_layout_fields_are_refused(key, value):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, key: value}
    with pytest.raises(ValueError, match=f"{key}=.*{UNREAD_LAYOUT_FIELDS[key].split(' ')[0]}"):
        read_layout(cfg)


def test_chunked_layer_type_is_named():
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
           "layer_types": ["chunked_attention", "full_attention"]}
    with pytest.raises(ValueError, match=r"\['chunked_attention'\] \(Llama 4's chunked attention\) not supported"):
        read_layout(cfg)


def test_every_entry_point_refuses(tmp_path):
    from typer.testing import CliRunner

    from qkv.cache import plan_memory
    from qkv.cli import _register, app
    from qkv.costs import get_preset, kv_cache_memory, preset_from_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA4_HUB))
    for call in (lambda: preset_from_hf_config(LLAMA4_HUB), lambda: get_preset(path),
                 lambda: plan_memory(LLAMA4_HUB, context=128), lambda: plan_memory(str(path), context=128),
                 lambda: kv_cache_memory(preset_from_hf_config(path), context=128)):
        with pytest.raises(ValueError, match="attention_chunk_size"):
            call()
    _register()
    result = CliRunner().invoke(app, ["memory", str(path), "--context", "128k"])
    assert result.exit_code == 2 and "attention_chunk_size=8192" in result.output, result.output


def test_from_hf_refuses_a_chunked_llama_config():
    from qkv.models.hf import decoder_config
    from qkv.models.loading import CheckpointError

    cfg = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "attention_chunk_size": 16}
    with pytest.raises(CheckpointError, match="attention_chunk_size=16"):
        decoder_config(cfg)


def test_transformers_llama4_config_is_refused():
    """The premise checked against transformers: HF itself makes those layers chunked."""
    transformers = pytest.importorskip("transformers", reason="checks HF's own Llama 4 layer types")
    text = transformers.Llama4TextConfig(num_hidden_layers=8)
    assert "chunked_attention" in text.layer_types
    with pytest.raises(ValueError, match="chunked"):
        read_layout(text)
    with pytest.raises(ValueError, match="chunked"):
        read_layout(transformers.Llama4Config(text_config={"num_hidden_layers": 4}).to_dict())


def test_the_reader_returns_the_one_description():
    """read_layout gives a DecoderConfig (no second layout type); what the config does not state stays None, and a
    model refuses such an attention-only description, naming the fields to give."""
    import torch

    from qkv.config import DecoderConfig
    from qkv.nn import DecoderLM

    base = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    attention_only = read_layout(base)
    assert isinstance(attention_only, DecoderConfig) and attention_only.attention_only
    assert (attention_only.vocab_size, attention_only.intermediate_size, attention_only.name) == (None, None, "llama")
    with pytest.raises(ValueError, match=r"DecoderLM: llama describes the attention layout only \(vocab_size=None"):
        DecoderLM(attention_only)
    whole = read_layout({**base, "vocab_size": 32, "intermediate_size": 96})
    assert not whole.attention_only
    assert DecoderLM(whole)(torch.zeros(1, 3, dtype=torch.long)).logits.shape == (1, 3, 32)
    assert read_layout({"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64}).position == "learned"
    with pytest.raises(ValueError, match=r"vocab_size must be a positive int, got 0"):
        read_layout({**base, "vocab_size": 0})
