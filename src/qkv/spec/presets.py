"""Attention shapes of published models: one registry read by the CLI, the benchmarks and the tests.

Field names follow HF ``transformers`` configs. ``layer_types`` uses HF's values, ``"full_attention"``
(global), ``"sliding_attention"`` (local, at most ``sliding_window`` tokens visible and cached,
HF's convention: the window counts the token itself) and ``"linear_attention"`` (recurrent: a fixed state,
shaped by ``linear_attention``, Qwen3-Next / Qwen3.5 / Kimi Linear). Every number is cited in the preset's
``source``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .config import DecoderConfig
from .config_file import check_layout_fields, read_json_config
from .hf_config import read_indexer, read_layout, read_moe
from .layer_types import FULL_ATTENTION, LAYER_KIND, LINEAR_ATTENTION, SLIDING_ATTENTION
from .linear import LinearAttentionConfig

__all__ = ["AMBIGUOUS", "PRESETS", "ModelPreset", "get_preset", "preset_from_hf_config", "require_whole_model"]

FULL, SLIDING = FULL_ATTENTION, SLIDING_ATTENTION
_LAYER_KIND = LAYER_KIND


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """The attention shape of a model: everything the KV-cache and attention-FLOP arithmetic needs.

    Args:
        name: lowercase-hyphen slug (``"llama-3-70b"``).
        num_hidden_layers: attention layers.
        num_attention_heads: query heads ``Hq``.
        num_key_value_heads: key/value heads ``Hkv`` (``= Hq`` MHA, ``1`` MQA, else GQA). For MLA, the
            heads the latent expands to (``= Hq`` in DeepSeek-V2).
        head_dim: query/key head width ``Dqk``; for MLA ``qk_nope_head_dim + qk_rope_head_dim``.
        hidden_size: model width (informational; not always ``Hq * head_dim``, e.g. Gemma).
        sliding_window: tokens a local layer sees and caches, the token itself included.
        layer_types: one HF layer type per layer. ``None`` means every layer is local when
            ``sliding_window`` is set (Mistral 7B v0.1) and global otherwise; resolved at construction.
        kv_lora_rank: MLA latent width ``d_c``; setting it makes the preset MLA.
        qk_rope_head_dim: MLA decoupled RoPE key width ``d_h^R``, cached once per token (shared by heads).
        qk_nope_head_dim: MLA per-head key width without RoPE.
        v_head_dim: value head width ``Dv`` when it differs from ``head_dim``.
        source: citation for the numbers (paper, model card, config).
        notes: caveats.
        vocab_size, intermediate_size: token vocabulary and feed-forward width (needed, with the fields
            below, only by :func:`qkv.costs.num_parameters` and the whole-model FLOPs).
        mlp: ``"gated"`` (three matrices: SwiGLU/GeGLU) or ``"dense"`` (two: GPT-2, the 2017 Transformer).
        norm: ``"rms"`` (a scale per channel) or ``"layer"`` (scale and shift).
        attention_bias: biases on the query, key, value and output projections (GPT-2, BERT);
            ``qkv_bias``: on query, key and value only (Qwen2). ``mlp_bias``: on the feed-forward.
        qk_norm: per-head RMSNorm of queries and keys (Gemma 3). ``sandwich_norms``: a norm after
            each branch too (Gemma 2/3).
        qk_norm_scope: ``"head"`` (Gemma 3, Qwen3: one ``head_dim`` norm each for queries and keys) or
            ``"projection"`` (OLMo 2/3: one norm over the whole query projection, one over the key one).
        pre_norms: each branch's input is normalized (False: OLMo 2/3, post-norm only; set ``sandwich_norms``).
        attention_sinks: one learnable sink logit per query head and layer (GPT-OSS).
        router_bias: the mixture-of-experts router has a bias (GPT-OSS).
        linear_attention: the recurrent mixer of the ``"linear_attention"`` layers of a hybrid model (a
            :class:`qkv.spec.linear.LinearAttentionConfig`); set exactly when such layers exist. Their state
            (the short convolution's last inputs, a ``(Dk, Dv)`` matrix per head in float32) is per sequence,
            flat in the context.
        mla_use_nope: the MLA layers rotate nothing (NoPE, Kimi Linear; the checkpoints' name).
        tie_word_embeddings: the LM head is the embedding matrix.
        learned_positions: rows of a learned absolute position table (GPT-2: 1024), else none.
        max_position_embeddings: the longest context the released checkpoint is configured for (HF's
            ``max_position_embeddings``, GPT-2's ``n_positions``); ``None`` when none is stated. The
            arithmetic runs at any context; the CLI warns past this one.
        encoder_layers: layers of a bidirectional encoder in front of the ``num_hidden_layers``
            decoder layers, each of which then also cross-attends (encoder-decoder, Vaswani et al.).
        q_lora_rank: MLA query compression width (DeepSeek-V2: 1536).
        index_n_heads, index_head_dim, index_topk: DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2;
            HF names): each MLA layer also caches an ``index_head_dim`` key per token and attends to
            ``index_topk`` latents per query.
        n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts, first_k_dense_replace:
            DeepSeekMoE feed-forward (HF names); the first ``first_k_dense_replace`` layers stay dense with
            ``intermediate_size``.
        shared_expert_intermediate_size, shared_expert_gate: Qwen3-Next's shared expert: its width (default
            ``moe_intermediate_size * n_shared_experts``) and a sigmoid gate ``d -> 1`` scaling its output.
        linear_attention: the recurrent mixer of the ``"linear_attention"`` layers (a
            :class:`qkv.spec.linear.LinearAttentionConfig`); their cache is a fixed state per sequence.
        attn_output_gate: the attention output is gated by ``sigmoid`` of a second query-sized projection
            (Qwen3-Next, Qwen3.5: ``q_proj`` twice as tall).

    Example:
        >>> p = PRESETS["gemma-3-27b"]
        >>> p.attention_kind, p.layer_counts
        ('gqa', {'global': 10, 'local': 52})
    """

    name: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    source: str = ""
    notes: str = ""
    # Whole-model shape (for parameter counts and whole-model FLOPs in qkv.costs.params/model_flops).
    vocab_size: int | None = None
    intermediate_size: int | None = None
    mlp: str = "gated"
    norm: str = "rms"
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    tie_word_embeddings: bool = False
    learned_positions: int | None = None
    max_position_embeddings: int | None = None
    encoder_layers: int = 0
    q_lora_rank: int | None = None
    n_routed_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    qk_norm_scope: str = "head"
    pre_norms: bool = True
    attention_sinks: bool = False
    router_bias: bool = False
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    linear_attention: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    mla_use_nope: bool = False
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        for field in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.name}: {field} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.name}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", (SLIDING if self.sliding_window else FULL,) * n)
        types = tuple(self.layer_types)
        object.__setattr__(self, "layer_types", types)
        if len(types) != n or not set(types) <= {FULL, SLIDING, LINEAR_ATTENTION}:
            raise ValueError(
                f"{self.name}: layer_types must hold {n} entries from {FULL!r}, {SLIDING!r}, {LINEAR_ATTENTION!r}; "
                f"got {len(types)} entries {sorted(set(types))}"
            )
        if (LINEAR_ATTENTION in types) != (self.linear_attention is not None):
            raise ValueError(f"{self.name}: {LINEAR_ATTENTION!r} layers need linear_attention (their recurrent "
                             f"mixer's shape) and linear_attention needs such layers; got "
                             f"{types.count(LINEAR_ATTENTION)} layers, linear_attention={self.linear_attention!r}")
        if self.mla_use_nope and self.kv_lora_rank is None:
            raise ValueError(f"{self.name}: mla_use_nope describes MLA layers; set kv_lora_rank or drop it")
        if SLIDING in types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"{self.name}: sliding layers need a positive sliding_window")
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(f"{self.name}: MLA needs both kv_lora_rank and qk_rope_head_dim")
        mpe = self.max_position_embeddings
        if mpe is not None and (not isinstance(mpe, int) or isinstance(mpe, bool) or mpe <= 0):
            raise ValueError(f"{self.name}: max_position_embeddings must be a positive int or None, got {mpe!r}")
        if self.mlp not in ("gated", "dense") or self.norm not in ("rms", "layer"):
            raise ValueError(f"{self.name}: mlp must be 'gated' or 'dense' and norm 'rms' or 'layer', got "
                             f"mlp={self.mlp!r}, norm={self.norm!r}")
        if self.qk_norm_scope not in ("head", "projection"):
            raise ValueError(f"{self.name}: qk_norm_scope must be 'head' or 'projection', got {self.qk_norm_scope!r}")
        indexer = (self.index_n_heads, self.index_head_dim, self.index_topk)
        if any(v is not None for v in indexer) and (
                self.kv_lora_rank is None or not all(isinstance(v, int) and v > 0 for v in indexer)):
            raise ValueError(f"{self.name}: a lightning indexer needs MLA (kv_lora_rank) and positive index_n_heads, "
                             f"index_head_dim, index_topk; got {indexer}")
        if (self.n_routed_experts is None) != (self.num_experts_per_tok is None):
            raise ValueError(f"{self.name}: a mixture of experts needs both n_routed_experts and "
                             "num_experts_per_tok")

    @property
    def attention_kind(self) -> str:
        """``"mla"``, ``"mha"``, ``"mqa"`` or ``"gqa"``."""
        if self.kv_lora_rank is not None:
            return "mla"
        if self.num_key_value_heads == self.num_attention_heads:
            return "mha"
        return "mqa" if self.num_key_value_heads == 1 else "gqa"

    @property
    def value_head_dim(self) -> int:
        """``Dv``: ``v_head_dim`` if set, else ``head_dim``."""
        return self.v_head_dim or self.head_dim

    @property
    def layer_counts(self) -> dict[str, int]:
        """Layers per kind, ``{"global": n, "local": m, "recurrent": r}``, kinds with no layer left out."""
        counts = {kind: self.layer_types.count(t) for t, kind in _LAYER_KIND.items()}
        return {kind: c for kind, c in counts.items() if c}

    @property
    def config(self) -> DecoderConfig:
        """This model as a :class:`qkv.spec.DecoderConfig`: the description :class:`qkv.nn.DecoderLM` builds and
        ``qkv.nn.get_config(name)`` returns (whole-model presets only).

        What a preset does not record takes the family's usual value
        (:func:`qkv.spec.config.decoder_config_from_preset`).

        Raises:
            ValueError: an encoder-decoder preset, or one that describes attention only.

        Example:
            >>> c = PRESETS["gemma-3-27b"].config
            >>> c.layer_types.count("full_attention"), c.qk_norm, c.tie_word_embeddings
            (10, True, True)
        """
        from .config import decoder_config_from_preset  # the conversion, beside DecoderConfig

        return decoder_config_from_preset(self)

    @property
    def description(self) -> DecoderConfig:
        """What this preset states, as the one model description (:class:`qkv.spec.DecoderConfig`): the whole model
        where it has the whole-model fields (then equal to :attr:`config`), else the attention only
        (``vocab_size``/``intermediate_size`` None); an encoder-decoder's decoder stack. What the cache and the
        mixer registry (:mod:`qkv.spec.mixers`) read of a preset. ``ValueError`` for the one shape a description
        cannot hold: value heads narrower than key heads without MLA (an MLA preset's :meth:`mha_equivalent`).

        Example:
            >>> PRESETS["llama-70b-mha"].description.num_key_value_heads
            64
        """
        from .config import decoder_config_from_preset

        return decoder_config_from_preset(self, stated=True)

    @classmethod
    def from_config(cls, config: DecoderConfig, *, source: str = "", notes: str = "") -> ModelPreset:
        """The preset of a :class:`qkv.spec.DecoderConfig`, so :mod:`qkv.costs` counts any description (its
        parameter count equals the built model's). ``ValueError`` for what the cost arithmetic does not count.

        Example:
            >>> from qkv.spec import get_config
            >>> ModelPreset.from_config(get_config("tiny-gemma")).layer_counts
            {'global': 2, 'local': 2}
        """
        c = config
        if not isinstance(c, DecoderConfig):
            raise TypeError(f"ModelPreset.from_config: expected a qkv.spec.DecoderConfig, got {type(c).__name__}")
        uncounted = [f for f, bad in (("embed_norm", c.embed_norm), ("o_bias without qkv_bias", c.o_bias and
                                      not c.qkv_bias), ("moe_layer_freq != 1", c.moe and c.moe.moe_layer_freq != 1))
                     if bad]
        defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                    for f in dataclasses.fields(c) if f.init and not (f.default is f.default_factory is
                                                                      dataclasses.MISSING)}
        uncounted += [f"{name}={getattr(c, name)!r}" for name, default in defaults.items()  # fields added later
                      if name not in _COUNTED_FIELDS and getattr(c, name) != default]
        if uncounted:
            raise ValueError(f"ModelPreset.from_config: {c.name or 'the config'} has {', '.join(uncounted)}, which "
                             "qkv.costs does not count; count such a model from its built parameters")
        kw: dict[str, Any] = dict(
            name=c.name or "config", num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_size=c.hidden_size,
            sliding_window=c.sliding_window if SLIDING in c.layer_types else None, layer_types=c.layer_types,
            source=source, notes=notes, vocab_size=c.vocab_size, intermediate_size=c.intermediate_size,
            mlp="gated" if c.gated_mlp else "dense", norm=c.norm, attention_bias=c.o_bias,
            qkv_bias=c.qkv_bias and not c.o_bias, mlp_bias=c.mlp_bias, qk_norm=c.qk_norm,
            qk_norm_scope=c.qk_norm_scope, pre_norms=c.pre_norms, attention_sinks=c.attention_sinks,
            sandwich_norms=c.sandwich_norms, tie_word_embeddings=c.tie_word_embeddings,
            learned_positions=c.max_position_embeddings if c.position == "learned" else None,
            max_position_embeddings=c.max_position_embeddings)
        if c.latent is not None:
            lat = c.latent
            kw.update(num_key_value_heads=c.num_attention_heads, head_dim=lat.qk_head_dim,
                      kv_lora_rank=lat.kv_lora_rank, qk_rope_head_dim=lat.qk_rope_head_dim,
                      qk_nope_head_dim=lat.qk_nope_head_dim, v_head_dim=lat.v_head_dim, q_lora_rank=lat.q_lora_rank)
        if c.indexer is not None:
            kw.update(index_n_heads=c.indexer.index_n_heads, index_head_dim=c.indexer.index_head_dim,
                      index_topk=c.indexer.index_topk)
        if c.moe is not None:
            m = c.moe
            kw.update(n_routed_experts=m.n_routed_experts, num_experts_per_tok=m.num_experts_per_tok,
                      moe_intermediate_size=m.moe_intermediate_size, n_shared_experts=m.n_shared_experts,
                      first_k_dense_replace=m.first_k_dense_replace, router_bias=m.router_bias,
                      shared_expert_intermediate_size=m.shared_expert_intermediate_size,
                      shared_expert_gate=m.shared_expert_gate)
        kw.update(linear_attention=c.linear_attention, attn_output_gate=c.attn_output_gate)
        if c.latent is not None and not c.latent.use_rope:
            kw["mla_use_nope"] = True
        return cls(**kw)

    def mha_equivalent(self) -> ModelPreset:
        """The same model with one key/value head per query head and no latent compression.

        For MLA this is the expanded cache: per head a ``head_dim`` key and a ``value_head_dim`` value.

        Example:
            >>> PRESETS["llama-3-70b"].mha_equivalent().num_key_value_heads
            64
        """
        return dataclasses.replace(
            self,
            name=f"{self.name} (MHA-equivalent)",
            num_key_value_heads=self.num_attention_heads,
            kv_lora_rank=None,
            qk_rope_head_dim=None,
            qk_nope_head_dim=None,
            mla_use_nope=False,
            index_n_heads=None,
            index_head_dim=None,
            index_topk=None,
            notes=f"{self.name} with one KV head per query head",
        )


def require_whole_model(preset: ModelPreset, what: str) -> None:
    """Raise a ValueError when ``preset`` lacks the fields a whole-model count needs."""
    missing = [f for f in ("vocab_size", "intermediate_size") if getattr(preset, f) is None]
    if preset.n_routed_experts is not None and preset.moe_intermediate_size is None:
        missing.append("moe_intermediate_size")
    if missing:
        raise ValueError(
            f"{what}: preset {preset.name!r} describes attention only (missing {', '.join(missing)}); use a "
            "preset listed with a parameter count by `qkv presets`, or a full HF config.json"
        )


#: DecoderConfig fields :meth:`ModelPreset.from_config` counts or that change no count; any other field set
#: away from its default is refused, so a field added to the description is never silently miscounted.
_COUNTED_FIELDS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "num_key_value_heads", "head_dim", "hidden_act", "gated_mlp", "norm", "rms_norm_eps", "layer_norm_eps",
    "norm_offset", "position", "embed_norm", "scale_embeddings", "sandwich_norms", "qkv_bias", "o_bias", "mlp_bias",
    "qk_norm", "qk_norm_scope", "pre_norms", "attention_sinks", "attention_scale", "attn_logit_softcapping",
    "final_logit_softcapping", "tie_word_embeddings",
    "sliding_window", "layer_types", "rope", "max_position_embeddings", "latent", "moe", "indexer", "backend",
    "decode_backend", "name", "linear_attention", "attn_output_gate",
})


def _pattern(num_layers: int, period: int) -> tuple[str, ...]:
    """HF's interleave: layer ``i`` is global iff ``(i + 1) % period == 0`` (Gemma 2: period 2)."""
    return tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(num_layers))


# Open models of 2025 (issue 25), preset format 1: every number is the published config.json's, as cited.
_GPT_OSS = dict(num_attention_heads=64, num_key_value_heads=8, head_dim=64, hidden_size=2880, sliding_window=128,
                vocab_size=201088, intermediate_size=2880, moe_intermediate_size=2880, num_experts_per_tok=4,
                attention_bias=True, mlp_bias=True, attention_sinks=True, router_bias=True,
                max_position_embeddings=131072)
_QWEN3 = dict(head_dim=128, vocab_size=151936, qk_norm=True, max_position_embeddings=40960)
_OLMO = dict(qk_norm=True, qk_norm_scope="projection", pre_norms=False, sandwich_norms=True)
_QWEN_HYBRID = dict(head_dim=256, qk_norm=True, attn_output_gate=True, max_position_embeddings=32768)


def _hybrid(num_layers: int, interval: int) -> tuple[str, ...]:
    """HF Qwen3-Next / Qwen3.5: layer ``i`` is full attention iff ``(i + 1) % interval == 0``, else recurrent."""
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))
_PRESETS_2025 = (
    ModelPreset(
        name="gpt-oss-20b", num_hidden_layers=24, layer_types=_pattern(24, 2), n_routed_experts=32, **_GPT_OSS,
        source="OpenAI 2025, gpt-oss-120b & gpt-oss-20b Model Card, arXiv:2508.10925; openai/gpt-oss-20b "
        "config.json (preset format 1)",
        notes="Local (window 128) and global layers alternate, layer 0 local; a learned sink logit per head; "
        "32 experts with biases, 4 per token, router with a bias; YaRN x32 from 4096 to 131072. The MXFP4 "
        "checkpoint stores experts in 4.25 bits.",
    ),
    ModelPreset(
        name="gpt-oss-120b", num_hidden_layers=36, layer_types=_pattern(36, 2), n_routed_experts=128, **_GPT_OSS,
        source="OpenAI 2025, gpt-oss-120b & gpt-oss-20b Model Card, arXiv:2508.10925; openai/gpt-oss-120b "
        "config.json (preset format 1)",
        notes="As gpt-oss-20b with 36 layers and 128 experts.",
    ),
    ModelPreset(
        name="qwen3-8b", num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
        intermediate_size=12288, **_QWEN3,
        source="Qwen Team 2025, Qwen3 Technical Report, arXiv:2505.09388, Table 1; Qwen/Qwen3-8B config.json "
        "(preset format 1)",
        notes="Per-head QK RMSNorm; context 40960 (32K native, 128K with YaRN).",
    ),
    ModelPreset(
        name="qwen3-32b", num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, hidden_size=5120,
        intermediate_size=25600, **_QWEN3,
        source="Qwen Team 2025, Qwen3 Technical Report, arXiv:2505.09388, Table 1; Qwen/Qwen3-32B config.json "
        "(preset format 1)",
        notes="Per-head QK RMSNorm; context 40960.",
    ),
    ModelPreset(
        name="qwen3-235b-a22b", num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
        hidden_size=4096, intermediate_size=12288, n_routed_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=1536, **_QWEN3,
        source="Qwen Team 2025, Qwen3 Technical Report, arXiv:2505.09388, Table 2; Qwen/Qwen3-235B-A22B "
        "config.json (preset format 1)",
        notes="128 experts, 8 per token (renormalized), no shared expert, every layer a mixture; 235B "
        "parameters, 22B active (the report's figures).",
    ),
    ModelPreset(
        name="deepseek-v3", num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        head_dim=192, hidden_size=7168, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, vocab_size=129280, intermediate_size=18432, q_lora_rank=1536, n_routed_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3,
        max_position_embeddings=163840,
        source="DeepSeek-AI 2024, DeepSeek-V3 Technical Report, arXiv:2412.19437, Sec. 4.2; "
        "deepseek-ai/DeepSeek-V3 config.json (preset format 1)",
        notes="MLA with q-LoRA; sigmoid routing with a correction bias (a buffer, not a parameter), 8 groups, "
        "4 kept, 8 of 256 experts plus 1 shared, first 3 layers dense; YaRN x40 from 4096. 671B parameters "
        "without the multi-token-prediction module (published checkpoint: 685B with it), 37B active.",
    ),
    ModelPreset(
        name="deepseek-v3.2", num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        head_dim=192, hidden_size=7168, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, vocab_size=129280, intermediate_size=18432, q_lora_rank=1536, n_routed_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3,
        max_position_embeddings=163840, index_n_heads=64, index_head_dim=128, index_topk=2048,
        source="DeepSeek-AI 2025, DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek Sparse "
        "Attention, Sec. 2.1; transformers 5.25 DeepseekV32Config defaults (checkpoint deepseek-ai/DeepSeek-V3.2-Exp)",
        notes="DeepSeek-V3's shape with DeepSeek Sparse Attention on every layer: a lightning indexer (64 heads of "
        "128, FP8 in the release) scores every cached token and MLA reads the 2048 best per query; each token "
        "caches its 128-wide indexer key beside the 576-wide latent. 671.9B parameters without the "
        "multi-token-prediction module: DeepSeek-V3's 671.0B plus 0.85B of indexers.",
    ),
    ModelPreset(
        name="olmo-2-32b", num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        hidden_size=5120, vocab_size=100352, intermediate_size=27648, max_position_embeddings=4096, **_OLMO,
        source="OLMo Team 2025, 2 OLMo 2 Furious, arXiv:2501.00656; allenai/OLMo-2-0325-32B config.json "
        "(preset format 1)",
        notes="Post-norm blocks (a norm after each branch, none before), QK RMSNorm over whole projections.",
    ),
    ModelPreset(
        name="olmo-3-7b", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
        hidden_size=4096, vocab_size=100278, intermediate_size=11008, sliding_window=4096,
        layer_types=_pattern(32, 4), max_position_embeddings=65536, **_OLMO,
        source="Ai2 2025, OLMo 3; allenai/Olmo-3-1025-7B config.json (preset format 1)",
        notes="OLMo 2's blocks with three sliding-window (4096) layers per global layer; MHA.",
    ),
    ModelPreset(
        name="qwen3-next-80b-a3b", num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
        hidden_size=2048, intermediate_size=5632, n_routed_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, n_shared_experts=1, shared_expert_intermediate_size=512, shared_expert_gate=True,
        layer_types=_hybrid(48, 4), linear_attention=LinearAttentionConfig(
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128),
        **_QWEN_HYBRID, vocab_size=151936,
        source="HF transformers 5.25 Qwen3NextConfig defaults, documented there as the Qwen3-Next-80B-A3B "
        "configuration (checkpoint Qwen/Qwen3-Next-80B-A3B-Instruct); every number is the class default",
        notes="Hybrid: 36 Gated DeltaNet layers (fixed state) and 12 gated full-attention layers (every 4th), "
        "partial RoPE (a quarter of each head); 512 experts, 10 per token, one gated shared expert. The config "
        "class's defaults give max_position_embeddings 32768 (the released config.json states more).",
    ),
    ModelPreset(
        name="qwen3.5-9b", num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, hidden_size=4096,
        intermediate_size=12288, layer_types=_hybrid(32, 4), linear_attention=LinearAttentionConfig(
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            mixer="gated_deltanet_split"),
        **_QWEN_HYBRID, vocab_size=248320,
        source="HF transformers 5.25 Qwen3_5TextConfig defaults, documented there as the Qwen3.5-9B style "
        "configuration; every number is the class default",
        notes="Hybrid: 24 Gated DeltaNet layers (fixed state) and 8 gated full-attention layers (every 4th), "
        "partial RoPE; dense SwiGLU feed-forward. The language model of the multimodal Qwen3.5.",
    ),
    ModelPreset(
        name="kimi-linear-48b-a3b", num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32,
        head_dim=192, hidden_size=2304, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        mla_use_nope=True, vocab_size=163840, intermediate_size=9216, n_routed_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=1024, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=1048576,
        layer_types=tuple(FULL if i + 1 in (4, 8, 12, 16, 20, 24, 27) else LINEAR_ATTENTION for i in range(27)),
        linear_attention=LinearAttentionConfig(linear_num_key_heads=32, linear_num_value_heads=32,
                                               linear_key_head_dim=128, linear_value_head_dim=128,
                                               linear_conv_kernel_dim=4, mixer="kda"),
        source="Kimi Team 2025, Kimi Linear: An Expressive, Efficient Attention Architecture, arXiv:2510.26692; "
        "widths, heads, experts and context: transformers 5.25 KimiLinearConfig defaults (its checkpoint "
        "moonshotai/Kimi-Linear-48B-A3B-Instruct); layer pattern: that checkpoint's config.json linear_attn_config, "
        "full_attn_layers 4, 8, 12, 16, 20, 24, 27 counted from 1 (preset format 1)",
        notes="20 Kimi Delta Attention layers (32 heads of 128, per-channel decay, a recurrent state flat in the "
        "context: 32 x 128 x 128 fp32 plus the convolution's last 3 inputs per layer and sequence) and 7 MLA layers "
        "without positions (NoPE), no q-LoRA; sigmoid routing with a correction bias, 8 of 256 experts plus 1 "
        "shared, first layer dense. transformers' default layer_types (MLA at layers 4, 8, ..., 24 counted from 0) "
        "differ from the checkpoint's.",
    ),
)

