"""qkv.config, the torch-free model description: it imports without torch, holds each concept once (layer types,
RoPE parameters, activation and norm names, the HF reader), and the public names of qkv.nn and qkv.costs are
its objects."""

from __future__ import annotations

import doctest
import importlib
import json
import subprocess
import sys
import textwrap

import pytest

import qkv.config
from qkv.config import hf_config

_BLOCK_TORCH = textwrap.dedent("""
    import sys

    class _Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "numpy", "transformers", "triton"):
                raise ImportError(f"blocked import of {name}")

    sys.meta_path.insert(0, _Blocked())
""")


@pytest.mark.parametrize("module", ["qkv.config", "qkv.costs"])
def test_imports_without_torch(module):
    """A meta-path guard refuses torch (and numpy, transformers): the description and the cost arithmetic still
    import and work, and load no qkv module that needs torch."""
    code = _BLOCK_TORCH + textwrap.dedent(f"""
        import importlib, json
        importlib.import_module({module!r})
        from qkv.config import get_config, get_preset, read_layout
        cfg = get_config("llama-3-8b", num_hidden_layers=2)
        layout = read_layout({{"model_type": "gemma2", "num_hidden_layers": 4, "num_attention_heads": 8,
                               "hidden_size": 64}})
        print(json.dumps({{"types": cfg.layer_types, "gemma": layout.layer_types,
                          "kv": get_preset("llama-3-70b").config.num_key_value_heads,
                          "loaded": sorted(m for m in sys.modules if m.startswith(("qkv", "torch")))}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["types"] == ["full_attention"] * 2 and got["kv"] == 8
    assert got["gemma"] == ["sliding_attention", "full_attention"] * 2
    assert not [m for m in got["loaded"] if m.startswith("torch")]
    allowed = ("qkv.config", "qkv.costs")
    assert all(m == "qkv" or m.startswith(allowed) for m in got["loaded"]), got["loaded"]


def test_spec_imports_nothing_above_it():
    """Spec is the lowest layer: no module of it imports (even lazily, inside a function) another qkv package."""
    import ast
    import pathlib

    bad = []
    for path in pathlib.Path(qkv.config.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level > 1 or (node.module or "").startswith("qkv")
                                                     and not node.module.startswith("qkv.config")):
                bad.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Import) and any(a.name.startswith(("qkv.", "torch")) and
                                                    not a.name.startswith("qkv.config") for a in node.names):
                bad.append(f"{path.name}:{node.lineno}")
    assert not bad, bad


def test_the_guard_does_refuse_torch():
    """The guard of the test above is real: importing torch-needing qkv modules under it fails."""
    code = _BLOCK_TORCH + "import qkv.nn\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "blocked import of torch" in out.stderr


def test_each_concept_is_defined_once():
    import qkv.cache.plan
    import qkv.nn
    import qkv.nn.activations
    import qkv.nn.latent
    import qkv.nn.moe
    import qkv.nn.norm
    from qkv.config import decoder as config
    from qkv.config import layer_types, presets, rope

    for module in (config, hf_config, presets):
        assert module.FULL_ATTENTION is layer_types.FULL_ATTENTION
    assert config.SLIDING_ATTENTION is hf_config.SLIDING_ATTENTION is layer_types.SLIDING_ATTENTION
    assert qkv.nn.DecoderConfig is config.DecoderConfig and qkv.nn.TransformerConfig is config.TransformerConfig
    assert qkv.nn.RopeParams is rope.RopeParams and qkv.nn.get_config is config.get_config
    assert qkv.nn.PRESETS is config.PRESETS
    assert qkv.nn.LatentConfig is qkv.nn.latent.LatentConfig is qkv.config.LatentConfig
    assert qkv.nn.MoEConfig is qkv.nn.moe.MoEConfig is qkv.config.MoEConfig
    assert importlib.import_module("qkv.pos.rope").ROPE_TYPES is rope.ROPE_TYPES
    assert qkv.nn.norm.NORMS is config.NORMS
    assert tuple(qkv.nn.activations.ACTIVATIONS) == config.ACTIVATION_NAMES  # names here, functions in qkv.nn


def test_costs_public_names_are_the_spec_objects():
    import qkv.costs

    for name in ("PRESETS", "AMBIGUOUS", "ModelPreset", "get_preset", "preset_from_hf_config"):
        assert getattr(qkv.costs, name) is getattr(qkv.config, name), name


def test_latent_and_moe_come_from_the_one_reader():
    deepseek = {"model_type": "deepseek_v2", "hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 16,
                "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
                "max_position_embeddings": 256, "rope_theta": 500.0,
                "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                 "mscale_all_dim": 1.0},
                "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}
    latent = hf_config.read_latent(deepseek)
    assert qkv.config.LatentConfig.from_hf(deepseek) == latent  # the public method is the reader
    assert (latent.rope_theta, latent.rope_type, latent.q_lora_rank) == (500.0, "yarn", 24)
    assert latent.rope_scaling["factor"] == 4.0 and "rope_theta" not in latent.rope_scaling
    moe = hf_config.read_moe(deepseek)
    assert (moe.n_routed_experts, moe.topk_method, moe.n_group) == (8, "group_limited_greedy", 4)
    assert hf_config.read_moe({"hidden_size": 8}) is None


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_transformer_config_reads_rope_through_the_reader(key):
    hf = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "rope_theta": 2e4,
          key: {"type": "linear", "factor": 2.0}}
    cfg = qkv.config.TransformerConfig.from_dict(hf, strict=False)
    want = hf_config.read_rope(hf)["full_attention"]
    assert (cfg.rope_theta, cfg.rope_params.rope_type, dict(cfg.rope_scaling)) == (
        want.theta, "linear", dict(want.scaling))
    default = qkv.config.TransformerConfig.from_dict(
        {**hf, key: {"rope_type": "default", "rope_theta": 7e3}}, strict=False)
    assert (default.rope_scaling, default.rope_theta) == (None, 2e4)  # the explicit rope_theta wins


def test_rope_params_build_the_same_embedding():
    import torch

    from qkv.pos import RotaryEmbedding

    params = qkv.config.RopeParams(theta=5e5, scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    built = RotaryEmbedding.from_params(params, 16, 512)
    direct = RotaryEmbedding(16, theta=5e5, scaling=dict(params.scaling), max_position_embeddings=512)
    assert torch.equal(built.inv_freq(), direct.inv_freq())
    with pytest.raises(ValueError, match="needs 'factor'"):
        qkv.config.TransformerConfig(position="rope", rope_scaling={"rope_type": "linear"})
    with pytest.raises(ValueError, match="unsupported rope_type 'bogus'"):
        qkv.config.TransformerConfig(position="rope", rope_scaling={"rope_type": "bogus"})


@pytest.mark.parametrize("name", ["qkv.config", "qkv.config.decoder", "qkv.config.hf_config", "qkv.config.layer_types",
                                  "qkv.config.rope", "qkv.config.latent", "qkv.config.presets",
                                  "qkv.cache.describe"])
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def _whole_decoder_presets():
    return [p for p in qkv.config.PRESETS.values() if not p.encoder_layers]


@pytest.mark.parametrize("name", [p.name for p in _whole_decoder_presets()])
def test_preset_is_a_description_and_back(name):
    """``preset.config`` is the DecoderConfig ``get_config(name)`` returns; reading it back as a preset gives the
    same cost arithmetic (parameters, KV bytes, FLOPs)."""
    from qkv.costs import kv_cache_memory, model_flops, num_parameters

    preset = qkv.config.PRESETS[name]
    cfg = preset.config
    assert qkv.config.get_config(name) == cfg
    assert qkv.config.decoder.decoder_config_from_preset(preset) == cfg
    back = qkv.config.ModelPreset.from_config(cfg, source=preset.source)
    assert back.config.layer_types == preset.config.layer_types and back.attention_kind == preset.attention_kind
    assert num_parameters(back)[1:] == num_parameters(preset)[1:]
    assert num_parameters(cfg)[1:] == num_parameters(preset)[1:]  # costs take the description itself
    assert kv_cache_memory(back, context=4096).total_bytes == kv_cache_memory(preset, context=4096).total_bytes
    assert model_flops(cfg, context=1024).prefill == model_flops(preset, context=1024).prefill


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-gemma", "tiny-gpt"])
def test_costs_of_a_description_count_the_built_model(name):
    from qkv.costs import num_parameters
    from qkv.nn import DecoderLM

    cfg = qkv.config.get_config(name)
    assert num_parameters(cfg).total == sum(p.numel() for p in DecoderLM(cfg).parameters())


def test_from_config_refuses_what_costs_do_not_count():
    with pytest.raises(ValueError, match="embed_norm.*does not count"):
        qkv.config.ModelPreset.from_config(qkv.config.get_config("tiny-bloom"))
    with pytest.raises(TypeError, match="expected a qkv.config.DecoderConfig"):
        qkv.config.ModelPreset.from_config({"hidden_size": 8})


def test_from_config_refuses_a_field_it_does_not_count(monkeypatch):
    """A DecoderConfig field the cost arithmetic does not know (one added later) is refused when set away from
    its default, never silently left out of the count."""
    from qkv.config import presets

    monkeypatch.setattr(presets, "_COUNTED_FIELDS", presets._COUNTED_FIELDS - {"qk_norm"})
    with pytest.raises(ValueError, match="qk_norm=True"):
        qkv.config.ModelPreset.from_config(qkv.config.get_config("tiny-gemma"))
    assert qkv.config.ModelPreset.from_config(qkv.config.get_config("tiny-llama")).config.qk_norm is False


# The published Kimi-Linear-48B-A3B-Instruct config.json (moonshotai), its layout and expert fields.
KIMI_LINEAR_JSON = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "model_max_length": 1048576, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32,
                           "short_conv_kernel_size": 4,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]},
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
}


def test_kimi_linear_reads_as_transformers_reads_it():
    """Checkpoint names (``num_experts``, ``moe_renormalize``, ``linear_attn_config`` counted from 1) and
    transformers' names give the same MoE, KDA shape and layer pattern as ``KimiLinearConfig``."""
    cfg = hf_config.hf_defaults(KIMI_LINEAR_JSON)
    mla = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    assert mla == [3, 7, 11, 15, 19, 23, 26] and len(cfg["layer_types"]) == 27
    assert (cfg["linear_num_heads"], cfg["linear_head_dim"], cfg["linear_conv_kernel_dim"]) == (32, 128, 4)
    moe = hf_config.read_moe(KIMI_LINEAR_JSON)
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.n_shared_experts, moe.topk_method) == (
        256, 8, 1, "noaux_tc")
    assert (moe.n_group, moe.topk_group, moe.norm_topk_prob, moe.routed_scaling_factor) == (1, 1, True, 2.446)
    assert [moe.is_moe(i) for i in range(3)] == [False, True, True]
    latent = hf_config.read_latent(KIMI_LINEAR_JSON)
    assert not latent.use_rope and latent.q_lora_rank is None and latent.qk_head_dim == 192
    default = hf_config.hf_defaults({"model_type": "kimi_linear", "num_hidden_layers": 9})["layer_types"]
    assert [i for i, t in enumerate(default) if t == "full_attention"] == [4, 8]
    transformers = pytest.importorskip("transformers")
    theirs = transformers.KimiLinearConfig(**{k: v for k, v in KIMI_LINEAR_JSON.items() if k != "model_type"})
    assert list(theirs.layer_types) == list(cfg["layer_types"])
    assert [t == "sparse" for t in theirs.mlp_layer_types] == [moe.is_moe(i) for i in range(27)]
    hf_names = theirs.to_dict()
    assert hf_config.read_moe(hf_names) == moe and hf_config.hf_defaults(hf_names)["layer_types"] == cfg["layer_types"]


