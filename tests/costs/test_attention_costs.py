"""qkv.costs: exact figures from the reference texts, hybrid caps, dtypes, FLOP counts, parsing, presets."""

from __future__ import annotations

import doctest
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

import qkv.costs as costs
from qkv.config import DecoderConfig
from qkv.config import presets as presets_mod
from qkv.config.latent import LatentConfig
from qkv.costs import (
    GB,
    PRESETS,
    ModelPreset,
    attention_flops,
    element_bytes,
    format_bytes,
    get_preset,
    kv_cache_memory,
    mla_absorbed_flops,
    model_attention_flops,
    parse_context,
    parse_dtype,
    preset_from_hf_config,
    score_elements,
)
from qkv.costs import flops as flops_mod
from qkv.costs import memory as memory_mod
from qkv.costs import units as units_mod

K128 = 131_072


# Reference-text figures.


def test_score_elements_reference_figures():
    assert score_elements(2048) == 4_194_304
    assert score_elements(131_072) == 17_179_869_184
    assert score_elements(4, 6, batch=2, num_heads=3, num_layers=5) == 4 * 6 * 2 * 3 * 5


def test_llama_70b_mha_teaching_example():
    m = kv_cache_memory(PRESETS["llama-70b-mha"], context=128_000, dtype="fp16")
    (layer,) = m.layers
    assert layer.bytes_per_layer == 2 * 128_000 * 64 * 128 * 2 == 4_194_304_000
    assert format_bytes(layer.bytes_per_layer) == "4.19 GB"
    assert m.total_bytes == 80 * 4_194_304_000
    assert int(m.total_bytes / GB) == 335, format_bytes(m.total_bytes)
    assert m.fits == {24: False, 80: False, 141: False}


def test_llama_3_70b_gqa_is_8x_smaller_than_mha():
    p = PRESETS["llama-3-70b"]
    gqa = kv_cache_memory(p, context=K128)
    mha = kv_cache_memory(p.mha_equivalent(), context=K128)
    assert mha.total_bytes == 8 * gqa.total_bytes
    assert gqa.bytes_per_token == 80 * 2 * 8 * 128 * 2
    assert gqa.fits == {24: False, 80: True, 141: True}


def test_deepseek_v2_mla_bytes_per_token():
    m = kv_cache_memory(PRESETS["deepseek-v2"], context=K128, dtype="bf16")
    assert m.bytes_per_token == 60 * 576 * 2 == 69_120
    assert m.total_bytes == 60 * 576 * 2 * K128


def test_gemma_3_27b_local_layers_capped_at_window():
    m = kv_cache_memory(PRESETS["gemma-3-27b"], context=K128)
    per_token_layer = 2 * 16 * 128 * 2
    layers = {g.kind: g for g in m.layers}
    assert (layers["local"].num_layers, layers["local"].tokens) == (52, 1024)
    assert (layers["global"].num_layers, layers["global"].tokens) == (10, K128)
    assert m.by_layer_type == {
        "global": 10 * K128 * per_token_layer,
        "local": 52 * 1024 * per_token_layer,
    }
    assert m.total_bytes == sum(m.by_layer_type.values())


# Hybrid caps, batch, dtypes.


@pytest.mark.parametrize("context", [1, 1000, 4095, 4096, 4097, 8192, 1 << 20])
def test_hybrid_cap_is_min_context_window(context):
    p = PRESETS["gemma-2-27b"]
    m = kv_cache_memory(p, context=context)
    layers = {g.kind: g for g in m.layers}
    assert layers["local"].tokens == min(context, 4096)
    assert layers["global"].tokens == context
    assert m.total_bytes == 23 * 2 * 16 * 128 * 2 * (min(context, 4096) + context)


def test_all_local_model_stops_growing_at_window():
    p = PRESETS["mistral-7b-v0.1"]
    sizes = [kv_cache_memory(p, context=n).total_bytes for n in (4096, 8192, 1 << 20)]
    assert sizes == [32 * 2 * 8 * 128 * 2 * 4096] * 3