_GPT2 = dict(vocab_size=50257, mlp="dense", norm="layer", attention_bias=True, mlp_bias=True,
             tie_word_embeddings=True, learned_positions=1024)

_PRESET_LIST = (
    ModelPreset(
        name="transformer-base", num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
        head_dim=64, hidden_size=512, encoder_layers=6, vocab_size=37000, intermediate_size=2048, mlp="dense",
        norm="layer", attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        source="Vaswani et al. 2017, Attention Is All You Need, arXiv:1706.03762, Sec. 3.2.2 and 5.1, Table 3",
        notes="Encoder-decoder, 6 + 6 layers, d_model 512 = 8 heads x 64; shared source-target BPE "
        "vocabulary of about 37,000 tokens (English-German), one matrix for both embeddings and the "
        "pre-softmax layer; sinusoidal positions (no parameters). Table 3 reports 65M parameters.",
    ),
    ModelPreset(
        name="gpt-2-small", num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
        head_dim=64, hidden_size=768, intermediate_size=3072, **_GPT2,
        max_position_embeddings=1024,
        source="Radford et al. 2019, Language Models are Unsupervised Multitask Learners, Table 2; "
        "openai-community/gpt2 config.json",
        notes="Context 1024. 124,439,808 parameters with the tied LM head (the paper's table says 117M).",
    ),
    ModelPreset(
        name="gpt-2-medium", num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        head_dim=64, hidden_size=1024, intermediate_size=4096, **_GPT2,
        max_position_embeddings=1024,
        source="Radford et al. 2019, Language Models are Unsupervised Multitask Learners, Table 2; "
        "openai-community/gpt2-medium config.json",
        notes="Context 1024. 354,823,168 parameters (the paper's table says 345M).",
    ),
    ModelPreset(
        name="gpt-3-175b", num_hidden_layers=96, num_attention_heads=96, num_key_value_heads=96,
        head_dim=128, hidden_size=12288, intermediate_size=4 * 12288, **{**_GPT2, "learned_positions": 2048},
        max_position_embeddings=2048,
        source="Brown et al. 2020, Language Models are Few-Shot Learners, arXiv:2005.14165, Table 2.1",
        notes="Context 2048. The paper alternates dense and locally banded sparse layers without "
        "publishing the band; modelled here as dense MHA. GPT-2's vocabulary and layout (Sec. 2.1).",
    ),
    ModelPreset(
        name="llama-2-70b", num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, hidden_size=8192, vocab_size=32000, intermediate_size=28672,
        max_position_embeddings=4096,
        source="Touvron et al. 2023, Llama 2, arXiv:2307.09288 (GQA for 34B/70B); "
        "meta-llama/Llama-2-70b-hf config.json",
        notes="Context 4096.",
    ),
    ModelPreset(
        name="llama-3-8b", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, hidden_size=4096, vocab_size=128256, intermediate_size=14336,
        max_position_embeddings=8192,
        source="Llama Team 2024, The Llama 3 Herd of Models, arXiv:2407.21783, Table 3; "
        "meta-llama/Meta-Llama-3-8B config.json",
        notes="Context 8192 (Llama 3); 131072 in Llama 3.1, same attention shape.",
    ),
    ModelPreset(
        name="llama-3-70b", num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, hidden_size=8192, vocab_size=128256, intermediate_size=28672,
        max_position_embeddings=8192,
        source="Llama Team 2024, The Llama 3 Herd of Models, arXiv:2407.21783, Table 3; "
        "meta-llama/Meta-Llama-3-70B config.json",
        notes="Context 8192 (Llama 3); 131072 in Llama 3.1, same attention shape.",
    ),
    ModelPreset(
        name="mistral-7b-v0.1", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, hidden_size=4096, sliding_window=4096, vocab_size=32000, intermediate_size=14336,
        max_position_embeddings=32768,
        source="Jiang et al. 2023, Mistral 7B, arXiv:2310.06825, Table 1; "
        "mistralai/Mistral-7B-v0.1 config.json (sliding_window 4096)",
        notes="Every layer slides over 4096 tokens (rolling-buffer cache): the cache stops growing at "
        "4096 tokens, 8x less than v0.3 at 32K.",
    ),
    ModelPreset(
        name="mistral-7b-v0.2", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, hidden_size=4096, vocab_size=32000, intermediate_size=14336,
        max_position_embeddings=32768,
        source="mistralai/Mistral-7B-Instruct-v0.2 config.json (sliding_window null, rope_theta 1e6); "
        "Mistral AI release notes",
        notes="No sliding window: full attention over a 32K context.",
    ),
    ModelPreset(
        name="mistral-7b-v0.3", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, hidden_size=4096, vocab_size=32768, intermediate_size=14336,
        max_position_embeddings=32768,
        source="mistralai/Mistral-7B-v0.3 config.json (sliding_window null, vocab_size 32768)",
        notes="No sliding window: full attention over a 32K context; vocabulary extended to 32768.",
    ),
    ModelPreset(
        name="gemma-2-27b", num_hidden_layers=46, num_attention_heads=32, num_key_value_heads=16,
        head_dim=128, hidden_size=4608, sliding_window=4096, layer_types=_pattern(46, 2),
        vocab_size=256000, intermediate_size=36864, sandwich_norms=True, tie_word_embeddings=True,
        max_position_embeddings=8192,
        source="Gemma Team 2024, Gemma 2, arXiv:2408.00118, Table 1; google/gemma-2-27b config.json",
        notes="Local (window 4096) and global layers alternate, layer 0 local; context 8192.",
    ),
    ModelPreset(
        name="gemma-3-27b", num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
        head_dim=128, hidden_size=5376, sliding_window=1024, layer_types=_pattern(62, 6),
        vocab_size=262208, intermediate_size=21504, qk_norm=True, sandwich_norms=True, tie_word_embeddings=True,
        max_position_embeddings=131072,
        source="Gemma Team 2025, Gemma 3 Technical Report, arXiv:2503.19786 (5 local : 1 global, "
        "local span 1024); google/gemma-3-27b-pt config.json text_config",
        notes="Every 6th layer global (10 of 62); context 128K. The language model only (no vision tower).",
    ),
    ModelPreset(
        name="deepseek-v2", num_hidden_layers=60, num_attention_heads=128, num_key_value_heads=128,
        head_dim=192, hidden_size=5120, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, vocab_size=102400, intermediate_size=12288, q_lora_rank=1536, n_routed_experts=160,
        num_experts_per_tok=6, moe_intermediate_size=1536, n_shared_experts=2, first_k_dense_replace=1,
        max_position_embeddings=163840,
        source="DeepSeek-AI 2024, DeepSeek-V2, arXiv:2405.04434, Sec. 2.1, 3.1 and App. B; "
        "deepseek-ai/DeepSeek-V2 config.json",
        notes="MLA caches kv_lora_rank + qk_rope_head_dim = 576 elements per token per layer. 236B "
        "parameters, 21B active per token (the paper's figures).",
    ),
    *_PRESETS_2025,
    ModelPreset(
        name="llama-70b-mha", num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=64,
        head_dim=128, hidden_size=8192, vocab_size=32000, intermediate_size=28672,
        source="Teaching example: the Llama 2 70B shape (arXiv:2307.09288) without GQA",
        notes="2 x 128,000 x 64 x 128 x 2 B = 4.19 GB per layer, 335 GB for 80 layers at fp16; the "
        "texts' '128K' is decimal, 128,000 tokens.",
    ),
)