@pytest.mark.parametrize("change, match", [
    ({"moe_router_activation_func": "softmax"}, "sigmoid scores"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"mlp_layer_types": ["sparse", "dense"] + ["sparse"] * 25}, "'dense' ones first"),
    ({"linear_attn_config": {"full_attn_layers": [0], "kda_layers": [1]}}, "counts layers from 1 to 27"),
    ({"linear_attn_config": {"full_attn_layers": [1], "kda_layers": [2]}}, "for layers \\[3, 4"),
], ids=["softmax-router", "moe-every-2", "dense-after-sparse", "layer-0", "layers-missing"])
def test_kimi_linear_configs_the_reader_refuses(change, match):
    bad = {**KIMI_LINEAR_JSON, **change}
    with pytest.raises(ValueError, match=match):
        hf_config.read_moe(bad) if "linear_attn_config" not in change else hf_config.hf_defaults(bad)


def test_kda_mixer_has_as_many_key_as_value_heads():
    from qkv.config.linear import LinearAttentionConfig

    kda = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
               mixer="kda")
    assert LinearAttentionConfig(**kda).recurrent_shape() == (3 * 2 * 8, 4, 2, 8, 8)  # q, k, v convolved; (D, D)
    for change in ({"linear_num_value_heads": 4}, {"linear_value_head_dim": 16}):
        with pytest.raises(ValueError, match="the kda mixer has as many key as value heads, each as wide"):
            LinearAttentionConfig(**{**kda, **change})