def test_batch_multiplies():
    p = PRESETS["llama-3-8b"]
    one, eight = (kv_cache_memory(p, context=1000, batch=b).total_bytes for b in (1, 8))
    assert eight == 8 * one


@pytest.mark.parametrize(
    "dtype, size",
    [("fp32", 4), ("fp16", 2), ("bf16", 2), ("bfloat16", 2), ("FP8", 1), ("int8", 1), ("int4", 0.5),
     ("int2", 0.25), ("torch.float16", 2)],
)
def test_dtype_bytes(dtype, size):
    assert parse_dtype(dtype) == size
    m = kv_cache_memory(PRESETS["llama-3-8b"], context=1024, dtype=dtype)
    assert m.total_bytes == 32 * 2 * 8 * 128 * 1024 * size


@pytest.mark.parametrize(
    "dtype, group, size",
    [("int4", 32, 0.625), ("int4", 128, 0.53125), ("int2", 64, 0.3125), ("int8", 16, 1.25)],
)
def test_group_scale_overhead(dtype, group, size):
    assert element_bytes(dtype, group_size=group) == size == parse_dtype(dtype) + 4 / group
    m = kv_cache_memory(PRESETS["llama-3-8b"], context=1024, dtype=dtype, group_size=group)
    assert m.total_bytes == 32 * 2 * 8 * 128 * 1024 * size


@pytest.mark.parametrize("dtype, group", [("bf16", 32), ("fp8", 32), ("int4", 0), ("int4", -8)])
def test_group_size_refused(dtype, group):
    with pytest.raises(ValueError, match="group_size"):
        element_bytes(dtype, group_size=group)


@pytest.mark.parametrize("bad", ["int3", "fp64", "", "bogus"])
def test_parse_dtype_refuses_with_list(bad):
    with pytest.raises(ValueError, match="fp32, fp16, bf16, fp8, int8, int4, int2"):
        parse_dtype(bad)


@pytest.mark.parametrize("context, batch", [(0, 1), (1, 0), (-5, 1), (1.5, 1)])
def test_memory_refuses_bad_sizes(context, batch):
    with pytest.raises(ValueError, match="positive int"):
        kv_cache_memory(PRESETS["llama-3-8b"], context=context, batch=batch)


def test_memory_as_dict_is_json():
    d = json.loads(json.dumps(kv_cache_memory(PRESETS["gemma-3-27b"], context=K128).as_dict()))
    assert d["fits"] == {"24GB": True, "80GB": True, "141GB": True}
    assert {g["kind"]: g["tokens"] for g in d["layers"]} == {"global": K128, "local": 1024}


# FLOPs.


def _brute_pairs(q_len, kv_len, window):
    """Pairs under bottom-right causal alignment and a window of `window` keys (self included)."""
    return sum(
        1
        for i, j in itertools.product(range(q_len), range(kv_len))
        if (p := i + kv_len - q_len) >= j and (window is None or p - j < window)
    )


def test_flops_pair_counts_match_brute_force():
    for q_len, kv_len, window in itertools.product(range(1, 8), range(1, 8), [None, 1, 2, 3, 5, 9]):
        flops = attention_flops(1, 1, q_len, kv_len, 1, causal=True, window=window)
        if q_len == kv_len and (window is None or window >= kv_len):
            expected = q_len * kv_len / 2  # the halving convention
        else:
            expected = _brute_pairs(q_len, kv_len, window)
        assert flops == 4 * expected, f"Nq={q_len} Nk={kv_len} window={window}: {flops} vs 4 * {expected}"


