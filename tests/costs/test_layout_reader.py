"""qkv.config.hf_config.read_layout, the one reader of an HF config's attention layout: its layer types equal HF's
own ``config.layer_types`` for raw ``config.json`` dicts with and without them, and the model ``from_hf``
builds, ``qkv.costs.kv_cache_memory`` and ``qkv.cache.plan_memory`` count the same KV-cache bytes."""

from __future__ import annotations

import doctest
import json

import pytest
import torch

from _hf import OptionalModule
from qkv.config import hf_config as layout_module
from qkv.config.hf_config import FULL_ATTENTION, SLIDING_ATTENTION, read_layout
from qkv.costs import kv_cache_memory, preset_from_hf_config

transformers = OptionalModule("transformers")

_BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)

# raw config.json dicts, as published checkpoints ship them (no layer_types)
RAW = {
    "qwen2-window-from-layer2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=6,
                                     max_window_layers=2),
    "qwen2-use_sliding_window-false": dict(model_type="qwen2", use_sliding_window=False, sliding_window=6,
                                           max_window_layers=2),
    "qwen2-use_sliding_window-absent": dict(model_type="qwen2", sliding_window=6, max_window_layers=2),
    "qwen2-max_window_layers-default": dict(model_type="qwen2", use_sliding_window=True, sliding_window=6),
    "mistral-window": dict(model_type="mistral", sliding_window=6),
    "mistral-window-null": dict(model_type="mistral", sliding_window=None),
    "mistral-window-absent": dict(model_type="mistral"),
    "gemma2": dict(model_type="gemma2", head_dim=8, sliding_window=6),
    "gemma3-pattern3": dict(model_type="gemma3_text", head_dim=8, sliding_window=6, sliding_window_pattern=3),
    "gemma3-default-pattern": dict(model_type="gemma3_text", head_dim=8, sliding_window=6,
                                   num_hidden_layers=7),
    "llama": dict(model_type="llama"),
}


def _hf_config(raw: dict):
    cfg = {**_BASE, **raw}
    return transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def _hf_layer_types(hf) -> tuple[str, ...]:
    """HF's own answer: ``config.layer_types``; Mistral and Llama have none, and slide every layer exactly
    when ``sliding_window`` is set (Mistral) or never (Llama)."""
    types = getattr(hf, "layer_types", None)
    if types is not None:
        return tuple(types)
    window = getattr(hf, "sliding_window", None) if hf.model_type == "mistral" else None
    return ((SLIDING_ATTENTION if window else FULL_ATTENTION),) * hf.num_hidden_layers


@pytest.mark.parametrize("case", list(RAW))
def test_layer_types_equal_hf(case):
    hf = _hf_config(RAW[case])
    want = _hf_layer_types(hf)
    raw = read_layout({**_BASE, **RAW[case]})
    full = read_layout(hf.to_dict())  # transformers' own dict, layer_types included where HF has them
    assert raw.layer_types == want, f"{case}: raw config.json {raw.layer_types} != HF {want}"
    assert full.layer_types == want, f"{case}: config.to_dict() {full.layer_types} != HF {want}"
    hf_window = hf.sliding_window if SLIDING_ATTENTION in want else None
    assert raw.sliding_window == full.sliding_window == hf_window
    hf_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert raw.head_dim == full.head_dim == hf_head_dim, (raw.head_dim, full.head_dim, hf_head_dim)


def test_qwen2_layer_pattern_cases():
    four = {**_BASE, "model_type": "qwen2", "sliding_window": 6}
    assert read_layout({**four, "use_sliding_window": True, "max_window_layers": 2}).layer_types == (
        FULL_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_ATTENTION)
    assert read_layout(four).layer_types == (FULL_ATTENTION,) * 4  # use_sliding_window absent: HF default false
    assert preset_from_hf_config(four).layer_counts == {"global": 4}


def test_multimodal_text_config_and_defaults():
    outer = {"model_type": "gemma3", "text_config": {**_BASE, "model_type": "gemma3_text", "sliding_window": 6,
                                                      "num_hidden_layers": 6}}
    lay = read_layout(outer)
    assert lay.layer_types == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)  # HF default pattern 6
    assert lay.head_dim == 256  # Gemma's HF default head_dim, not hidden_size // heads
    assert lay.rope[SLIDING_ATTENTION].theta == 10_000.0 and lay.rope[FULL_ATTENTION].theta == 1_000_000.0
    gpt2 = read_layout({"model_type": "gpt2", "n_layer": 3, "n_head": 4, "n_embd": 64})
    assert (gpt2.num_hidden_layers, gpt2.head_dim, gpt2.layer_types) == (3, 16, (FULL_ATTENTION,) * 3)


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="missing num_attention_heads"):
        read_layout({"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="layer types"):
        read_layout({**_BASE, "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        read_layout({**_BASE, "layer_types": [FULL_ATTENTION] * 3})
    with pytest.raises(ValueError, match="positive sliding_window"):
        read_layout({**_BASE, "layer_types": [SLIDING_ATTENTION] * 4})
    with pytest.raises(TypeError, match="config.json path"):
        read_layout(42)


MODELS = ["qwen2-window-from-layer2", "qwen2-use_sliding_window-absent", "mistral-window", "gemma2",
          "gemma3-pattern3"]


@pytest.mark.parametrize("case", MODELS)
def test_model_specs_costs_and_plan_agree(case, tmp_path):
    """A checkpoint whose config.json is the raw dict: the model from_hf builds caches exactly the bytes
    qkv.costs and plan_memory count, at a context shorter and longer than the window."""
    from qkv.cache import plan_memory
    from qkv.models import from_hf

    raw = {**_BASE, **RAW[case]}
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(RAW[case]))
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = from_hf(tmp_path)
    assert tuple(model.config.layer_types) == _hf_layer_types(hf.config)
    for context in (5, 40):
        specs_bytes = 2 * sum(s.bytes_for(context, torch.float32) for s in model.cache_specs())
        costs_bytes = kv_cache_memory(preset_from_hf_config(tmp_path), context=context, batch=2, dtype="fp32")
        plan = plan_memory(raw, batch=2, context=context, dtype=torch.float32)
        assert specs_bytes == costs_bytes.total_bytes == plan.needed_bytes, (
            f"{case} at {context}: specs {specs_bytes}, costs {costs_bytes.total_bytes}, plan {plan.needed_bytes}")


def test_docstring_examples_run():
    result = doctest.testmod(layout_module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result