def test_kimi_linear_preset_is_its_config_json():
    """The ``kimi-linear-48b-a3b`` preset and the published config.json describe the same model: the layer
    pattern, the KDA mixer, NoPE MLA, and so the same parameters, recurrent state and KV bytes."""
    from qkv.costs import kv_cache_memory, num_parameters

    preset, read = qkv.config.PRESETS["kimi-linear-48b-a3b"], qkv.config.preset_from_hf_config(KIMI_LINEAR_JSON)
    assert read.config.layer_types == preset.config.layer_types
    assert read.config.linear_attention == preset.config.linear_attention
    assert not read.config.latent.use_rope and not preset.config.latent.use_rope
    assert read.context_limit == 1048576
    assert num_parameters(read)[1:] == num_parameters(preset)[1:]
    assert kv_cache_memory(read, context=4096) == kv_cache_memory(preset, context=4096)._replace(preset=read.name)
    cfg = preset.config
    assert cfg.position == "none" and not cfg.latent.use_rope and cfg.linear_attention.mixer == "kda"


def test_a_preset_states_one_description():
    """ModelPreset.description is the DecoderConfig of what the preset states: the whole model (then .config), the
    attention only, or an encoder-decoder's decoder stack; the cache reads presets through it."""
    from qkv.cache.describe import cache_specs_of
    from qkv.config import PRESETS, preset_from_hf_config

    for name in ("llama-3-8b", "gemma-3-27b", "deepseek-v3.2", "qwen3-next-80b-a3b", "kimi-linear-48b-a3b"):
        p = PRESETS[name]
        assert p.description == p.config, name
        assert cache_specs_of(p) == cache_specs_of(p.description), name
    attention_only = preset_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256})
    d = attention_only.description
    assert d.attention_only and (d.num_hidden_layers, d.num_key_value_heads, d.head_dim) == (2, 4, 64)
    assert attention_only.config is d and not attention_only.whole_model
    with pytest.raises(ValueError, match="describes attention only"):
        # a whole model still needs the whole-model fields
        qkv.config.decoder.decoder_config_from_preset(attention_only)
    assert PRESETS["transformer-base"].description.num_hidden_layers == 6  # the decoder stack
    with pytest.raises(ValueError, match=r"value heads of 128 beside key heads of 192 without MLA"):
        _ = PRESETS["deepseek-v2"].mha_equivalent().description