def test_flops_hand_checked():
    assert attention_flops(2, 3, 5, 7, 16) == 4 * 2 * 3 * 5 * 7 * 16
    assert attention_flops(1, 1, 4, 4, 8, causal=True) == 4 * 16 * 8 // 2
    assert attention_flops(1, 1, 4, 4, 8, window=2) == 4 * (1 + 2 + 2 + 2) * 8
    assert attention_flops(1, 8, 1, 1000, 64, causal=True) == 4 * 8 * 1000 * 64  # decode sees every key
    assert attention_flops(1, 1, 1, 1000, 64, window=100) == 4 * 100 * 64
    assert attention_flops(1, 1, 3, 3, 192, v_head_dim=128) == 2 * 9 * (192 + 128)


def test_mla_absorbed_flops():
    got = mla_absorbed_flops(2, 128, 1, 1000, kv_lora_rank=512, qk_rope_head_dim=64)
    assert got == 2 * 2 * 128 * 1000 * (2 * 512 + 64)


@pytest.mark.parametrize("bad", [dict(q_len=0), dict(kv_len=-1), dict(window=0)])
def test_flops_refuses_bad_sizes(bad):
    args = dict(q_len=4, kv_len=4, window=None) | bad
    with pytest.raises(ValueError, match="positive int"):
        attention_flops(1, 1, args["q_len"], args["kv_len"], 8, window=args["window"])


def test_model_flops_llama_3_8b():
    f = model_attention_flops(PRESETS["llama-3-8b"], context=8192, batch=2)
    assert f.prefill == 32 * 4 * 2 * 32 * 8192 * 8192 * 128 // 2
    assert f.decode == 32 * 4 * 2 * 32 * 8192 * 128
    assert f.training == f.prefill * 7 // 2
    assert f.decode_absorbed is None