PRESETS: Mapping[str, ModelPreset] = MappingProxyType({p.name: p for p in _PRESET_LIST})

#: Names that used to mean one version silently; ``get_preset`` asks for the version instead.
AMBIGUOUS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "mistral-7b": ("mistral-7b-v0.1", "mistral-7b-v0.2", "mistral-7b-v0.3"),
})

_HF_ALIASES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embd": "hidden_size"}


def preset_from_hf_config(
    config: str | os.PathLike | Mapping[str, Any], *, name: str | None = None
) -> ModelPreset:
    """Build a preset from a HF ``config.json`` (a path, a folder holding one, or the parsed dict).

    The layout (layer types, window, head widths, MLA dims) is :func:`qkv.spec.hf_config.read_layout`'s, the
    reading the models use too, so it equals what ``transformers`` and :func:`qkv.models.from_hf` build:
    e.g. a Qwen2 ``config.json`` slides only with ``use_sliding_window`` and only from layer
    ``max_window_layers`` on. Multimodal configs are read from ``text_config``.

    Example:
        >>> cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
        >>> preset_from_hf_config(cfg).attention_kind
        'mha'
    """
    source = "HF config dict"
    if not isinstance(config, Mapping):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else os.fspath(config)
        config = read_json_config(path)
        source = f"HF config {path}"
        name = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or "config"
    check_layout_fields(config, source)
    try:
        layout = read_layout(config)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    cfg = dict(config.get("text_config") or config) if "num_hidden_layers" not in config else dict(config)
    cfg = {_HF_ALIASES.get(k, k): v for k, v in cfg.items()}
    lat = layout.latent
    return ModelPreset(
        name=name or layout.name or "config",
        num_hidden_layers=layout.num_hidden_layers,
        num_attention_heads=layout.num_attention_heads,
        num_key_value_heads=layout.num_key_value_heads,
        head_dim=lat.qk_head_dim if lat is not None else layout.head_dim,
        hidden_size=layout.hidden_size,
        sliding_window=layout.sliding_window,
        layer_types=layout.layer_types,
        kv_lora_rank=None if lat is None else lat.kv_lora_rank,
        qk_rope_head_dim=None if lat is None else lat.qk_rope_head_dim,
        qk_nope_head_dim=None if lat is None else lat.qk_nope_head_dim,
        v_head_dim=cfg.get("v_head_dim") if lat is None else lat.v_head_dim,
        linear_attention=layout.linear_attention,
        mla_use_nope=lat is not None and not lat.use_rope,
        source=source,
        **_whole_model_fields(cfg, layout.name),
    )


