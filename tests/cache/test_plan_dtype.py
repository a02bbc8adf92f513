"""One default dtype rule for ``plan_memory`` and the ``qkv memory``/``compare`` CLI (issue 29 item 22): a
``transformers`` config object used to plan in float32 (256 MiB for Llama-3-8B at 1K) where the preset and its
config.json planned in bf16 (128 MiB), and a config's declared dtype was ignored. Now: a module's parameter
dtype; a DecoderConfig's build dtype; every other description its declared ``dtype``/``torch_dtype``, else bf16."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.cache import FullSpec, plan_memory
from qkv.config.hf_config import declared_dtype, description_dtype

MiB = 2**20
_LLAMA3_8B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256}


def _needed(config, **kw) -> int:
    return plan_memory(config, context=1024, **kw).needed_bytes


def test_published_descriptions_agree_in_bf16(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_LLAMA3_8B))
    want = 128 * MiB
    assert _needed("llama-3-8b") == want
    assert _needed(_LLAMA3_8B) == want
    assert _needed(str(path)) == want and _needed(tmp_path) == want
    assert _needed([FullSpec(8, 128)] * 32) == want


def test_transformers_config_object_follows_the_rule():
    transformers = pytest.importorskip("transformers", reason="plans a transformers config object")
    cfg = transformers.LlamaConfig(**{k: v for k, v in _LLAMA3_8B.items() if k != "model_type"})
    assert _needed(cfg) == 128 * MiB  # no declared dtype: bf16, as the preset (was float32, 256 MiB)
    cfg32 = transformers.LlamaConfig(**{k: v for k, v in _LLAMA3_8B.items() if k != "model_type"},
                                     dtype=torch.float32)
    assert _needed(cfg32) == 256 * MiB


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("name,factor", [("float32", 2), ("float16", 1), ("bfloat16", 1)])
def test_declared_dtype_is_used(tmp_path, key, name, factor):
    cfg = {**_LLAMA3_8B, key: name}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert _needed(cfg) == _needed(str(path)) == factor * 128 * MiB
    assert _needed(cfg, dtype="fp8") == 64 * MiB  # an explicit dtype always wins
    multimodal = {"model_type": "gemma3", "text_config": {**_LLAMA3_8B, "model_type": "gemma3_text", key: name}}
    assert declared_dtype(multimodal) == name


def test_rule_for_models_and_model_configs():
    from qkv.nn import DecoderLM, get_config

    cfg = get_config("tiny-llama")
    model = DecoderLM(cfg)
    specs = model.cache_specs()
    assert _needed(model) == _needed(specs, dtype=torch.float32)  # the parameters' dtype
    assert _needed(model.to(torch.bfloat16)) == _needed(specs, dtype=torch.bfloat16)
    assert _needed(cfg) == _needed(specs, dtype=torch.get_default_dtype())  # what DecoderLM(cfg) builds in


def test_description_dtype():
    assert description_dtype("llama-3-8b") == "bfloat16"
    assert description_dtype({"torch_dtype": "auto"}) == "bfloat16"  # "auto" declares nothing
    assert description_dtype({"torch_dtype": "torch.float16"}) == "float16"
    assert declared_dtype({"num_hidden_layers": 2}) is None


def test_cli_follows_the_rule(tmp_path):
    from typer.testing import CliRunner

    from qkv.cli import _register, app

    _register()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_LLAMA3_8B, "torch_dtype": "float32"}))
    runner = CliRunner()
    out = runner.invoke(app, ["memory", str(path), "--context", "1k", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["total_bytes"] == 256 * MiB
    preset = runner.invoke(app, ["memory", "llama-3-8b", "--context", "1k", "--json"])
    assert json.loads(preset.output)["total_bytes"] == 128 * MiB
    mixed = runner.invoke(app, ["compare", "llama-3-8b", str(path), "--context", "1k"])
    assert mixed.exit_code == 2 and "pass --dtype" in mixed.output
    same = runner.invoke(app, ["compare", "llama-3-8b", str(path), "--context", "1k", "--dtype", "bf16"])
    assert same.exit_code == 0, same.output
    from qkv.cli import costs as cli_costs

    assert "Default: the dtype a config.json declares" in cli_costs._Dtype.__metadata__[0].help