def test_model_flops_hybrid_uses_window():
    f = model_attention_flops(PRESETS["gemma-3-27b"], context=K128)
    d = 128
    local = 52 * attention_flops(1, 32, K128, K128, d, window=1024)
    assert local == 52 * 4 * 32 * d * (1024 * 1025 // 2 + (K128 - 1024) * 1024)
    assert f.prefill == local + 10 * attention_flops(1, 32, K128, K128, d, causal=True)
    assert f.decode == 4 * 32 * d * (52 * 1024 + 10 * K128)


def test_model_flops_mla():
    f = model_attention_flops(PRESETS["deepseek-v2"], context=1000)
    assert f.decode == 60 * 2 * 128 * 1000 * (192 + 128)
    assert f.decode_absorbed == 60 * 2 * 128 * 1000 * (2 * 512 + 64)


# Parsing and formatting.


@pytest.mark.parametrize(
    "text, tokens",
    [("131072", 131072), (131072, 131072), ("128k", 131072), ("128K", 131072), ("1M", 1 << 20),
     ("1m", 1 << 20), ("128000", 128000), ("131_072", 131072), ("131,072", 131072), (" 2k ", 2048),
     ("1.5k", 1536), ("0.5M", 1 << 19), ("1", 1)],
)
def test_parse_context_accepts(text, tokens):
    assert parse_context(text) == tokens


@pytest.mark.parametrize("text", ["abc", "-5", "0", "1.5.3", "", "1.5", "0k", "12kk", "1e5", "k", True, -3, 0,
                                  None, 2.0])
def test_parse_context_refuses_with_forms(text):
    with pytest.raises(ValueError, match="128k = 131072"):
        parse_context(text)


@pytest.mark.parametrize(
    "num, binary, text",
    [(4_194_304_000, False, "4.19 GB"), (4_194_304_000, True, "3.91 GiB"), (512, False, "512 B"),
     (1152, False, "1.15 kB"), (1 << 20, True, "1.00 MiB"), (335_544_320_000, False, "335.54 GB")],
)
def test_format_bytes(num, binary, text):
    assert format_bytes(num, binary=binary) == text


def test_format_flops():
    assert costs.format_flops(3.5e15) == "3.50 PFLOP"


# Presets.


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_consistent(name):
    p = PRESETS[name]
    assert p.name == name == name.lower() and " " not in name
    assert p.source and len(p.config.layer_types) == p.config.num_hidden_layers
    assert p.config.num_attention_heads % p.config.num_key_value_heads == 0


@pytest.mark.parametrize(
    "name, kind, layers, heads, kv_heads, head_dim",
    [("gpt-3-175b", "mha", 96, 96, 96, 128), ("llama-2-70b", "gqa", 80, 64, 8, 128),
     ("llama-3-8b", "gqa", 32, 32, 8, 128), ("llama-3-70b", "gqa", 80, 64, 8, 128),
     ("mistral-7b-v0.1", "gqa", 32, 32, 8, 128), ("gemma-2-27b", "gqa", 46, 32, 16, 128),
     ("gemma-3-27b", "gqa", 62, 32, 16, 128), ("deepseek-v2", "mla", 60, 128, 128, 192),
     ("llama-70b-mha", "mha", 80, 64, 64, 128)],
)
def test_preset_shapes(name, kind, layers, heads, kv_heads, head_dim):
    p = PRESETS[name]
    c = p.config
    got = (p.attention_kind, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, p.key_head_dim)
    assert got == (kind, layers, heads, kv_heads, head_dim)


def test_layer_patterns():
    assert PRESETS["gemma-2-27b"].layer_counts == {"global": 23, "local": 23}
    assert PRESETS["gemma-2-27b"].config.layer_types[:2] == ("sliding_attention", "full_attention")
    g3 = PRESETS["gemma-3-27b"].config.layer_types
    assert [i for i, t in enumerate(g3) if t == "full_attention"] == list(range(5, 62, 6))
    assert PRESETS["mistral-7b-v0.1"].layer_counts == {"local": 32}
    assert PRESETS["llama-3-8b"].layer_counts == {"global": 32}


def test_get_preset_forgives_case_and_underscores():
    assert get_preset("Llama_3_70B") is PRESETS["llama-3-70b"]


def test_unknown_preset_lists_names_and_suggests():
    with pytest.raises(ValueError) as e:
        get_preset("llama3-70b")
    message = str(e.value)
    assert "Did you mean 'llama-3-70b'?" in message
    assert all(name in message for name in PRESETS)


@pytest.mark.parametrize(
    "bad, match",
    [(dict(num_key_value_heads=3), "multiple"), (dict(layer_types=("full_attention",)), "layer_types"),
     (dict(layer_types=("sliding_attention",) * 2), "sliding_window"),
     (dict(latent=LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=16), sliding_window=4,
           layer_types=("sliding_attention",) * 2), "MLA"),
     (dict(head_dim=0), "head_dim")],
)
def test_preset_validation(bad, match):
    """A preset's shape is its DecoderConfig's: what that refuses, no preset holds."""
    base = dict(name="t", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                hidden_size=32, vocab_size=None, intermediate_size=None)
    with pytest.raises(ValueError, match=match):
        ModelPreset(config=DecoderConfig(**(base | bad)))


@pytest.mark.parametrize(
    "kw, error, match",
    [(dict(config={"name": "t"}), TypeError, "config must be a qkv.config.DecoderConfig, got dict"),
     (dict(encoder_layers=-1), ValueError, "encoder_layers must be an int >= 0, got -1"),
     (dict(v_head_dim=0), ValueError, "v_head_dim.*positive int"),
     (dict(context_stated="yes"), TypeError, "context_stated must be a bool"),
     (dict(config=DecoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=None,
                                intermediate_size=None)), ValueError, "config.name must name the preset")],
)
def test_preset_refuses_what_is_not_a_preset(kw, error, match):
    config = DecoderConfig(name="t", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=None,
                           intermediate_size=None)
    with pytest.raises(error, match=match):
        ModelPreset(**({"config": config} | kw))
    mla = config.replace(latent=LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=16))
    with pytest.raises(ValueError, match="MLA's is config.latent.v_head_dim"):
        ModelPreset(config=mla, v_head_dim=8)


def _write(tmp_path: Path, cfg: dict, folder: str = "my-model") -> Path:
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


