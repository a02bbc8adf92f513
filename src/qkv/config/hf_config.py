"""The one reader of an HF config's attention layout: which layers slide, over how many tokens, with which
RoPE, and the head and latent widths the KV cache holds, returned as the one model description,
:class:`qkv.config.DecoderConfig`. Pure Python (no torch); used alike by
:mod:`qkv.costs` (``preset_from_hf_config``, ``qkv memory``), :func:`qkv.cache.plan_memory` and the model
families of :mod:`qkv.models`, so the bytes planned are the bytes the built model caches.

A ``config.json`` often leaves keys out, and then HF's config class supplies them: a published Qwen2
checkpoint has no ``layer_types``, so HF derives them from ``use_sliding_window`` (default false) and
``max_window_layers`` (default 28); a Gemma 2 one has no ``head_dim`` (default 256). :func:`read_layout`
applies the same defaults and rules per ``model_type`` (``HF_DEFAULTS``), so its ``layer_types`` equal what
``transformers`` computes (its ``config.layer_types``) for dicts with or without them:

- ``layer_types`` given: used as is (the window only matters where a layer slides);
- Qwen2 / Qwen3: the window only when ``use_sliding_window``; then layers ``i >= max_window_layers`` slide;
- Gemma 2: local and global layers alternate, layer 0 local; Gemma 3: ``sliding_window_pattern - 1``
  local layers per global one (layer ``i`` global iff ``(i + 1) % pattern == 0``);
- DeepSeek-V3.2, GLM-5 (``glm_moe_dsa``): HF's ``"indexed_attention"`` layers (DeepSeek Sparse Attention) cache
  every token, so they read as ``"full_attention"``; the indexer's shape is :func:`read_indexer`'s, its cached
  key ``index_head_dim``;
- Llama, DeepSeek, GPT-2, BLOOM: no layer slides;
- other families (Mistral, Mixtral, ...): every layer slides when ``sliding_window`` is set, else none;
  a ``sliding_window_pattern`` key, where present, interleaves as Gemma 3 does;
- hybrid Qwen3-Next / Qwen3.5: ``"linear_attention"`` (Gated DeltaNet) layers, and every
  ``full_attention_interval``-th layer (default 4) ``"full_attention"`` when ``layer_types`` is absent; the
  recurrent layers' shape is :func:`read_linear_attention`'s (the description's ``linear_attention``);
- SmolLM3: NoPE layers (``no_rope_layers``, 0 where a layer has no RoPE; default every
  ``no_rope_layer_interval``-th layer) read as the description's ``nope_layers``; with ``use_sliding_window`` and no
  ``layer_types``, exactly those layers slide;
- hybrid OLMo-hybrid: Gated DeltaNet (``"linear_attention"``) layers with Qwen3.5's split projections, beta in
  ``[0, 2]`` (``linear_allow_neg_eigval``, default True), and every 4th layer full attention (the last one when
  there are fewer than 4 layers);
- hybrid Kimi Linear: KDA (``"linear_attention"``) and MLA layers from a checkpoint's ``linear_attn_config``
  (layers counted from 1), else transformers' default, layer ``i`` MLA when ``i > 0`` and ``i % 4 == 0``.

Multimodal configs are read from ``text_config`` (Gemma 3, Qwen3.5). RoPE per layer type (:func:`read_rope`):
transformers 5's ``rope_parameters`` (per layer type for Gemma 3), or ``rope_theta`` with ``rope_scaling``; Gemma 3's
older configs give local layers ``rope_local_base_freq`` without scaling. The MLA shape (:func:`read_latent`), the
mixture of experts (:func:`read_moe`), the recurrent layers (:func:`read_linear_attention`) and DeepSeek-V3.2's
lightning indexer (:func:`read_indexer`) are read here too, so no other module reads RoPE or HF names again.

A field that changes the attention layout and that this reader does not model is refused, never ignored
(``UNREAD_LAYOUT_FIELDS``): Llama 4's chunked attention (``attention_chunk_size``, HF's default 8192 when the
key is absent) and its NoPE layers (``no_rope_layers``, read for SmolLM3 only), GPT-Neo's ``attention_layers``,
Longformer's ``attention_window``, ModernBERT's ``global_attn_every_n_layers``; so are ``layer_types`` values other than
``"full_attention"`` and ``"sliding_attention"``.

Example:
    >>> cfg = {"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64,
    ...        "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}
    >>> read_layout(cfg).layer_types
    ('full_attention', 'full_attention', 'sliding_attention', 'sliding_attention')
    >>> read_layout({**cfg, "use_sliding_window": False}).sliding_window is None
    True
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from .config_file import read_json_config
from .decoder import DecoderConfig
from .dsa import IndexerConfig
from .latent import LatentConfig
from .layer_types import DECODER_LAYER_TYPES, FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION
from .linear import LinearAttentionConfig
from .moe import MoEConfig
from .qsa import QSAConfig
from .rope import RopeParams, rope_type_of

__all__ = ["read_layout", "read_rope", "read_latent", "read_moe", "read_linear_attention", "read_qsa",
           "read_indexer", "load_hf_config", "text_config",
           "hf_defaults", "declared_dtype", "description_dtype", "PUBLISHED_DTYPE", "HF_DEFAULTS",
           "UNREAD_LAYOUT_FIELDS", "FULL_ATTENTION", "SLIDING_ATTENTION"]

#: HF config defaults (``transformers``' config classes) for the keys a ``config.json`` may leave out.
HF_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "qwen2": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rope_theta": 10000.0},
    "gemma3_text": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6},
    "llama4_text": {"attention_chunk_size": 8192, "no_rope_layer_interval": 4},
    "gemma4_text": {"head_dim": 256, "sliding_window": 512, "sliding_window_pattern": 6,
                    "num_kv_shared_layers": 0, "attention_k_eq_v": False, "final_logit_softcapping": None,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                           "rope_theta": 1_000_000.0}}},
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"),
                    {"head_dim": 256, "partial_rotary_factor": 0.25, "full_attention_interval": 4}),
    "deepseek_v32": {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048},
    "qwen4_exp_text": {"head_dim": 256, "full_attention_interval": 4},
    "glm_moe_dsa": {"index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048},
    "smollm3": {"no_rope_layer_interval": 4, "use_sliding_window": False, "rope_theta": 2_000_000.0},
}
#: Hybrid families: their recurrent layers' mixer (:data:`qkv.config.linear.LINEAR_MIXERS`).
HYBRID_MIXERS = {"qwen3_next": "gated_deltanet", "qwen3_5_text": "gated_deltanet_split",
                 "qwen3_5_moe_text": "gated_deltanet_split", "kimi_linear": "kda",
                 "olmo_hybrid": "gated_deltanet_split", "qwen4_exp_text": "gated_deltanet_split"}

#: Layout fields this reader does not model, each with what it means; a config that sets one is refused.
UNREAD_LAYOUT_FIELDS: Mapping[str, str] = {
    "attention_chunk_size": "chunked attention (Llama 4: each token sees only its own chunk of this many tokens)",
    "no_rope_layers": "layers without RoPE (Llama 4's NoPE layers)",
    "attention_layers": "GPT-Neo's per-layer local/global attention",
    "attention_window": "Longformer's per-layer local windows",
    "global_attn_every_n_layers": "ModernBERT's interleaved global/local layers",
}
#: What HF's other ``layer_types`` values mean, for the refusal message.
_OTHER_LAYER_TYPES = {"chunked_attention": "Llama 4's chunked attention"}
#: HF's layer type of DeepSeek Sparse Attention layers (DeepSeek-V3.2): full attention as far as the cache goes.
INDEXED_ATTENTION = "indexed_attention"
_ALIASES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embd": "hidden_size",
            "n_embed": "hidden_size"}
_PERIOD = {"gemma2": 2}  # local:global interleave fixed by the modelling code
# families that never slide
_NO_WINDOW = frozenset({"llama", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "gpt2", "bloom",
                        "kimi_linear"})
_NOPE_MLA = frozenset({"kimi_linear"})  # families whose MLA layers rotate nothing
_READS_NOPE = frozenset({"smollm3"})  # families whose no_rope_layers is read (nope_layers), not refused
_LEARNED = frozenset({"gpt2", "gpt_bigcode", "opt"})  # families with a learned position table
_ALIBI = frozenset({"bloom"})  # families with ALiBi instead of positions


def _transformers_config(config) -> dict[str, Any] | None:
    """``config.to_dict()`` for a ``transformers.PretrainedConfig`` (only when transformers is already loaded)."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(config, transformers.PretrainedConfig):
        return config.to_dict()
    return None


