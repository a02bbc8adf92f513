"""The SmolLM3-3B, OLMo-hybrid 7B and Mistral Small 4 presets (issue 48): parameter counts and K/V bytes per token
against the published figures their sources state, and the built model (on the meta device) counting the same."""

from __future__ import annotations

import pytest
import torch

from qkv.cache.describe import cache_specs_of
from qkv.config import PRESETS
from qkv.costs import num_parameters

# name -> (published total parameters in billions and its rounding, bf16 K/V bytes per token of the growing cache)
PUBLISHED = {
    "smollm3-3b": (3.08, 0.005, 36 * 2 * 4 * 128 * 2),  # model card: 3.08B; 36 layers x K,V x 4 heads x 128 x 2 B
    "olmo-hybrid-7b": (7.0, 0.5, 8 * 2 * 30 * 128 * 2),  # "7B"; only the 8 attention layers grow with the context
    "mistral-small-4-119b": (119.0, 0.5, 36 * (256 + 64) * 2),  # "119B"; MLA: latent 256 + 64 rotated channels
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameters_and_kv_bytes_match_the_published_figures(name):
    preset = PRESETS[name]
    total, within, kv = PUBLISHED[name]
    count = num_parameters(preset)
    assert abs(count.total / 1e9 - total) <= within, f"{name}: {count.total / 1e9:.3f}B, published {total}B"
    growing = [s for s in cache_specs_of(preset) if s.kind != "recurrent"]
    assert sum(s.row_bytes(torch.bfloat16) for s in growing) == kv


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_built_model_counts_the_same(name):
    from qkv.nn import DecoderLM, get_config

    with torch.device("meta"):
        model = DecoderLM(get_config(name))
    assert sum(p.numel() for p in model.parameters()) == num_parameters(PRESETS[name]).total


def test_the_presets_carry_the_new_options():
    smol, olmo, m4 = (PRESETS[n].config for n in PUBLISHED)
    assert smol.nope_layers == (3, 7, 11, 15, 19, 23, 27, 31, 35)
    assert olmo.linear_attention.allow_neg_eigval and olmo.linear_pre_norms
    assert olmo.layer_types.count("full_attention") == 8
    assert m4.latent.query_scale_beta == 0.1 and m4.rope_for("full_attention").interleaved
    assert 6.5 < num_parameters(PRESETS["mistral-small-4-119b"]).active / 1e9 < 6.7