def test_hf_config_llama_defaults(tmp_path):
    path = _write(tmp_path, {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8,
                             "hidden_size": 512})
    p = preset_from_hf_config(path)
    assert (p.name, p.attention_kind, p.config.num_key_value_heads, p.key_head_dim) == ("my-model", "mha", 8, 64)
    assert p.layer_counts == {"global": 4}
    assert str(path) in p.source
    assert preset_from_hf_config(path.parent) == p  # a folder holding config.json
    assert get_preset(str(path)) == p


def test_hf_config_mistral_and_qwen_windows():
    base = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}
    assert preset_from_hf_config(base | {"sliding_window": 4096}).layer_counts == {"local": 4}
    qwen = base | {"sliding_window": 4096, "use_sliding_window": False}
    assert preset_from_hf_config(qwen).layer_counts == {"global": 4}
    assert preset_from_hf_config(base | {"sliding_window": None}).layer_counts == {"global": 4}


def test_hf_config_gemma3_text_config_default_pattern(tmp_path):
    cfg = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
        "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024}}
    p = preset_from_hf_config(_write(tmp_path, cfg), name="gemma-3-27b")
    ref = PRESETS["gemma-3-27b"]
    assert (p.config.layer_types, p.config.sliding_window, p.key_head_dim) == (ref.config.layer_types, 1024, 128)
    assert kv_cache_memory(p, context=K128).total_bytes == kv_cache_memory(ref, context=K128).total_bytes


def test_hf_config_pattern_and_layer_types():
    base = {"num_hidden_layers": 6, "num_attention_heads": 4, "head_dim": 16, "sliding_window": 128}
    every_third = preset_from_hf_config(base | {"sliding_window_pattern": 3})
    assert every_third.layer_counts == {"global": 2, "local": 4}
    gemma2 = preset_from_hf_config(base | {"model_type": "gemma2"})
    assert gemma2.config.layer_types == ("sliding_attention", "full_attention") * 3
    types = ["full_attention"] * 5 + ["sliding_attention"]
    assert preset_from_hf_config(base | {"layer_types": types}).layer_counts == {"global": 5, "local": 1}
    with pytest.raises(ValueError, match="chunked_attention"):
        preset_from_hf_config(base | {"layer_types": ["chunked_attention"] * 6})


def test_hf_config_deepseek_mla():
    cfg = {"model_type": "deepseek_v2", "num_hidden_layers": 60, "num_attention_heads": 128,
           "num_key_value_heads": 128, "hidden_size": 5120, "kv_lora_rank": 512, "q_lora_rank": 1536,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
    p = preset_from_hf_config(cfg)
    assert (p.attention_kind, p.key_head_dim, p.value_head_dim) == ("mla", 192, 128)
    assert kv_cache_memory(p, context=10).bytes_per_token == 60 * 576 * 2


def test_hf_config_missing_fields():
    with pytest.raises(ValueError, match="num_attention_heads"):
        preset_from_hf_config({"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="qk_rope_head_dim, qk_nope_head_dim"):
        preset_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 2, "kv_lora_rank": 8})
    with pytest.raises(ValueError, match="head_dim or hidden_size"):
        preset_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 2})


# Packaging.


def test_import_does_not_import_torch():
    """The costs modules are pure Python. The parent ``qkv/__init__`` imports torch by design, so the
    check loads ``qkv.costs`` under a bare stand-in parent package, with torch made unimportable."""
    code = f"""
import importlib.abc, sys, types
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'torch':
            raise ImportError('torch is blocked in this test')
sys.meta_path.insert(0, NoTorch())
parent = types.ModuleType('qkv')
parent.__path__ = [{str(Path(costs.__file__).resolve().parents[1])!r}]
sys.modules['qkv'] = parent
import qkv.costs
assert 'torch' not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    "module",
    [costs, units_mod, presets_mod, memory_mod, flops_mod],
    ids=["init", "units", "presets", "memory", "flops"],
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result