def load_hf_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A config dict from a mapping, a ``transformers`` config object, a ``config.json`` path or a directory
    holding one."""
    if isinstance(config, Mapping):
        return dict(config)
    as_dict = _transformers_config(config)
    if as_dict is not None:
        return as_dict
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"HF config: expected a dict, a transformers config, a config.json path or a checkpoint "
                        f"directory, got {type(config).__name__}")
    path = os.path.join(config, "config.json") if os.path.isdir(config) else os.fspath(config)
    return read_json_config(path)


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: ``text_config`` for multimodal ones (Gemma 3), with HF's
    short names (``n_layer``, ``n_head``, ``n_embd``) under their long ones. ``model_type`` ``gemma3``
    (multimodal) reads as ``gemma3_text``."""
    cfg = config
    if "num_hidden_layers" not in config and "n_layer" not in config and isinstance(config.get("text_config"),
                                                                                   Mapping):
        cfg = {"model_type": config.get("model_type"), **config["text_config"]}
    out = {_ALIASES.get(k, k): v for k, v in cfg.items()}
    for long in _ALIASES.values():  # the long name wins where both are present
        if long in cfg:
            out[long] = cfg[long]
    if out.get("model_type") in ("gemma3", "gemma4", "llama4", "qwen3_5", "qwen3_5_moe", "qwen4_exp"):
        out["model_type"] += "_text"
    return out


def hf_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with HF's defaults (``HF_DEFAULTS`` of its ``model_type``) filled in for absent keys; a Kimi Linear
    config's ``linear_attn_config`` read as transformers reads it (:func:`_kimi_linear_fields`)."""
    out = {**HF_DEFAULTS.get(config.get("model_type") or "", {}), **config}
    return _kimi_linear_fields(out) if out.get("model_type") == "kimi_linear" else out


