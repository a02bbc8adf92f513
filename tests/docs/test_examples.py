"""Smoke tests: each script in examples/ runs in seconds and learns something."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"qkv_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: extra intra-op threads only add contention.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_vit_classifies_line_orientation():
    m = _load("vit").main(steps=150, seed=0)
    assert m["accuracy"] >= m["chance"] + 0.35, m
    assert m["loss_last"] < 0.5 * m["loss_first"], m


def test_set_transformer_regresses_the_max_and_is_permutation_invariant():
    m = _load("set_transformer").main(steps=150, seed=0)
    assert m["mse_last"] < 0.5 * m["mse_first"], m
    assert m["mse_eval"] < 0.25 * m["mse_baseline"], m  # far better than predicting the mean maximum
    assert m["permutation_gap"] < 1e-4, m


def test_decision_transformer_acts_on_the_return_it_is_asked_for():
    m = _load("decision_transformer").main(steps=200, seed=0)
    assert m["loss_last"] < 0.75 * m["loss_first"], m  # behaviour actions are partly random: no zero loss
    assert m["return_high"] >= m["return_random"] + 0.5, m
    assert m["return_low"] <= m["return_high"] - 0.2, m  # return conditioning, not plain imitation


def test_vit_learns_real_digits_and_draws_its_rollout(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    vit = _load("vit")
    m, model, test_images = vit.digits_main("ci", seed=0)
    assert m["accuracy"] >= 0.95, m  # held-out digits (360 images); chance 0.1
    assert m["loss_last"] < 0.5 * m["loss_first"], m
    maps = vit.attention_maps(model, test_images[:4])
    assert len(maps) == vit.DIGITS_RECIPES["ci"].n_layers and maps[0].shape == (4, 4, 17, 17), [a.shape for a in maps]
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(4, 4, 17))
    cls = vit.rollout_picture(model, test_images, tmp_path / "rollout.png", count=4)
    assert (tmp_path / "rollout.png").stat().st_size > 1000
    assert cls.shape == (4, 4, 4) and (cls >= 0).all() and float(cls.sum(dim=(1, 2)).max()) <= 1 + 1e-5


def test_vit_digits_rejects_an_unknown_recipe():
    vit = _load("vit")
    with pytest.raises(ValueError, match="recipe must be one of"):
        vit.digits_main("tiny")
    with pytest.raises(TypeError, match="recipe must be a name or a DigitsRecipe"):
        vit.digits_main({"epochs": 1})


@pytest.mark.slow
def test_vit_digits_full():
    pytest.importorskip("sklearn")
    m, _, _ = _load("vit").digits_main("full", seed=0)
    assert m["accuracy"] >= 0.95, m


def test_evoformer_pair_bias_routes_each_residue_to_its_partner():
    m = _load("evoformer").main(steps=120, seed=0)
    assert m["accuracy"] >= m["chance"] + 0.5, m


def test_evoformer_row_attention_and_pair_gradient_match_float64_reference():
    evo = _load("evoformer")
    torch.manual_seed(0)
    row = evo.RowAttentionWithPairBias(c=12, cz=5, heads=3, head_dim=4).double()
    m = torch.randn(2, 3, 7, 12, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, 7, 7, 5, dtype=torch.float64, requires_grad=True)
    out = row(m, z)
    grad_out = torch.randn_like(out)
    gm, gz = torch.autograd.grad(out, (m, z), grad_out)

    def reference(m, z):  # Algorithm 7 written out densely
        B, S, R, _ = m.shape
        x = row.norm_m(m)
        q, k, v = row.qkv(x).view(B, S, R, 3, 3, 4).unbind(3)  # (B, S, R, H, D)
        bias = row.pair_bias(row.norm_z(z))  # (B, R, R, H)
        scores = torch.einsum("bsihd,bsjhd->bshij", q, k) / 2.0 + bias.permute(0, 3, 1, 2).unsqueeze(1)
        o = torch.einsum("bshij,bsjhd->bsihd", scores.softmax(-1), v).reshape(B, S, R, 12)
        return row.out(o * torch.sigmoid(row.gate(x)))

    ref = reference(m, z)
    rm, rz = torch.autograd.grad(ref, (m, z), grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gz, rz, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gm, rm, rtol=1e-10, atol=1e-10)
    assert gz.abs().sum() > 0


def test_gated_attention_mil_finds_the_nines():
    pytest.importorskip("sklearn")
    m = _load("mil_attention").main(steps=120, seed=0)
    assert m["accuracy"] >= 0.85, m
    assert m["localization"] >= 0.7, m  # the largest weight sits on a 9 in positive bags
    assert m["padding_weight"] == 0.0, m  # padded instances never get weight


def test_wav2vec_predicts_masked_frames_from_context():
    w2v = _load("wav2vec")
    m = w2v.main(steps=80, seed=0, frames=24)
    assert m["accuracy"] >= m["chance"] + 0.2, m
    mask = w2v.span_mask(4000, 50, p=0.065, span=10, g=torch.Generator().manual_seed(0))
    frac = float(mask[:, 10:].float().mean())  # away from the start, P(masked) = 1 - (1 - p)^span
    assert abs(frac - (1 - (1 - 0.065) ** 10)) < 0.01, frac


def test_enformer_basis_bias_learns_a_fixed_offset():
    enf = _load("enformer")
    m = enf.main(steps=100, seed=0)
    assert m["accuracy"] >= 0.8, m
    assert m["bias_peak_offset"] == enf.OFFSET, m
    with pytest.raises(ValueError, match="multiple of 3"):
        enf.relative_basis(16, features=10)
