"""Qwen3-Next and Qwen3.5 on qkv: HF ``model_type`` ``"qwen3_next"``, ``"qwen3_5_text"``, ``"qwen3_5_moe_text"``,
and ``"qwen3_5"`` / ``"qwen3_5_moe"`` (the multimodal checkpoints, whose language model is read from their
``text_config``; the vision tower is not loaded).

Hybrid decoders (Qwen Team 2025, "Qwen3-Next" model card; "Qwen3.5"): three recurrent layers per
full-attention layer (HF ``layer_types``, or every ``full_attention_interval``-th layer full):

- ``linear_attention`` layers: Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025, arXiv:2412.06464;
  :class:`qkv.nn.GatedDeltaNet`), its state in the KV cache under a ``RecurrentSpec``. Qwen3-Next projects
  ``in_proj_qkvz`` / ``in_proj_ba`` grouped per key head; Qwen3.5 ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a`` (:class:`qkv.nn.SplitGatedDeltaNet`);
- ``full_attention`` layers: gated attention: HF's ``q_proj`` gives each head's query and an output gate side by
  side; the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj`` (``attn_output_gate``); per-head
  QK RMSNorm; RoPE on the first ``partial_rotary_factor`` (0.25) of each head's channels;
- every RMSNorm scales by ``1 + weight`` (Gemma's form, ``norm_offset=1``), the gated norm inside the mixer
  excepted;
- feed-forward: Qwen3-Next a mixture of ``num_experts`` experts on every layer (softmax top-k, renormalized
  with ``norm_topk_prob``) plus one shared expert of ``shared_expert_intermediate_size`` scaled by
  ``sigmoid(shared_expert_gate(x))``; Qwen3.5 (text) a dense SwiGLU MLP; Qwen3.5-MoE Qwen3-Next's mixture, its
  top-k weights always renormalized.

Qwen3.5's multimodal RoPE (``mrope_section``) gives a text token the same position on its three axes, which is
plain RoPE, so text-only decoding needs nothing more.

Tensor names: as :mod:`qkv.models.family_llama` for attention and MLP (``q_proj`` is split into query rows and
gate rows, the gate rows going last in ``qkv_proj``); ``linear_attn.*`` keep HF's names; ``mlp.gate`` (the
router) becomes ``mlp.router``, ``mlp.shared_expert`` ``mlp.shared_experts``. Multi-token-prediction weights
(``mtp.*``), which HF does not load either, are dropped.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    ...     num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    ...     linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
    ...     moe_intermediate_size=32, shared_expert_intermediate_size=32))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.hf_config import read_moe, text_config
from ..config.layer_types import FULL_ATTENTION
from ..nn import DecoderConfig, DecoderLM, MoEConfig
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config", "language_model_state", "split_query_gates"]

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
_MULTIMODAL = ("qwen3_5", "qwen3_5_moe")
for _t in MODEL_TYPES:
    FAMILIES[_t] = "qkv.models.family_qwen3_next"


def _moe(cfg: dict[str, Any]) -> MoEConfig | None:
    if cfg.get("model_type") == "qwen3_5_moe_text":  # every layer a mixture (HF reads no layer switches)
        return read_moe(cfg)
    if cfg.get("model_type") != "qwen3_next":
        return None
    if list(cfg.get("mlp_only_layers") or []) or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise CheckpointError(f"from_hf: qwen3_next with dense layers (mlp_only_layers={cfg.get('mlp_only_layers')}, "
                              f"decoder_sparse_step={cfg.get('decoder_sparse_step')}) is not supported; qkv loads "
                              "the released layout, a mixture of experts on every layer")
    return read_moe(cfg)


def _text(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` of a ``qwen3_5`` / ``qwen3_5_moe`` config (the outer config
    decides tying, as HF's model does), the config itself otherwise."""
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise CheckpointError(f"family_qwen3_next: model_type {kind!r} is not one of {MODEL_TYPES}")
    if kind not in _MULTIMODAL:
        return dict(cfg)
    if not isinstance(cfg.get("text_config"), dict):
        raise CheckpointError(f"from_hf: a {kind} config needs its language model's text_config (a dict), got "
                              f"{type(cfg.get('text_config')).__name__}")
    text = text_config(cfg)
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF Qwen3-Next, Qwen3.5 text or Qwen3.5 config dict."""
    text = _text(cfg)
    if text.get("model_type") == "qwen3_5_text" and text.get("intermediate_size") is None:
        text["intermediate_size"] = 12288  # HF's default
    try:
        moe = _moe(text)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"from_hf: cannot build a qwen3_next model from its config: {e!r}") from e
    if text.get("model_type") == "qwen3_next" and text.get("intermediate_size") is None:
        text["intermediate_size"] = 5632  # HF's default (the dense MLP of mlp_only_layers, unused when all are MoE)
    if text.get("model_type") == "qwen3_5_moe_text":  # no dense MLP at all: the field is unused
        text["intermediate_size"] = moe.moe_intermediate_size
    text.setdefault("head_dim", 256)
    bias = bool(text.get("attention_bias", False))
    return decoder_config_from(text, partial_rotary=True, hidden_act=text.get("hidden_act", "silu"), qkv_bias=bias,
                               o_bias=bias, qk_norm=True, norm_offset=1.0, attn_output_gate=True, moe=moe)


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def language_model_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen3.5 multimodal checkpoint's language model under ``model.`` (vision and MTP weights dropped)."""
    out = {}
    for name, t in state.items():
        if name.startswith(("mtp.", "model.visual.", "visual.")):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        out[name] = t
    return out


def split_query_gates(src: dict[str, torch.Tensor], c: DecoderConfig) -> dict[str, torch.Tensor]:
    """Gated attention's ``q_proj`` (each head's query rows, then its gate rows) split in place into the query rows
    (left under ``q_proj``) and the gate rows, returned under the ``qkv_proj`` name they join last (Qwen3-Next,
    Qwen3.5, Qwen4-Exp)."""
    H, D = c.num_attention_heads, c.head_dim
    gates: dict[str, torch.Tensor] = {}
    for i, kind in enumerate(c.layer_types):
        if kind != FULL_ATTENTION:
            continue
        for suffix in (".weight", ".bias"):
            name = f"model.layers.{i}.self_attn.q_proj{suffix}"
            if name not in src:
                continue
            t = src[name]
            if t.shape[0] != 2 * H * D:
                raise CheckpointError(f"from_hf: {name} has {t.shape[0]} rows; gated attention needs 2 * heads * "
                                      f"head_dim = {2 * H * D} (each head's query, then its gate)")
            q, g = t.reshape(H, 2, D, *t.shape[1:]).unbind(1)  # per head: D query rows, then D gate rows
            src[name] = q.reshape(H * D, *t.shape[1:])
            gates[f"layers.{i}.self_attn.qkv_proj{suffix}"] = g.reshape(H * D, *t.shape[1:])
    return gates


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    c = decoder_config(config)
    src = language_model_state(state)
    gates = split_query_gates(src, c)
    for name in [n for n in src if ".mlp.shared_expert." in n]:
        src[name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")] = src.pop(name)
    out = rename_decoder(src, c, norms={"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"})
    for name, g in gates.items():
        if name in out:
            out[name] = torch.cat([out[name], g])
    return out
