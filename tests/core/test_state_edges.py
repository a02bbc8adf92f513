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


@pytest.mark.parametrize("masked", ["-inf", "finfo.min"])
def test_hf_additive_4d_mask_with_softcap_matches_eager(masked):
    pytest.importorskip("transformers", reason="the HF attention-function signature needs transformers")
    import qkv.integrations.transformers as qhf

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 6, 8, generator=g, dtype=torch.float64) * 3 for h in (4, 2, 2))
    allowed = torch.rand(2, 1, 6, 6, generator=g) < 0.6
    allowed[..., 0] = True
    fill = float("-inf") if masked == "-inf" else torch.finfo(torch.float64).min
    additive = (0.3 * torch.randn(2, 1, 6, 6, generator=g, dtype=torch.float64)).masked_fill(~allowed, fill)
    cap, scale = 5.0, 8 ** -0.5
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = cap * torch.tanh((q @ kr.transpose(-1, -2)) * scale / cap) + additive  # eager: mask after softcap
    expected = torch.softmax(scores, -1) @ vr
    module = torch.nn.Module()
    out, _ = qhf.attention_forward(module, q, k, v, additive, scaling=scale, softcap=cap)
    err = (out.transpose(1, 2) - expected).abs().max().item()
    assert err < 1e-10, f"max error {err:.3g} against eager's softcap-then-mask"


def _llama_config():
    transformers = pytest.importorskip("transformers", reason="HF models need transformers")
    return transformers, transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_hf_explain_says_why_no_call_went_through_qkv_with_a_shared_config():
    transformers, cfg = _llama_config()
    import qkv.integrations.transformers as qhf

    ours = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="qkv")
    transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")  # the same config object
    with pytest.raises(ValueError, match=r"no attention call.*attn_implementation='sdpa'.*shared config"):
        qhf.explain(ours, torch.zeros(1, 4, dtype=torch.long))


def test_hf_explain_names_a_family_that_runs_its_own_attention():
    transformers = pytest.importorskip("transformers", reason="HF models need transformers")
    import qkv.integrations.transformers as qhf

    cfg = transformers.BloomConfig(vocab_size=50, hidden_size=32, n_layer=2, n_head=4)
    bloom = transformers.BloomForCausalLM._from_config(cfg, attn_implementation="eager")
    with pytest.raises(ValueError, match=r"no attention call.*Bloom.*own attention code"):
        qhf.explain(bloom, torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("how", ["AutoModelForCausalLM.from_config", "BloomForCausalLM._from_config"])
def test_hf_bloom_with_qkv_attention_is_refused_when_built(how):
    transformers = pytest.importorskip("transformers", reason="HF models need transformers")
    import qkv.integrations.transformers  # noqa: F401  (registers "qkv")

    cfg = transformers.BloomConfig(vocab_size=50, hidden_size=32, n_layer=2, n_head=4)
    with pytest.raises(ValueError, match=r"'qkv': BloomForCausalLM \(model type 'bloom'\) computes attention in its "
                                         r"own code.*attn_implementation='eager' or 'sdpa'"):
        if how == "AutoModelForCausalLM.from_config":
            transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="qkv")
        else:
            transformers.BloomForCausalLM._from_config(cfg, attn_implementation="qkv")
    llama = transformers.LlamaForCausalLM._from_config(_llama_config()[1], attn_implementation="qkv")
    assert llama.config._attn_implementation == "qkv"  # a family that dispatches through the interface builds


def test_hf_bloom_forced_onto_qkv_after_building_fails_with_a_clear_type_error():
    transformers = pytest.importorskip("transformers", reason="HF models need transformers")
    import qkv.integrations.transformers  # noqa: F401  (registers "qkv")

    cfg = transformers.BloomConfig(vocab_size=50, hidden_size=32, n_layer=2, n_head=4)
    bloom = transformers.BloomForCausalLM._from_config(cfg, attn_implementation="eager")
    bloom.config._attn_implementation_internal = "qkv"  # past the check at build: the mask still refuses
    with pytest.raises(TypeError, match=r"does not dispatch attention through transformers' AttentionInterface"):
        bloom(torch.zeros(1, 4, dtype=torch.long))


def test_from_hf_checks_weights_on_a_meta_build_before_allocating(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="the checkpoint is written by transformers")
    import json

    from qkv.models import CheckpointError, from_hf, loading

    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2000}))
    devices = []
    real_build = loading._build

    def build(family, config):
        devices.append(torch.empty(0).device.type)  # the default device the model is built on
        return real_build(family, config)

    monkeypatch.setattr(loading, "_build", build)
    with pytest.raises(CheckpointError, match="missing tensors"):
        from_hf(tmp_path)
    assert devices == ["meta"], f"the model was built on {devices} before the weights were checked"


def test_no_docstring_cites_a_design_file_missing_from_the_repository():
    from pathlib import Path

    import qkv

    repo = Path(qkv.__file__).parent.parent.parent
    this = Path(__file__).resolve()
    for name in ("DESIGN.md", "STYLE.md"):
        cited = [str(p.relative_to(repo)) for folder in ("src", "tests", "benchmarks", "examples")
                 for p in (repo / folder).rglob("*.py")
                 if p.resolve() != this and name in p.read_text(encoding="utf-8")]
        assert (repo / name).exists() or not cited, f"docstrings cite {name}, absent here: {cited}"


def test_score_mod_base_has_a_docstring_with_a_runnable_example():
    import doctest

    from qkv import mods

    doc = mods.ScoreMod.__doc__ or ""
    assert "apply" in doc and "bias" in doc and ">>>" in doc, doc
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(mods.ScoreMod, "ScoreMod", globs={"torch": torch}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


def test_readme_context_parallel_snippet_passes_logits_to_the_loss():
    from pathlib import Path

    import qkv

    readme = (Path(qkv.__file__).parent.parent.parent / "README.md").read_text(encoding="utf-8")
    assert "loss_fn(ctx(ctx.shard(ids))," not in readme, "the model returns a DecoderOutput, not logits"
    assert "ctx(ctx.shard(ids)).logits" in readme


def test_vit_example_default_run_trains_on_the_real_digits_quickly(monkeypatch):
    import runpy
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "vit.py"
    calls = []

    def fake_digits_main(recipe="full", seed=0, *, verbose=False):
        calls.append(recipe)
        raise SystemExit(0)  # stop before training: the choice of data and recipe is what is checked

    pytest.importorskip("sklearn", reason="the digits come with scikit-learn")

    monkeypatch.setattr(sys, "argv", [str(path)])
    namespace = runpy.run_path(str(path), run_name="not_main")
    monkeypatch.setitem(namespace, "digits_main", fake_digits_main)
    recipe = namespace["DIGITS_RECIPES"]["quick"]
    assert recipe.epochs * recipe.n_layers <= 6, recipe  # seconds, not minutes
    source = path.read_text(encoding="utf-8")
    main_block = source[source.index('if __name__ == "__main__":'):]
    with pytest.raises(SystemExit):
        exec(compile(main_block, str(path), "exec"), {**namespace, "__name__": "__main__"})
    assert calls == ["quick"], calls
