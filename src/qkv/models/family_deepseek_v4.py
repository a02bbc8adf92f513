"""DeepSeek-V4 on qkv: HF ``model_type`` ``"deepseek_v4"``.

DeepSeek-AI 2026, "DeepSeek-V4" technical report. One :class:`qkv.nn.DecoderLM` with:

- attention (:class:`qkv.nn.compressed_attention.CompressedAttention`, HF ``layer_types``): ``sliding_attention``
  (a window only), ``compressed_sparse_attention`` (CSA: overlapping compressed windows and a lightning indexer) and
  ``heavily_compressed_attention`` (HCA), one KV head with K = V, partial interleaved RoPE on the last channels
  (``rope_parameters["main"]`` on sliding layers, ``["compress"]`` on the others, YaRN there), sinks, a grouped
  low-rank output projection;
- residual: manifold-constrained hyper-connections (:mod:`qkv.nn.hyper`, ``hc_mult`` streams), HF's ``attn_hc`` /
  ``ffn_hc`` per layer and ``hc_head`` for the model;
- feed-forward: DeepSeekMoE on every layer with sqrt-softplus routing, the ``hash_moe`` layers routed by the token id
  (``tid2eid``), experts and the shared expert clamped at ``swiglu_limit`` (:mod:`qkv.nn.moe`).

Refused (``CheckpointError`` naming the field): another ``scoring_func`` than ``sqrtsoftplus``, another activation
than SiLU, ``n_shared_experts`` other than 1, biases, more than one KV head, ``o_groups`` not dividing the heads'
width, compression rates that are not positive ints, layer types V4 does not define. The model runs without a KV
cache (see :mod:`qkv.nn.compressed_attention`).

Tensor names: ``model.`` dropped; ``input_layernorm`` / ``post_attention_layernorm`` -> ``attn_norm`` /
``ffn_norm``; ``attn_hc`` / ``ffn_hc`` -> ``attn_residual`` / ``ffn_residual``; ``hc_head.hc_{fn,base,scale}`` ->
``residual.{fn,base,scale}``; ``self_attn.compressor.indexer.scorer.weights_proj`` ->
``self_attn.compressor.indexer.weights_proj``; the router ``mlp.gate.{weight, e_score_correction_bias, tid2eid}``
-> ``mlp.{router.weight, e_score_correction_bias, tid2eid}``; the shared expert's gate and up stacked.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    ...     head_dim=32, q_lora_rank=24, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
    ...     index_n_heads=4, index_head_dim=16, index_topk=4, sliding_window=8,
    ...     compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.compressed import CompressedAttentionConfig
from ..config.hyper import HyperConfig
from ..config.layer_types import SLIDING_ATTENTION
from ..config.rope import RopeParams
from ..nn import DecoderConfig, DecoderLM, MoEConfig
from .hf import stack_tensors
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["deepseek_v4"] = "qkv.models.family_deepseek_v4"

_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
_ROPE_KEYS = ("rope_theta", "partial_rotary_factor")


def _rope(params: Any, which: str) -> RopeParams:
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise CheckpointError(f"from_hf: deepseek_v4 rope_parameters[{which!r}] must be a dict with rope_theta, got "
                              f"{params!r}")
    scaling = {k: v for k, v in params.items() if k not in _ROPE_KEYS}
    plain = scaling.get("rope_type", "default") == "default"
    return RopeParams(theta=float(params["rope_theta"]), scaling=None if plain else scaling, interleaved=True)


def _layer_kinds(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if not isinstance(types, (list, tuple)) or len(types) != n or any(t not in _KINDS for t in types):
        raise CheckpointError(f"from_hf: deepseek_v4 layer_types must list one of {sorted(_KINDS)} per layer "
                              f"({n} layers), got {types!r}")
    return tuple(_KINDS[t] for t in types)


def _rates(cfg: dict[str, Any]) -> dict[str, int]:
    given = cfg.get("compress_rates") or {}
    rates = {}
    for hf_name, kind in (("compressed_sparse_attention", "csa"), ("heavily_compressed_attention", "hca")):
        r = given.get(hf_name)
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise CheckpointError(f"from_hf: deepseek_v4 compress_rates[{hf_name!r}] must be a positive int (tokens "
                                  f"per compressed entry), got {r!r}")
        rates[kind] = r
    return rates


def _refuse(cfg: dict[str, Any]) -> None:
    checks = (("scoring_func", cfg.get("scoring_func", "sqrtsoftplus"), "sqrtsoftplus"),
              ("hidden_act", cfg.get("hidden_act", "silu"), "silu"),
              ("n_shared_experts", cfg.get("n_shared_experts", 1), 1),
              ("attention_bias", bool(cfg.get("attention_bias", False)), False),
              ("mlp_bias", bool(cfg.get("mlp_bias", False)), False),
              ("num_key_value_heads", cfg.get("num_key_value_heads", 1), 1))
    for name, seen, want in checks:
        if seen != want:
            raise CheckpointError(f"from_hf: deepseek_v4 {name}={seen!r} is not supported (qkv builds V4 with "
                                  f"{name}={want!r})")


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF DeepSeek-V4 config dict; ``CheckpointError`` naming what is wrong."""
    if cfg.get("model_type") != "deepseek_v4":
        raise CheckpointError(f"family_deepseek_v4: model_type {cfg.get('model_type')!r} is not deepseek_v4")
    _refuse(cfg)
    try:
        n, D = int(cfg["num_hidden_layers"]), int(cfg["head_dim"])
        kinds = _layer_kinds(cfg, n)
        mlp_types = list(cfg.get("mlp_layer_types") or ["moe"] * n)
        if len(mlp_types) != n or any(t not in ("moe", "hash_moe") for t in mlp_types):
            raise CheckpointError(f"from_hf: deepseek_v4 mlp_layer_types must list 'moe' or 'hash_moe' per layer, "
                                  f"got {mlp_types!r}")
        ropes = cfg.get("rope_parameters") or {}
        compressed = CompressedAttentionConfig(
            attention_types=kinds, q_lora_rank=cfg["q_lora_rank"], o_groups=cfg["o_groups"],
            o_lora_rank=cfg["o_lora_rank"], qk_rope_head_dim=int(D * float(cfg["partial_rotary_factor"])),
            index_n_heads=cfg["index_n_heads"], index_head_dim=cfg["index_head_dim"], index_topk=cfg["index_topk"],
            compress_rates=_rates(cfg), main_rope=_rope(ropes.get("main"), "main"),
            compress_rope=_rope(ropes.get("compress"), "compress"))
        moe = MoEConfig(n_routed_experts=cfg["n_routed_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                        moe_intermediate_size=cfg["moe_intermediate_size"], n_shared_experts=1,
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                        topk_method="sqrtsoftplus", norm_topk_prob=True,
                        hash_layers=tuple(i for i, t in enumerate(mlp_types) if t == "hash_moe"),
                        silu_limit=float(cfg["swiglu_limit"]))
        hyper = HyperConfig(hc_mult=cfg["hc_mult"], hc_sinkhorn_iters=cfg["hc_sinkhorn_iters"],
                            hc_eps=float(cfg["hc_eps"]))
        return DecoderConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_hidden_layers=n,
            num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=1, head_dim=D,
            intermediate_size=cfg["moe_intermediate_size"], rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            position="none", attention_sinks=True, sliding_window=cfg["sliding_window"],
            layer_types=(SLIDING_ATTENTION,) * n, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048), moe=moe, compressed=compressed,
            hyper=hyper, name="deepseek_v4")
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a deepseek_v4 model from its config: {e}") from e


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V4 tensor names to :class:`qkv.nn.DecoderLM` names (module notes)."""
    c = decoder_config(config)
    src = {k.removeprefix("model."): v for k, v in state.items() if not k.endswith("inv_freq")}
    if c.tie_word_embeddings:
        src.pop("lm_head.weight", None)
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in (("fn", "hc_fn"), ("base", "hc_base"), ("scale", "hc_scale")):
        if f"hc_head.{theirs}" in src:
            out[f"residual.{ours}"] = src.pop(f"hc_head.{theirs}")
    for i in range(c.num_hidden_layers):
        layer = f"layers.{i}."
        moves = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.compressor.indexer.scorer.weights_proj.weight":
                     "self_attn.compressor.indexer.weights_proj.weight",
                 "mlp.gate.weight": "mlp.router.weight",
                 "mlp.gate.e_score_correction_bias": "mlp.e_score_correction_bias", "mlp.gate.tid2eid": "mlp.tid2eid"}
        for hc, ours in (("attn_hc", "attn_residual"), ("ffn_hc", "ffn_residual")):
            moves.update({f"{hc}.{p}": f"{ours}.{p}" for p in ("fn", "base", "scale")})
        for theirs, ours in moves.items():
            if layer + theirs in src:
                out[layer + ours] = src.pop(layer + theirs)
        shared = stack_tensors(src, f"{layer}mlp.shared_experts.", ("gate_proj", "up_proj"), ".weight")
        if shared is not None:
            out[f"{layer}mlp.shared_experts.gate_up_proj.weight"] = shared
    out.update(src)
    return out
