"""Kimi Linear on qkv: HF ``model_type`` ``"kimi_linear"``.

Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture" (arXiv:2510.26692). A hybrid
decoder: most layers are Kimi Delta Attention (KDA, :class:`qkv.nn.KimiDeltaAttention`: Gated DeltaNet's delta
rule with one decay per key channel, a short convolution, a recurrent state that does not grow with the
context), every few layers one is Multi-head Latent Attention (:class:`qkv.nn.LatentAttention`) *without
positions* (NoPE: the ``qk_rope_head_dim`` key part is shared by the heads but never rotated, so the model has no
RoPE at all and the softmax scale is ``(dn + dr) ** -0.5``), each followed by DeepSeek-V3's mixture of experts
(sigmoid scores, correction bias, ``n_group`` groups, shared experts; the first ``first_k_dense_replace`` layers
dense).

Config as transformers' ``KimiLinearConfig`` reads it (:mod:`qkv.config.hf_config`): a checkpoint's
``linear_attn_config`` gives the KDA shape and the layer pattern (``full_attn_layers``/``kda_layers``, counted
from 1); transformers' own names (``layer_types``, ``linear_num_heads``, ``num_local_experts``, ...) work too.

Tensor names: transformers' in memory (``self_attn.*`` for both kinds of layer, ``mlp.*``, stacked experts), or
the checkpoint files' (what Moonshot publishes and ``save_pretrained`` writes: ``block_sparse_moe.*``, experts one
by one as ``w1``/``w3``/``w2``, the KDA forget gate's ``f_a_proj``/``f_b_proj``/``dt_bias``/``A_log`` on the layer,
separate ``q_conv1d``/``k_conv1d``/``v_conv1d``), read as transformers' conversion does. KDA layers move to
``linear_attn.*``, where :class:`qkv.nn.DecoderLM` hosts recurrent mixers; the router's correction bias as in
DeepSeek-V3.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=4,
    ...     num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    ...     num_local_experts=8, num_experts_per_tok=2, pad_token_id=0,
    ...     linear_attn_config={"num_heads": 2, "head_dim": 8, "kda_layers": [1, 2, 4], "full_attn_layers": [3]}))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.hf_config import hf_defaults, read_latent, read_moe
from ..config.layer_types import LINEAR_ATTENTION
from ..nn import DecoderConfig, DecoderLM
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder, rename_router_bias
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["kimi_linear"] = "qkv.models.family_kimi_linear"


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF Kimi Linear config dict."""
    if cfg.get("model_type") != "kimi_linear":
        raise CheckpointError(f"family_kimi_linear: model_type {cfg.get('model_type')!r} is not kimi_linear")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":  # transformers uses it for the experts and the KDA convolution alike
        raise CheckpointError(f"from_hf: kimi_linear with hidden_act={act!r}: qkv's KDA convolution is SiLU only")
    try:
        full = hf_defaults(cfg)
        latent, moe = read_latent(full), read_moe(full)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a kimi_linear model from its config: {e}") from e
    return decoder_config_from(
        full, head_dim=None, hidden_act=act, latent=latent, moe=moe, position="none",
        rms_norm_eps=float(full.get("rms_norm_eps") or 1e-5),
        max_position_embeddings=int(full.get("model_max_length") or full.get("max_position_embeddings") or 1048576))


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


_FORGET_GATE = ("f_a_proj.", "f_b_proj.", "dt_bias", "A_log")
_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _transformers_names(state: dict[str, torch.Tensor], c: DecoderConfig) -> dict[str, torch.Tensor]:
    """Checkpoint-file names to transformers' in-memory ones (names already in memory form pass unchanged)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        head, sep, tail = name.partition(".self_attn.")
        if sep and tail.startswith(_FORGET_GATE):
            name = f"{head}.self_attn.forget_gate.{tail}"
            if tail == "A_log":  # one per head, kept as (1, 1, H, 1)
                t = t.reshape(1, 1, -1, 1)
        parts = name.split(".")
        if len(parts) > 3 and parts[-4] == "experts" and parts[-2] in _EXPERT:
            parts[-2] = _EXPERT[parts[-2]]
            name = ".".join(parts)
        out[name] = t
    for i, kind in enumerate(c.layer_types):
        if kind == LINEAR_ATTENTION:
            for prefix in (f"model.layers.{i}.self_attn.", f"layers.{i}.self_attn."):
                convs = [f"{prefix}{p}_conv1d.weight" for p in "qkv"]
                if any(n in out for n in convs):
                    missing = [n for n in convs if n not in out]
                    if missing:
                        raise CheckpointError(f"from_hf: the checkpoint lacks {missing} beside the other KDA "
                                              "convolution weights")
                    out[f"{prefix}conv1d.weight"] = torch.cat([out.pop(n) for n in convs])
    return out


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    c = decoder_config(config)
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    out = rename_router_bias(rename_decoder(_transformers_names(state, c), c, norms=norms))
    for i, kind in enumerate(c.layer_types):
        if kind == LINEAR_ATTENTION:
            old, new = f"layers.{i}.self_attn.", f"layers.{i}.linear_attn."
            for name in [n for n in out if n.startswith(old)]:
                out[new + name[len(old):]] = out.pop(name)
    return out