# HF model types whose feed-forward has two matrices and whose norms are LayerNorms with biases (GPT-2 layout).
_DENSE_LAYER_NORM = {"gpt2", "gpt_bigcode", "opt"}
_TIED_BY_DEFAULT = {"gpt2", "gemma", "gemma2", "gemma3", "gemma3_text"}
_HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # gated attention and recurrent layers


def _whole_model_fields(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The fields beyond attention that parameter counts and whole-model FLOPs need (HF names, family
    defaults where the config leaves them out)."""
    gpt2 = model_type in _DENSE_LAYER_NORM
    d = cfg.get("hidden_size")
    out: dict[str, Any] = {
        "vocab_size": cfg.get("vocab_size"),
        "intermediate_size": cfg.get("intermediate_size") or cfg.get("n_inner") or (4 * d if gpt2 and d else None),
        "mlp": "dense" if gpt2 else "gated",
        "norm": "layer" if gpt2 else "rms",
        "attention_bias": gpt2 or bool(cfg.get("attention_bias", False)),
        "qkv_bias": model_type == "qwen2",
        "mlp_bias": gpt2 or bool(cfg.get("mlp_bias", False)),
        "qk_norm": model_type in ("gemma3", "gemma3_text", "qwen3", "qwen3_moe", "olmo2", "olmo3", *_HYBRID),
        "attn_output_gate": model_type in _HYBRID,
        "qk_norm_scope": "projection" if model_type in ("olmo2", "olmo3") else "head",
        "pre_norms": model_type not in ("olmo2", "olmo3"),
        "attention_sinks": model_type == "gpt_oss",
        "sandwich_norms": model_type in ("gemma2", "gemma3", "gemma3_text", "olmo2", "olmo3"),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
        "learned_positions": (cfg.get("n_positions") or cfg.get("max_position_embeddings")) if gpt2 else None,
        "max_position_embeddings": cfg.get("max_position_embeddings") or cfg.get("n_positions"),
        "q_lora_rank": cfg.get("q_lora_rank") if cfg.get("kv_lora_rank") is not None else None,
    }
    indexer = read_indexer({**cfg, "model_type": model_type}) if cfg.get("kv_lora_rank") is not None else None
    if indexer is not None:
        out.update(index_n_heads=indexer.index_n_heads, index_head_dim=indexer.index_head_dim,
                   index_topk=indexer.index_topk)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # Qwen3-MoE, GPT-OSS
    if model_type in ("qwen3_moe", "gpt_oss") and experts and not cfg.get("n_routed_experts"):
        width = cfg.get("intermediate_size") if model_type == "gpt_oss" else cfg.get("moe_intermediate_size")
        out.update(n_routed_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok"),
                   moe_intermediate_size=width)
        if model_type == "gpt_oss":  # experts with biases, a router with a bias, attention biases by default
            out.update(mlp_bias=True, router_bias=True, attention_bias=bool(cfg.get("attention_bias", True)))
    if model_type in _HYBRID and (moe := read_moe({**cfg, "model_type": model_type})) is not None:
        out.update(n_routed_experts=moe.n_routed_experts, num_experts_per_tok=moe.num_experts_per_tok,
                   moe_intermediate_size=moe.moe_intermediate_size, n_shared_experts=moe.n_shared_experts,
                   shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
                   shared_expert_gate=moe.shared_expert_gate)
    if model_type in _HYBRID:  # HF's defaults where a config.json leaves them out
        out["intermediate_size"] = out["intermediate_size"] or {"qwen3_next": 5632, "qwen3_5_text": 12288}.get(
            model_type, out.get("moe_intermediate_size"))  # Qwen3.5-MoE has no dense MLP: the field is unused
    if cfg.get("n_routed_experts"):
        out.update(n_routed_experts=cfg["n_routed_experts"], num_experts_per_tok=cfg.get("num_experts_per_tok"),
                   moe_intermediate_size=cfg.get("moe_intermediate_size"),
                   n_shared_experts=cfg.get("n_shared_experts") or 0,
                   first_k_dense_replace=cfg.get("first_k_dense_replace") or 0)
    if model_type == "kimi_linear":  # its experts under checkpoint or transformers names: the one reader's
        moe = read_moe(cfg)
        out.update(n_routed_experts=moe.n_routed_experts, num_experts_per_tok=moe.num_experts_per_tok,
                   moe_intermediate_size=moe.moe_intermediate_size, n_shared_experts=moe.n_shared_experts,
                   first_k_dense_replace=moe.first_k_dense_replace,
                   max_position_embeddings=cfg.get("model_max_length") or cfg.get("max_position_embeddings"))
    return out


def get_preset(name_or_path: str | os.PathLike) -> ModelPreset:
    """A registry preset by name (case and ``_``/``-`` forgiven), or a HF ``config.json`` path.

    Raises:
        ValueError: unknown name, listing the known ones and the closest match.

    Example:
        >>> get_preset("Llama_3_70B").num_key_value_heads
        8
    """
    key = os.fspath(name_or_path).strip().lower().replace("_", "-").replace(" ", "-")
    if key in PRESETS:
        return PRESETS[key]
    if key in AMBIGUOUS:
        raise ValueError(
            f"preset {os.fspath(name_or_path)!r} names several versions whose attention differs; pick one of "
            f"{', '.join(AMBIGUOUS[key])} (see `qkv presets`)"
        )
    if os.path.exists(name_or_path):
        return preset_from_hf_config(name_or_path)
    close = difflib.get_close_matches(key, PRESETS, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown preset {os.fspath(name_or_path)!r}.{hint} Known presets: {', '.join(PRESETS)}; "
        "or give the path of a HF config.json."
    )
