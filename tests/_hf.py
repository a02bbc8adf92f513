"""Shared helpers for tests against HF transformers models with random weights.

HF's initialisation (normal with std 0.02) makes attention nearly uniform, which hides mask, position and scale
mistakes; :func:`randomize_weights` redraws every weight at unit scale instead. :func:`hf_causal_lm` builds a model
of a config class by name, redrawn and ready for greedy generation (no EOS, pad id 0).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

__all__ = ["randomize_weights", "hf_causal_lm", "OptionalModule"]


def randomize_weights(model: nn.Module, seed: int) -> None:
    """Redraw every parameter of an HF model in place: linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
    biases ~ N(0, 0.1^2), norm parameters around their identity (1, or 0 for Gemma's ``1 + w`` norms) with spread
    0.2; so that they matter, GPT-OSS's sink logits ~ N(1, 1) and router biases ~ N(0, 0.5^2), and DeepSeek-V3's
    routing correction (a buffer) ~ N(0, 0.3^2), as large as the spread of its sigmoid scores."""
    gen = torch.Generator().manual_seed(seed)
    around_zero = model.config.model_type.startswith("gemma")
    embeddings = {name for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    input_major_experts = model.config.model_type == "gpt_oss"  # HF keeps its experts (E, d_in, d_out)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            low = name.lower()
            if low.endswith("sinks"):
                value = 1.0 + noise
            elif "router.bias" in low:
                value = 0.5 * noise
            elif "norm" in low or "ln_" in low:
                value = (0.0 if around_zero else 1.0) + 0.2 * noise
            elif name.rpartition(".")[0] in embeddings:
                value = noise
            elif p.dim() == 1 or low.endswith("_bias"):
                value = 0.1 * noise
            elif input_major_experts and (low.endswith("gate_up_proj") or low.endswith("experts.down_proj")):
                value = noise / math.sqrt(p.shape[-2])
            else:
                value = noise / math.sqrt(p.shape[-1])
            p.copy_(value.to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen, dtype=torch.float64).to(b.dtype))


def hf_causal_lm(config_cls: str, model_cls: str, fields: dict, *, seed: int,
                 attn_implementation: str | None = None, **load) -> nn.Module:
    """An HF model ``model_cls`` of ``config_cls(**fields)`` in eval mode, with redrawn weights and a generation
    config for greedy decoding of fixed length (no EOS token, padding id 0). ``load``: more keywords of
    ``_from_config`` (e.g. ``experts_implementation="eager"``), with ``attn_implementation``."""
    import pytest

    transformers = pytest.importorskip("transformers")

    cfg = getattr(transformers, config_cls)(**fields)
    torch.manual_seed(0)
    cls = getattr(transformers, model_cls)
    model = (cls(cfg) if attn_implementation is None
             else cls._from_config(cfg, attn_implementation=attn_implementation, **load)).eval()
    randomize_weights(model, seed)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return model


class OptionalModule:
    """A module imported on first use inside a test: a test that touches it skips when the package is missing
    (``pytest.importorskip``), the file's other tests still run (a partial install keeps them)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):  # pytest's collection probes module globals (``__wrapped__``, ...): not a use
            raise AttributeError(attr)
        import pytest

        return getattr(pytest.importorskip(self._name), attr)


def two_row_prompt(seed: int, vocab: int, n: int, *, pad: int = 0, low: int = 1):
    """Two prompts of ``n`` token ids in ``[low, vocab)`` and their attention mask; the second row's first ``pad``
    positions are left padding (id 0, mask 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (2, n), generator=gen)
    mask = torch.ones_like(ids)
    if pad:
        mask[1, :pad] = 0
        ids[1, :pad] = 0
    return ids, mask


def within_budget(ours, truth, base, what):
    """:func:`qkv.testing.assert_within_budget`, after checking the reference and baseline are finite (a NaN or
    inf would make both errors infinite and the budget pass vacuously)."""
    from qkv.testing import assert_within_budget

    assert torch.isfinite(truth).all() and torch.isfinite(base).all(), f"{what}: non-finite reference or baseline"
    return assert_within_budget(ours, truth, base, what=what)


def float64_rope(model: nn.Module) -> nn.Module:
    """Make an HF model's RoPE a float64 reference in place and return the model: HF computes ``inv_freq`` and the
    cos/sin tables in float32 even in a float64 model (relative logit errors near 1e-7). This reruns HF's own RoPE
    initialisation (default, YaRN, ...) with ``torch.float`` / ``torch.float32`` meaning float64 for that call
    only, and computes the tables from those frequencies in float64, so the float64 model is a reference to the
    1e-8 that float64 parity asks."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    emb = model.model.rotary_emb
    init = emb.compute_default_rope_parameters if emb.rope_type == "default" else ROPE_INIT_FUNCTIONS[emb.rope_type]
    f, f32 = torch.float, torch.float32
    torch.float = torch.float32 = torch.float64
    try:
        inv_freq, scaling = init(emb.config)
    finally:
        torch.float, torch.float32 = f, f32
    assert inv_freq.dtype == torch.float64, inv_freq.dtype

    def forward(x, position_ids):
        freqs = position_ids[..., None].double() * inv_freq  # (B, N, R / 2)
        full = torch.cat((freqs, freqs), dim=-1)
        return (full.cos() * scaling).to(x.dtype), (full.sin() * scaling).to(x.dtype)

    emb.forward = forward
    return model


@contextlib.contextmanager
def float64_throughout():
    """Within the block, an HF float64 model stays float64 where its code casts to float32 (``.float()``,
    ``.to(torch.float32)``, ``softmax(..., dtype=torch.float32)``: RMSNorm, eager attention's softmax, RoPE), so
    its logits are a float64 reference (HF's float32 islands alone leave relative errors near 1e-7). Casts of other
    dtypes are untouched."""
    import torch.nn.functional as F

    to, flt, softmax = torch.Tensor.to, torch.Tensor.float, F.softmax

    def keep_to(self, *args, **kwargs):
        wants32 = kwargs.get("dtype") is torch.float32 or any(a is torch.float32 for a in args)
        if self.dtype == torch.float64 and wants32:
            rest = [a for a in args if a is not torch.float32]
            kwargs.pop("dtype", None)
            return to(self, *rest, **kwargs) if rest or kwargs else self
        return to(self, *args, **kwargs)

    def keep_float(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else flt(self, *args, **kwargs)

    def keep_softmax(x, *args, dtype=None, **kwargs):
        return softmax(x, *args, dtype=None if x.dtype == torch.float64 else dtype, **kwargs)

    torch.Tensor.to, torch.Tensor.float, F.softmax = keep_to, keep_float, keep_softmax
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, F.softmax = to, flt, softmax
