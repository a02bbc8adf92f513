"""Qwen3 and Qwen3-MoE on qkv: HF ``model_type`` ``"qwen3"`` and ``"qwen3_moe"``.

Qwen Team 2025, "Qwen3 Technical Report" (arXiv:2505.09388). A Llama-shaped :class:`qkv.nn.DecoderLM`
(RMSNorm, RoPE, GQA, SwiGLU) with

- per-head RMSNorm of queries and keys before RoPE (``qk_norm``, as Gemma 3, weights used as they are);
- ``attention_bias`` on all four attention projections (False in every released checkpoint), an explicit
  ``head_dim``; sliding windows only with ``use_sliding_window`` (read by :func:`qkv.config.hf_config.read_layout`);
- Qwen3-MoE: every layer a mixture of ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, a
  softmax router keeping ``num_experts_per_tok`` (renormalized when ``norm_topk_prob``), no shared expert
  (:func:`qkv.nn.moe.route_softmax`).

Tensor names as :mod:`qkv.models.family_llama`; ``self_attn.q_norm`` / ``k_norm`` keep theirs; the router
``mlp.gate`` becomes ``mlp.router``, experts are stacked (from transformers 5's stacked tensors or the
per-expert tensors of checkpoints on disk).

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.hf_config import read_moe
from ..nn import DecoderConfig, DecoderLM, MoEConfig
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["qwen3"] = "qkv.models.family_qwen3"
FAMILIES["qwen3_moe"] = "qkv.models.family_qwen3"


def _moe(cfg: dict[str, Any]) -> MoEConfig | None:
    n = cfg.get("num_experts") or cfg.get("num_local_experts")  # config.json / transformers 5 names
    if cfg.get("model_type") != "qwen3_moe" or not n:
        return None
    if list(cfg.get("mlp_only_layers") or []) or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise CheckpointError(f"from_hf: qwen3_moe with dense layers (mlp_only_layers={cfg.get('mlp_only_layers')}, "
                              f"decoder_sparse_step={cfg.get('decoder_sparse_step')}) is not supported; qkv loads "
                              "the released layout, a mixture of experts on every layer")
    return read_moe(cfg)


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF Qwen3 / Qwen3-MoE config dict."""
    if cfg.get("model_type") not in ("qwen3", "qwen3_moe"):
        raise CheckpointError(f"family_qwen3: model_type {cfg.get('model_type')!r} is not qwen3 or qwen3_moe")
    bias = bool(cfg.get("attention_bias", False))
    try:
        moe = _moe(cfg)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"from_hf: cannot build a qwen3_moe model from its config: {e!r}") from e
    return decoder_config_from(cfg, hidden_act=cfg.get("hidden_act", "silu"), qkv_bias=bias, o_bias=bias,
                               qk_norm=True, moe=moe)


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return rename_decoder(state, decoder_config(config), norms={"input_layernorm": "attn_norm",
                                                             "post_attention_layernorm": "ffn_norm"})