def test_a_preset_holds_a_config_and_only_what_a_config_cannot():
    """ModelPreset restates nothing of its DecoderConfig: beside ``config`` only its source, notes and the three
    facts a DecoderConfig cannot hold; every published preset is written as a DecoderConfig named after it."""
    import dataclasses

    from qkv.config import PRESETS, DecoderConfig, ModelPreset

    fields = {f.name for f in dataclasses.fields(ModelPreset)}
    assert fields == {"config", "source", "notes", "encoder_layers", "context_stated", "v_head_dim"}
    assert not (fields - {"config"}) & {f.name for f in dataclasses.fields(DecoderConfig)}
    for name, p in PRESETS.items():
        assert isinstance(p.config, DecoderConfig) and p.config.name == p.name == name
        assert p.v_head_dim is None  # published presets state their widths in the config
    assert [n for n, p in PRESETS.items() if not p.context_stated] == ["transformer-base", "llama-70b-mha"]
    assert [n for n, p in PRESETS.items() if p.encoder_layers] == ["transformer-base"]


def test_mha_equivalent_of_mla_keeps_its_narrower_values():
    """An MLA model's MHA-equivalent caches a 192-wide key and a 128-wide value per query head: a cache shape no
    DecoderConfig builds, held by the preset's ``v_head_dim``; describing it as a model is refused."""
    from qkv.config import PRESETS
    from qkv.costs import kv_cache_memory

    mha = PRESETS["deepseek-v2"].mha_equivalent()
    assert mha.config.latent is None and mha.config.indexer is None and mha.attention_kind == "mha"
    assert (mha.config.num_key_value_heads, mha.key_head_dim, mha.value_head_dim, mha.v_head_dim) == (128, 192, 128,
                                                                                                     128)
    assert kv_cache_memory(mha, context=1).bytes_per_token == 60 * 128 * (192 + 128) * 2
    with pytest.raises(ValueError, match="value heads of 128 beside key heads of 192 without MLA"):
        _ = mha.description


def test_hf_value_heads_narrower_without_mla_are_counted():
    from qkv.config import preset_from_hf_config
    from qkv.costs import kv_cache_memory

    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "v_head_dim": 32}
    p = preset_from_hf_config(cfg)
    assert (p.key_head_dim, p.value_head_dim, p.v_head_dim) == (64, 32, 32)
    assert kv_cache_memory(p, context=1).bytes_per_token == 2 * 4 * (64 + 32) * 2
    same = preset_from_hf_config({**cfg, "v_head_dim": 64})
    assert same.v_head_dim is None and same.description is same.config