def _kimi_linear_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Kimi Linear as transformers' ``KimiLinearConfig`` reads it: a checkpoint's ``linear_attn_config`` gives the
    KDA shape (``num_heads``, ``head_dim``, ``short_conv_kernel_size`` over ``linear_num_heads``,
    ``linear_head_dim``, ``linear_conv_kernel_dim``) and, unless ``layer_types`` is given, the layer pattern
    (``full_attn_layers`` and ``kda_layers``, counted from 1); without either, layer ``i`` is MLA when ``i > 0`` and
    ``i % 4 == 0``, KDA otherwise (transformers' default, which is not the released checkpoint's pattern)."""
    sub = cfg.get("linear_attn_config") or {}
    for ours, theirs in (("linear_num_heads", "num_heads"), ("linear_head_dim", "head_dim"),
                         ("linear_conv_kernel_dim", "short_conv_kernel_size")):
        if sub.get(theirs) is not None:
            cfg[ours] = sub[theirs]
    n = cfg.get("num_hidden_layers")
    if cfg.get("layer_types") is None and isinstance(n, int) and n > 0:
        if "full_attn_layers" in sub and "kda_layers" in sub:
            types: list[str | None] = [None] * n
            for kind, key in ((FULL_ATTENTION, "full_attn_layers"), (LINEAR_ATTENTION, "kda_layers")):
                for layer in sub[key]:
                    if not isinstance(layer, int) or not 1 <= layer <= n:
                        raise ValueError(f"kimi_linear: linear_attn_config[{key!r}] counts layers from 1 to {n}, "
                                         f"got {layer!r}")
                    types[layer - 1] = kind
            if None in types:
                raise ValueError(f"kimi_linear: linear_attn_config names neither full_attn_layers nor kda_layers for "
                                 f"layers {[i + 1 for i, t in enumerate(types) if t is None]} (counted from 1)")
            cfg["layer_types"] = types
        else:
            cfg["layer_types"] = [FULL_ATTENTION if i and i % 4 == 0 else LINEAR_ATTENTION for i in range(n)]
    return cfg


#: The dtype a description of a published model (a preset, an HF config declaring none) is costed in: the
#: dtype checkpoints ship and serve in.
PUBLISHED_DTYPE = "bfloat16"


def description_dtype(config) -> str:
    """The one default dtype of a model description (``plan_memory`` and the ``qkv memory``/``compare`` CLI
    use it when no dtype is given): the dtype an HF config declares (:func:`declared_dtype`) for a config
    dict, a ``transformers`` config or a ``config.json`` path; otherwise (a preset name, a
    :class:`qkv.config.ModelPreset`, a config declaring none) :data:`PUBLISHED_DTYPE`, bfloat16.

    Example:
        >>> description_dtype({"torch_dtype": "float32"}), description_dtype("llama-3-8b")
        ('float32', 'bfloat16')
    """
    if isinstance(config, Mapping) or _transformers_config(config) is not None or (
            isinstance(config, (str, os.PathLike)) and os.path.exists(config)):
        return declared_dtype(config) or PUBLISHED_DTYPE
    return PUBLISHED_DTYPE


def declared_dtype(config) -> str | None:
    """The dtype an HF config declares (``dtype``, or transformers 4's ``torch_dtype``), as a name such as
    ``"bfloat16"``; None when it declares none. Multimodal configs: the top level's, else ``text_config``'s."""
    cfg = load_hf_config(config)
    for part in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else {}):
        for key in ("dtype", "torch_dtype"):
            value = part.get(key)
            if value is not None and str(value) != "auto":
                return str(value).removeprefix("torch.")
    return None


def _int(cfg: Mapping[str, Any], key: str, source: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{source}: {key} must be a positive int, got {v!r}")
    return v


def _layer_types(cfg: Mapping[str, Any], n: int, source: str) -> tuple[tuple[str, ...], int | None]:
    model_type = cfg.get("model_type") or ""
    window = cfg.get("sliding_window")
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"] or model_type in _NO_WINDOW:
        window = None
    given = cfg.get("layer_types")
    if given is not None:
        types = tuple(FULL_ATTENTION if t == INDEXED_ATTENTION else t for t in given)
        unknown = sorted(set(types) - set(DECODER_LAYER_TYPES))
        if unknown:
            what = "".join(f" ({_OTHER_LAYER_TYPES[t]})" for t in unknown if t in _OTHER_LAYER_TYPES)
            raise ValueError(f"{source}: layer types {unknown}{what} not supported; known "
                             f"{', '.join(map(repr, DECODER_LAYER_TYPES))}")
        if len(types) != n:
            raise ValueError(f"{source}: layer_types has {len(types)} entries for {n} layers")
        if LINEAR_ATTENTION in types and model_type not in HYBRID_MIXERS:
            raise ValueError(f"{source}: {LINEAR_ATTENTION!r} layers are read for {sorted(HYBRID_MIXERS)} only (the "
                             f"recurrent mixer of {model_type or 'this model type'} is not known)")
    elif model_type in HYBRID_MIXERS:  # HF: every full_attention_interval-th layer is full attention
        every = cfg.get("full_attention_interval") or 4
        types = tuple(FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(n))
        if model_type == "olmo_hybrid" and FULL_ATTENTION not in types:  # HF: at least the last layer attends
            types = types[:-1] + (FULL_ATTENTION,)
    elif window is None:
        types = (FULL_ATTENTION,) * n
    elif "max_window_layers" in cfg:  # Qwen2/Qwen3: the first max_window_layers layers stay global
        first = cfg["max_window_layers"]
        types = tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(n))
    else:
        period = _PERIOD.get(model_type) or cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        types = (tuple(FULL_ATTENTION if (i + 1) % period == 0 else SLIDING_ATTENTION for i in range(n)) if period
                 else (SLIDING_ATTENTION,) * n)
    if SLIDING_ATTENTION not in types:
        return types, None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"{source}: sliding layers need a positive sliding_window, got {window!r}")
    return types, window


def _rope_entry(params: Mapping[str, Any] | None, cfg: Mapping[str, Any]) -> RopeParams:
    params = dict(params or {})
    factor = float(params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    return RopeParams(theta=theta, scaling=None if rope_type_of(params) == "default" else params,
                      partial_rotary_factor=factor)


def _ropes(cfg: Mapping[str, Any], types: tuple[str, ...]) -> dict[str, RopeParams]:
    params = cfg.get("rope_parameters")
    out = {}
    for kind in dict.fromkeys(t for t in (FULL_ATTENTION, *types) if t != LINEAR_ATTENTION):  # recurrent: no RoPE
        if isinstance(params, Mapping) and set(params) & {FULL_ATTENTION, SLIDING_ATTENTION}:
            entry = params.get(kind) or params.get(FULL_ATTENTION)
            out[kind] = _rope_entry(entry, cfg)
        elif params is not None:
            out[kind] = _rope_entry(params, cfg)
        elif kind == SLIDING_ATTENTION and cfg.get("rope_local_base_freq") is not None:  # Gemma 3 before v5
            out[kind] = RopeParams(theta=float(cfg["rope_local_base_freq"]))
        else:
            out[kind] = _rope_entry(cfg.get("rope_scaling"), cfg)
    return out


def read_rope(config, layer_types: tuple[str, ...] = ()) -> dict[str, RopeParams]:
    """RoPE per layer type of an HF config (a dict, a ``transformers`` config, a path): ``"full_attention"``
    and each of ``layer_types``. Only the RoPE keys are read, so encoder configs (BERT, T5 shapes) work too.

    Example:
        >>> read_rope({"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})["full_attention"]
        RopeParams(theta=500000.0, scaling={'rope_type': 'linear', 'factor': 2.0}, interleaved=False, \
partial_rotary_factor=1.0)
    """
    return _ropes(hf_defaults(text_config(load_hf_config(config))), tuple(layer_types))


def read_latent(config) -> LatentConfig:
    """The Multi-head Latent Attention shape of an HF DeepSeek-V2/V3 or Kimi Linear config (a dict, a
    ``transformers`` config, a path). RoPE comes from :func:`read_rope` (DeepSeek's YaRN ``mscale_all_dim``
    included); Kimi Linear's MLA has none (``use_rope=False``: transformers runs it without positions; a
    config saying ``mla_use_nope: false`` is refused, since transformers would ignore it).

    Example:
        >>> cfg = {"hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24}
        >>> read_latent(cfg).q_lora_rank
        24
    """
    cfg = hf_defaults(text_config(load_hf_config(config)))
    rope = _ropes(cfg, ())[FULL_ATTENTION]
    nope = cfg.get("model_type") in _NOPE_MLA
    if nope and cfg.get("mla_use_nope") is False:
        raise ValueError(f"read_latent({cfg['model_type']}): mla_use_nope=False asks for rotated MLA keys, but "
                         "transformers runs this family's MLA without positions whatever the config says; refused "
                         "rather than guessed")
    kw: dict[str, Any] = {name: cfg[name] for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                        "max_position_embeddings") if cfg.get(name) is not None}
    return LatentConfig(hidden_size=cfg.get("hidden_size"), num_attention_heads=cfg.get("num_attention_heads"),
                        kv_lora_rank=cfg.get("kv_lora_rank"), q_lora_rank=cfg.get("q_lora_rank"),
                        attention_bias=bool(cfg.get("attention_bias", False)),
                        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0), rope_theta=rope.theta,
                        rope_scaling=dict(rope.scaling) if rope.scaling and not nope else None, use_rope=not nope,
                        **kw)


def read_moe(config) -> MoEConfig | None:
    """The mixture-of-experts feed-forward of an HF config (None when it has no routed experts), for every family
    qkv loads: DeepSeek-V2 (softmax, greedy or group-limited), DeepSeek-V3 and Kimi Linear (sigmoid ``noaux_tc``
    with the correction bias), Qwen3-MoE (``num_experts``, softmax), Qwen3-Next (softmax and a shared expert scaled
    by a sigmoid gate), GPT-OSS (``num_local_experts``, softmax over the top logits, a router bias, clamped SwiGLU
    experts) and Gemma 4 26B-A4B (``enable_moe_block``: experts beside the dense MLP). Raises ``ValueError`` for a
    routing rule qkv does not run.

    Example:
        >>> read_moe({"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}).n_routed_experts
        8
        >>> read_moe({"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2,
        ...           "intermediate_size": 32}).topk_method
        'topk_softmax'
    """
    cfg = text_config(load_hf_config(config))
    model_type = cfg.get("model_type")
    if model_type == "gpt_oss":
        if not cfg.get("num_local_experts"):
            return None
        return MoEConfig(n_routed_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                         moe_intermediate_size=cfg["intermediate_size"], topk_method="topk_softmax", router_bias=True,
                         swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                         swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))
    if model_type == "kimi_linear":
        return _kimi_moe(cfg)
    if model_type in ("gemma4_text", "gemma4"):  # 26B-A4B: experts beside the dense MLP on every layer
        if not cfg.get("enable_moe_block"):
            return None
        fields = ("num_experts", "top_k_experts", "moe_intermediate_size")
        bad = {k: cfg.get(k) for k in fields
               if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool) or cfg[k] < 1}
        if bad:
            raise ValueError(f"gemma4 with enable_moe_block=True needs {list(fields)} as positive ints; got {bad}")
        return MoEConfig(n_routed_experts=cfg["num_experts"], num_experts_per_tok=cfg["top_k_experts"],
                         moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=True, beside_dense=True)
    if model_type in ("qwen3_next", "qwen3_5_moe_text", "qwen4_exp_text"):  # Qwen2-MoE's block: softmax top-k, one
        q35 = model_type == "qwen3_5_moe_text"  # gated shared expert
        n = cfg.get("num_experts", 256 if q35 else 512)
        if not n:
            return None
        return MoEConfig(n_routed_experts=n,
                         num_experts_per_tok=cfg.get("num_experts_per_tok", 8 if q35 else 10),
                         moe_intermediate_size=cfg.get("moe_intermediate_size", 512),
                         # Qwen3.5-MoE always renormalizes (HF reads no norm_topk_prob for it)
                         norm_topk_prob=q35 or bool(cfg.get("norm_topk_prob", True)),
                         n_shared_experts=1,
                         shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 512),
                         shared_expert_gate=True)
    if model_type == "qwen3_moe":
        n = cfg.get("num_experts") or cfg.get("num_local_experts")  # config.json / transformers 5 names
        if not n:
            return None
        return MoEConfig(n_routed_experts=n, num_experts_per_tok=cfg["num_experts_per_tok"],
                         moe_intermediate_size=cfg["moe_intermediate_size"],
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if model_type == "mistral4":  # softmax scores, groups by their two best, renormalized (HF's Mistral4TopkRouter)
        return MoEConfig(
            n_routed_experts=cfg["n_routed_experts"], num_experts_per_tok=cfg.get("num_experts_per_tok") or 4,
            moe_intermediate_size=cfg["moe_intermediate_size"], n_shared_experts=cfg.get("n_shared_experts") or 0,
            first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0), topk_method="group_limited_top2",
            n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
    if not cfg.get("n_routed_experts"):
        return None
    v3 = model_type in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if v3 and (method != "noaux_tc" or (cfg.get("scoring_func") or "sigmoid") != "sigmoid"):
        raise ValueError(f"{model_type} routes with topk_method='noaux_tc' and sigmoid scores; this config says "
                         f"topk_method={method!r}, scoring_func={cfg.get('scoring_func')!r}")
    return MoEConfig(
        n_routed_experts=cfg["n_routed_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"], n_shared_experts=cfg.get("n_shared_experts") or 0,
        first_k_dense_replace=cfg.get("first_k_dense_replace") or 0, moe_layer_freq=cfg.get("moe_layer_freq") or 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0), topk_method=method,
        n_group=cfg.get("n_group") or (1 if v3 else None), topk_group=cfg.get("topk_group") or (1 if v3 else None),
        # transformers' DeepSeek-V2 router never renormalizes (it reads no norm_topk_prob; the released V2 configs
        # say false): from_hf follows the model it converts
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if v3 else False)


#: Kimi Linear's mixture of experts: (checkpoint name, transformers' attribute name, transformers' default).
_KIMI_MOE = {"n_routed_experts": ("num_experts", "num_local_experts", 256),
             "num_experts_per_tok": ("num_experts_per_token", "num_experts_per_tok", 8),
             "n_shared_experts": ("num_shared_experts", "n_shared_experts", 1),
             "n_group": ("num_expert_group", "n_group", 1),
             "topk_group": ("topk_group", "topk_group", 1),
             "norm_topk_prob": ("moe_renormalize", "norm_topk_prob", True),
             "moe_intermediate_size": ("moe_intermediate_size", "moe_intermediate_size", 1024),
             "routed_scaling_factor": ("routed_scaling_factor", "routed_scaling_factor", 2.446)}


def _kimi_moe(cfg: Mapping[str, Any]) -> MoEConfig:
    """Kimi Linear: DeepSeek-V3's routing (sigmoid scores, correction bias, groups) under checkpoint names
    (``num_experts``, ``num_expert_group``, ``moe_renormalize``, ...) or transformers' (``num_local_experts``,
    ``n_group``, ``norm_topk_prob``, ...), with transformers' defaults. MoE layers: ``mlp_layer_types`` (``"dense"``
    then ``"sparse"``), else the first ``first_k_dense_replace`` (default 1) stay dense."""
    source = "read_moe(kimi_linear)"
    kw: dict[str, Any] = {}
    for ours, (saved, hf_name, default) in _KIMI_MOE.items():
        value = cfg.get(saved, cfg.get(hf_name))
        kw[ours] = default if value is None else value
    activation = cfg.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise ValueError(f"{source}: transformers routes Kimi Linear with sigmoid scores; this config says "
                         f"moe_router_activation_func={activation!r}")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{source}: moe_layer_freq={cfg['moe_layer_freq']} (an MoE every few layers) is ignored by "
                         "transformers' Kimi Linear, so which layers route is ambiguous; refused")
    n = cfg.get("num_hidden_layers")
    types = cfg.get("mlp_layer_types")
    if types is not None:
        types = tuple(types)
        dense = types.count("dense")
        if set(types) - {"dense", "sparse"} or types != ("dense",) * dense + ("sparse",) * (len(types) - dense) or (
                n is not None and len(types) != n):
            raise ValueError(f"{source}: mlp_layer_types must be {n} entries, 'dense' ones first then 'sparse' "
                             f"(the layout qkv's MoEConfig describes), got {_short(list(types))}")
    else:
        dense = cfg.get("first_k_dense_replace", 1)
    return MoEConfig(n_routed_experts=kw["n_routed_experts"], num_experts_per_tok=kw["num_experts_per_tok"],
                     moe_intermediate_size=kw["moe_intermediate_size"], n_shared_experts=kw["n_shared_experts"],
                     first_k_dense_replace=dense, routed_scaling_factor=float(kw["routed_scaling_factor"]),
                     topk_method="noaux_tc", n_group=kw["n_group"], topk_group=kw["topk_group"],
                     norm_topk_prob=bool(kw["norm_topk_prob"]))


def read_linear_attention(config) -> LinearAttentionConfig | None:
    """The recurrent mixer of a hybrid config's ``"linear_attention"`` layers (Qwen3-Next: ``gated_deltanet``;
    Qwen3.5: ``gated_deltanet_split``; Kimi Linear: ``kda``), HF's defaults for absent keys; None for other model
    types.

    Example:
        >>> read_linear_attention({"model_type": "qwen3_next", "linear_num_value_heads": 64}).linear_num_value_heads
        64
    """
    cfg = hf_defaults(text_config(load_hf_config(config)))
    mixer = HYBRID_MIXERS.get(cfg.get("model_type") or "")
    if mixer is None:
        return None
    if cfg.get("model_type") != "olmo_hybrid":
        return LinearAttentionConfig.from_hf(cfg, mixer=mixer)
    # OLMo-hybrid: HF's defaults derive from the attention shape; beta in [0, 2] unless turned off; norm eps 1e-5
    heads = cfg.get("linear_num_key_heads") or cfg.get("num_attention_heads")
    key_dim = cfg.get("linear_key_head_dim") or (int(0.75 * cfg["hidden_size"] / heads)
                                                 if cfg.get("hidden_size") and heads else None)
    return LinearAttentionConfig.from_hf(
        {**cfg, "linear_num_key_heads": heads,
         "linear_num_value_heads": cfg.get("linear_num_value_heads") or cfg.get("num_attention_heads"),
         "linear_key_head_dim": key_dim,
         "linear_value_head_dim": cfg.get("linear_value_head_dim") or (2 * key_dim if key_dim else None)},
        mixer=mixer, allow_neg_eigval=bool(cfg.get("linear_allow_neg_eigval", True)), norm_eps=1e-5)


def read_indexer(config) -> IndexerConfig | None:
    """DeepSeek Sparse Attention's lightning indexer of an HF config (DeepSeek-V3.2: ``index_n_heads``,
    ``index_head_dim``, ``index_topk``), or None for a config without one. HF's ``DeepseekV32Config`` defaults
    (64, 128, 2048) fill in absent keys of a ``deepseek_v32`` config; another config must give all three.

    Example:
        >>> read_indexer({"model_type": "deepseek_v32"}).index_topk
        2048
        >>> read_indexer({"model_type": "deepseek_v3"}) is None
        True
    """
    cfg = hf_defaults(text_config(load_hf_config(config)))
    names = ("index_n_heads", "index_head_dim", "index_topk")
    if not any(cfg.get(n) is not None for n in names):
        return None
    missing = [n for n in names if cfg.get(n) is None]
    if missing:
        raise ValueError(f"read_indexer({cfg.get('model_type')}): an indexer needs {', '.join(names)}; missing "
                         f"{', '.join(missing)}")
    # GLM-5 rotates its indexer's RoPE channels in interleaved pairs, DeepSeek-V3.2 in halves
    return IndexerConfig(**{n: cfg[n] for n in names}, interleaved_rope=cfg.get("model_type") == "glm_moe_dsa")


def _gemma4_layout(cfg: Mapping[str, Any], types: tuple[str, ...], source: str) -> dict[str, Any]:
    """Gemma 4's per-layer-type attention shapes and cross-layer KV sharing, as :class:`DecoderConfig` fields.

    Global (``full_attention``) layers have heads of ``global_head_dim`` and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads`` KV heads (a config from ``transformers``' ``to_dict()`` states them per layer in
    ``per_layer_config`` instead); with ``attention_k_eq_v`` their keys serve as values. The last
    ``num_kv_shared_layers`` layers each read the keys and values of the last earlier layer of their type that
    computes its own (``transformers``' ``kv_sharing_modes``)."""
    k_eq_v = bool(cfg.get("attention_k_eq_v"))
    if isinstance(cfg.get("per_layer_config"), Mapping):  # to_dict(): the layers that differ, the others as stated
        # keys are layer indices as strings, zero-padded to the widest index ('05' of 12 layers): read them as ints
        per_layer = {int(k): v for k, v in cfg["per_layer_config"].items()}
        full_dim, full_kv = cfg.get("head_dim"), cfg.get("num_key_value_heads")
    else:  # config.json: transformers' defaults for the global layers
        per_layer, full_dim = {}, cfg.get("global_head_dim") or 512
        full_kv = (cfg.get("num_global_key_value_heads") if k_eq_v else None) or cfg.get("num_key_value_heads")
    dims, kvs = set(), set()
    for i, t in enumerate(types):
        if t != FULL_ATTENTION:
            continue
        over = per_layer.get(i) or {}
        dims.add(over.get("head_dim", full_dim))
        kvs.add(over.get("num_key_value_heads", full_kv))
    if len(dims) > 1 or len(kvs) > 1:
        raise ValueError(f"{source}: the global layers differ in head_dim {sorted(dims)} or KV heads {sorted(kvs)}; "
                         "qkv models one shape per layer type")
    out: dict[str, Any] = {"head_dim_by_type": {}, "kv_heads_by_type": {},
                           "k_eq_v_types": (FULL_ATTENTION,) if k_eq_v else ()}
    if dims:
        out["head_dim_by_type"][FULL_ATTENTION] = int(dims.pop())
        out["kv_heads_by_type"][FULL_ATTENTION] = int(kvs.pop() or cfg.get("num_attention_heads"))
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    if shared:
        out["kv_shared_from"] = kv_share_sources(types, shared, source)
    return out


def kv_share_sources(types: tuple[str, ...], shared: int, source: str = "kv_share_sources") -> tuple[int | None, ...]:
    """Gemma 4's cross-layer KV sharing (``transformers``' ``num_kv_shared_layers``): the last ``shared`` layers each
    read the keys and values of the last earlier layer of their type that computes its own; per layer, that source's
    index, or None for a layer that computes its own.

    Example:
        >>> kv_share_sources(("s", "f", "s", "s", "f"), 2)
        (None, None, None, 2, 1)
    """
    n = len(types)
    first = n - shared
    sources = {t: max((j for j in range(first) if types[j] == t), default=None) for t in set(types)}
    missing = sorted(t for t, j in sources.items() if j is None)
    if first <= 0 or missing:
        raise ValueError(f"{source}: num_kv_shared_layers={shared} of {n} layers leaves no earlier layer of type "
                         f"{missing or sorted(set(types))} to share keys and values from")
    return tuple(None if i < first else sources[types[i]] for i in range(n))


def read_qsa(config) -> QSAConfig | None:
    """Qwen4-Exp's QSA indexer of an HF config (``indexer_n_heads``, ``indexer_kv_heads`` = 1,
    ``indexer_head_dim``, ``indexer_budget``, ``indexer_compress_ratio``), or None for a config without one.

    Example:
        >>> read_qsa({"model_type": "qwen4_exp_text", "indexer_n_heads": 8, "indexer_kv_heads": 1,
        ...           "indexer_head_dim": 128, "indexer_budget": 2048, "indexer_compress_ratio": 64}).block_topk
        32
    """
    cfg = text_config(load_hf_config(config))
    names = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    if not any(cfg.get(n) is not None for n in names):
        return None
    missing = [n for n in names if cfg.get(n) is None]
    if missing:
        raise ValueError(f"read_qsa({cfg.get('model_type')}): a QSA indexer needs {', '.join(names)}; missing "
                         f"{', '.join(missing)}")
    if cfg["indexer_kv_heads"] != 1:
        raise ValueError(f"read_qsa({cfg.get('model_type')}): QSA's indexer has one key head (indexer_kv_heads=1), "
                         f"got indexer_kv_heads={cfg['indexer_kv_heads']}")
    return QSAConfig(index_n_heads=cfg["indexer_n_heads"], index_head_dim=cfg["indexer_head_dim"],
                     budget=cfg["indexer_budget"], block=cfg["indexer_compress_ratio"])


def _refuse_unread(cfg: Mapping[str, Any], source: str) -> None:
    """Raise for a layout field this reader does not model (``UNREAD_LAYOUT_FIELDS``)."""
    cfg = dict(cfg)
    if cfg.get("model_type") == "llama4_text" and cfg.get("no_rope_layers") is None:  # HF's default: NoPE every 4th
        interval = cfg.get("no_rope_layer_interval") or 4
        cfg["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(cfg.get("num_hidden_layers") or 0)]
    for key, what in UNREAD_LAYOUT_FIELDS.items():
        value = cfg.get(key)
        if value is None or value is False:
            continue
        if key == "no_rope_layers" and (cfg.get("model_type") in _READS_NOPE
                                        or isinstance(value, list) and all(v == 1 for v in value)):
            continue  # read by _nope_layers; or HF's 1 everywhere, "every layer uses RoPE": nothing to model
        raise ValueError(f"{source}: {key}={_short(value)} sets {what}, which qkv does not model; read as plain "
                         "layers the layout (and the cache bytes) would be wrong, so the config is refused")


def _nope_layers(cfg: dict[str, Any], n: int, source: str) -> tuple[int, ...]:
    """The layers without RoPE of a family in ``_READS_NOPE`` (HF ``no_rope_layers``: 1 rotates, 0 does not;
    absent: every ``no_rope_layer_interval``-th layer unrotated), filling in SmolLM3's ``layer_types`` when absent
    (HF slides exactly the NoPE layers when ``use_sliding_window``). ``()`` for other families."""
    if cfg.get("model_type") not in _READS_NOPE:
        return ()
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = cfg.get("no_rope_layer_interval")
        if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
            raise ValueError(f"{source}: no_rope_layer_interval must be a positive int, got {every!r}")
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(flags, (list, tuple)) or len(flags) < n or any(f not in (0, 1) for f in flags):
        raise ValueError(f"{source}: no_rope_layers must list 1 (RoPE) or 0 (NoPE) for each of the {n} layers, got "
                         f"{_short(flags)}")
    nope = tuple(i for i in range(n) if not flags[i])
    if cfg.get("layer_types") is None:
        slides = bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None
        cfg["layer_types"] = [SLIDING_ATTENTION if slides and i in nope else FULL_ATTENTION for i in range(n)]
    return nope


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_layout(config: str | os.PathLike | Mapping[str, Any]) -> DecoderConfig:
    """The attention layout of an HF decoder config as the one model description, a :class:`DecoderConfig`: a
    ``config.json`` dict (``transformers``' ``config.to_dict()`` works too), its path, or a checkpoint directory.

    What it reads: layer types and window, heads and widths, RoPE per layer type, the MLA latent and DSA indexer,
    the recurrent layers' mixer, and ``vocab_size`` / ``intermediate_size`` where the config states them (else
    None: a description of the attention only). A family's other switches (norms, biases, activations, experts)
    are its family file's to add (:func:`qkv.models.hf.decoder_config`).

    Missing ``num_key_value_heads`` means MHA; missing ``head_dim`` means HF's default for the family, else
    ``hidden_size // num_attention_heads`` (``qk_nope_head_dim + qk_rope_head_dim`` for MLA). See the module
    notes for the layer types.

    Raises:
        ValueError: a required field is missing or malformed, naming it.
    """
    raw = load_hf_config(config)
    cfg = hf_defaults(text_config(raw))
    source = f"read_layout({cfg.get('model_type') or 'no model_type'})"
    _refuse_unread(cfg, source)
    mla = cfg.get("kv_lora_rank") is not None
    required = ("num_hidden_layers", "num_attention_heads") + (("qk_rope_head_dim", "qk_nope_head_dim") if mla else ())
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}")
    n = _int(cfg, "num_hidden_layers", source)
    heads = _int(cfg, "num_attention_heads", source)
    if mla:
        head_dim = _int(cfg, "qk_nope_head_dim", source) + _int(cfg, "qk_rope_head_dim", source)
    elif cfg.get("head_dim") is not None:
        head_dim = _int(cfg, "head_dim", source)
    elif cfg.get("hidden_size") is not None:
        head_dim = _int(cfg, "hidden_size", source) // heads
    else:
        raise ValueError(f"{source}: needs head_dim or hidden_size")
    nope = _nope_layers(cfg, n, source)
    types, window = _layer_types(cfg, n, source)
    model_type = cfg.get("model_type") or ""
    if model_type == "gemma4_text" and types and types[-1] != FULL_ATTENTION:  # transformers forces it global
        types = (*types[:-1], FULL_ATTENTION)
    hidden = cfg.get("hidden_size") or heads * head_dim  # a config stating head_dim only: Hq * head_dim
    latent = read_latent(cfg) if mla else None
    position = ("none" if latent is not None and not latent.use_rope else "learned" if model_type in _LEARNED
                else "alibi" if model_type in _ALIBI else "rope")
    try:
        return DecoderConfig(
            vocab_size=cfg.get("vocab_size"), hidden_size=hidden, num_hidden_layers=n, num_attention_heads=heads,
            intermediate_size=cfg.get("intermediate_size"), num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=None if mla else head_dim, layer_types=types, sliding_window=window, rope=_ropes(cfg, types),
            nope_layers=nope,
            position=position, max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048), latent=latent,
            indexer=read_indexer(cfg) if mla else None, qsa=None if mla else read_qsa(cfg),
            linear_attention=read_linear_attention(cfg) if LINEAR_ATTENTION in types else None, name=model_type,
            **(_gemma4_layout(cfg, types, source) if model_type == "gemma4_text" else {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from e
