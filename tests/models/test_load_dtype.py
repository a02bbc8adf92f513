"""``from_hf(dtype="auto")``, the default: a model keeps the dtype its checkpoint was saved in (``config.json``'s
``dtype`` or ``torch_dtype``, else its tensors'), an in-memory HF model its parameters', as HF's and vLLM's loaders
do; another dtype only on request; values that are not a floating dtype refused with the fix.

The bfloat16 model's logits are held to the error budget against HF eager float64 with HF eager bfloat16 as the
baseline (``tests/_hf.py``), so a load that kept the dtype but lost or mangled weights fails.
"""

from __future__ import annotations

import json

import pytest
import torch

from _hf import hf_causal_lm, within_budget
from qkv.models import from_hf
from qkv.models.loading import CheckpointError

FIELDS = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def _float_dtypes(model) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if p.dtype.is_floating_point}


@pytest.fixture(scope="module")
def hf64():
    return hf_causal_lm("LlamaConfig", "LlamaForCausalLM", FIELDS, seed=3).double()


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, hf64):
    """A bfloat16 checkpoint as ``save_pretrained`` writes it (config ``dtype: bfloat16``)."""
    import copy

    path = tmp_path_factory.mktemp("llama-bf16")
    copy.deepcopy(hf64).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def _edit(src, dst, **changes):
    """A copy of checkpoint ``src`` in ``dst`` with config fields changed (``None``: removed)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_bf16_checkpoint_loads_as_bf16_within_budget(bf16_dir, hf64):
    """The default keeps bfloat16; its logits are within budget of HF float64, HF bfloat16 the baseline."""
    import copy

    assert json.loads((bf16_dir / "config.json").read_text()).get("dtype") == "bfloat16"
    model = from_hf(bf16_dir)
    assert _float_dtypes(model) == {torch.bfloat16}
    ids = torch.randint(1, FIELDS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    hf_bf16 = copy.deepcopy(hf64).to(torch.bfloat16)
    with torch.no_grad():
        truth = copy.deepcopy(hf_bf16).double()(ids).logits  # the bf16 weights, computed in float64
        base = hf_bf16(ids).logits
        ours = model(ids).logits
    assert ours.dtype == torch.bfloat16
    within_budget(ours, truth, base, "bf16 checkpoint, default dtype")


@pytest.mark.parametrize("dtype", [torch.float32, "float32", "fp32"], ids=str)
def test_float32_on_request_upcasts_exactly(bf16_dir, dtype):
    model = from_hf(bf16_dir, dtype=dtype)
    assert _float_dtypes(model) == {torch.float32}
    kept = from_hf(bf16_dir, optimize=False)
    w32, w16 = model.layers[0].mlp.down_proj.weight, kept.layers[0].mlp.down_proj.weight
    assert torch.equal(w32, w16.float()), "bfloat16 -> float32 is exact; the weights must be the checkpoint's"


def test_bf16_checkpoint_as_float32_with_bf16_exact_weights(bf16_dir, hf64):
    """A bf16 checkpoint loaded as float32 with weights="bf16-exact": every linear but the head holds its weight
    in bfloat16, the same numbers; the logits are those of the float32 model (within the float32 budget of the
    bf16 weights computed in float64); weights without optimize refused."""
    import copy

    from qkv.cpu import Bf16ExactLinear, optimized

    model = from_hf(bf16_dir, dtype=torch.float32, weights="bf16-exact")
    plain = from_hf(bf16_dir, dtype=torch.float32)
    narrow = [m for m in model.modules() if isinstance(m, Bf16ExactLinear)]
    assert len(narrow) == 2 * FIELDS["num_hidden_layers"] * 2 and optimized(model).weights == "bf16-exact"
    assert torch.equal(model.layers[0].mlp.down_proj.weight, plain.layers[0].mlp.down_proj.weight)
    ids = torch.randint(1, FIELDS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        truth = copy.deepcopy(hf64).to(torch.bfloat16).double()(ids).logits
        within_budget(model(ids).logits, truth, plain(ids).logits, "bf16-exact weights, float32 compute")
    with pytest.raises(ValueError, match="weights='bf16-exact' is a format of qkv.cpu.optimize"):
        from_hf(bf16_dir, dtype=torch.float32, optimize=False, weights="bf16-exact")
    with pytest.raises(ValueError, match="weights must be None"):
        from_hf(bf16_dir, dtype=torch.float32, weights="fp8")


def test_none_is_auto(bf16_dir):
    assert _float_dtypes(from_hf(bf16_dir, dtype=None)) == {torch.bfloat16}
    assert _float_dtypes(from_hf(bf16_dir, dtype="AUTO")) == {torch.bfloat16}


@pytest.mark.parametrize("config, expected", [
    ({"dtype": None, "torch_dtype": None}, torch.bfloat16),  # no field: the tensors' dtype
    ({"dtype": None, "torch_dtype": "bfloat16"}, torch.bfloat16),  # older transformers' spelling
    ({"dtype": "float16"}, torch.float16),  # the config decides, as HF's loader does
    ({"dtype": "float32", "torch_dtype": "float16"}, torch.float32),  # transformers 5's field first
], ids=["tensors", "torch_dtype", "config-over-tensors", "dtype-over-torch_dtype"])
def test_auto_reads_config_then_tensors(bf16_dir, tmp_path, config, expected):
    path = _edit(bf16_dir, tmp_path / "ckpt", **config)
    assert _float_dtypes(from_hf(path, optimize=False)) == {expected}


def test_float32_checkpoint_stays_float32(tmp_path, hf64):
    import copy

    copy.deepcopy(hf64).float().save_pretrained(tmp_path, safe_serialization=True)
    assert _float_dtypes(from_hf(tmp_path)) == {torch.float32}


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float32], ids=str)
def test_in_memory_model_keeps_its_parameter_dtype(hf64, dtype):
    import copy

    hf = copy.deepcopy(hf64).to(dtype)
    model = from_hf(hf, optimize=False)
    assert _float_dtypes(model) == {dtype}
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)


@pytest.mark.parametrize("dtype, pattern", [
    ("int8", r"dtype 'int8' is not known; use 'auto'"),
    ("bf17", r"dtype 'bf17' is not known"),
    (torch.int8, r"dtype must be 'auto'.*got torch.int8"),
    (32, r"dtype must be 'auto'.*got 32"),
], ids=["int8-name", "typo", "int8-dtype", "int"])
def test_bad_dtype_is_refused(bf16_dir, dtype, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_hf(bf16_dir, dtype=dtype)


@pytest.mark.parametrize("value", ["int8", 16, "auto"], ids=str)
def test_config_dtype_that_is_not_a_float_is_refused(bf16_dir, tmp_path, value):
    path = _edit(bf16_dir, tmp_path / "ckpt", dtype=value)
    with pytest.raises(CheckpointError, match=r"config.json dtype=.*pass dtype="):
        from_hf(path)
    assert _float_dtypes(from_hf(path, dtype="bf16", optimize=False)) == {torch.bfloat16}  # the fix works
