"""GPT-OSS on qkv: HF ``model_type`` ``"gpt_oss"``.

OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card" (arXiv:2508.10925). A pre-norm
:class:`qkv.nn.DecoderLM` (RMSNorm, GQA, RoPE with YaRN scaling) with

- one learnable sink logit per query head in every softmax (``attention_sinks``, :mod:`qkv._sinks`);
- biases on all four attention projections;
- ``sliding_attention`` and ``full_attention`` layers alternating as ``layer_types`` says (HF's
  default when a config omits it: even layers sliding, odd layers full);
- a mixture of ``num_local_experts`` experts on every layer: a router with a bias picks the top
  ``num_experts_per_tok`` logits and softmaxes over those only (:func:`qkv.nn.moe.route_topk_softmax`);
  experts of width ``intermediate_size`` with biases and a clamped SwiGLU (``swiglu_limit``,
  ``swiglu_alpha``; :class:`qkv.nn.moe.ClampedSwiGLUExperts`); no shared expert.

Tensor names are HF's (``self_attn.sinks``, ``mlp.router``, ``mlp.experts.*``), q/k/v stacked as in
:mod:`qkv.models.family_llama`; HF's input-major experts with interleaved gate/up columns (``gate_up_proj``
(E, d, 2f), ``down_proj`` (E, f, d)) are stored output-major, gate rows then up rows (E, 2f, d), (E, d, f). Checkpoints
whose experts are stored MXFP4-quantized (``*_blocks`` / ``*_scales``, the published files) must be
dequantized first (load them with HF transformers and pass the model).

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...     num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.hf_config import read_moe
from ..config.layer_types import FULL_ATTENTION, SLIDING_ATTENTION
from ..nn import DecoderConfig, DecoderLM
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["gpt_oss"] = "qkv.models.family_gpt_oss"


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF GPT-OSS config dict."""
    if cfg.get("model_type") != "gpt_oss":
        raise CheckpointError(f"family_gpt_oss: model_type {cfg.get('model_type')!r} is not gpt_oss")
    if cfg.get("layer_types") is None and isinstance(cfg.get("num_hidden_layers"), int):
        cfg = {**cfg, "layer_types": [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION
                                      for i in range(cfg["num_hidden_layers"])]}
    try:
        moe = read_moe(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a gpt_oss model from its config: {e!r}") from e
    if moe is None:
        raise CheckpointError(f"from_hf: a gpt_oss config needs num_local_experts (every layer is a mixture of "
                              f"experts), got {cfg.get('num_local_experts')!r}")
    bias = bool(cfg.get("attention_bias", True))
    return decoder_config_from(cfg, qkv_bias=bias, o_bias=bias, attention_sinks=True, moe=moe)


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    quantized = sorted(n for n in state if n.endswith(("_blocks", "_scales")))
    if quantized:
        raise CheckpointError(f"from_hf: this gpt_oss checkpoint stores experts MXFP4-quantized ({quantized[0]}, ...); "
                              "load it with transformers (which dequantizes) and pass the model to from_hf")
    out = rename_decoder(state, decoder_config(config), norms={"input_layernorm": "attn_norm",
                                                              "post_attention_layernorm": "ffn_norm"})
    for name in [n for n in out if n.endswith(".mlp.experts.gate_up_proj")]:  # (E, d, 2f) interleaved
        w = out[name].transpose(1, 2)  # (E, 2f, d), rows gate0, up0, gate1, ...
        out[name] = torch.cat((w[:, 0::2], w[:, 1::2]), dim=1).contiguous()  # gate rows, then up rows
        b = out.get(f"{name}_bias")
        if b is not None:
            out[f"{name}_bias"] = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1).contiguous()
    for name in [n for n in out if n.endswith(".mlp.experts.down_proj")]:  # (E, f, d) -> (E, d, f)
        out[name] = out[name].transpose(1, 2).contiguous()
    return out
