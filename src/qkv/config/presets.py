"""Published models, each a :class:`qkv.config.DecoderConfig` with its source: one registry read by the CLI, the
benchmarks and the tests.

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

from .compressed import CompressedAttentionConfig
from .config_file import check_layout_fields, read_json_config
from .decoder import DecoderConfig
from .dsa import IndexerConfig
from .hf_config import kv_share_sources, read_indexer, read_layout, read_moe
from .hyper import HyperConfig
from .latent import LatentConfig
from .layer_types import FULL_ATTENTION, LAYER_KIND, LINEAR_ATTENTION, SLIDING_ATTENTION
from .linear import LinearAttentionConfig
from .moe import MoEConfig
from .rope import RopeParams

__all__ = ["AMBIGUOUS", "PRESETS", "ModelPreset", "get_preset", "preset_from_hf_config", "require_whole_model"]

FULL, SLIDING = FULL_ATTENTION, SLIDING_ATTENTION
_LAYER_KIND = LAYER_KIND


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """A published model: its :class:`qkv.config.DecoderConfig`, where the numbers come from, and caveats.

    The config is the one model description (what :class:`qkv.nn.DecoderLM` builds, the cache and the mixer
    registry :mod:`qkv.config.mixers` read, :mod:`qkv.costs` counts): read a model's facts as
    ``preset.config.<field>``. A preset of the attention only (a HF config that states no more) has
    ``config.vocab_size`` and ``config.intermediate_size`` None. The fields beside ``config`` are the facts a
    DecoderConfig cannot hold, each said below.

    Args:
        config: the model (its ``name`` is the preset's lowercase-hyphen slug, ``"llama-3-70b"``).
        source: citation for the numbers (paper, model card, config).
        notes: caveats.
        encoder_layers: layers of a bidirectional encoder in front of the decoder, each decoder layer then also
            cross-attending (encoder-decoder, Vaswani et al. 2017). A DecoderConfig is decoder-only.
        context_stated: whether the source states a context length. A DecoderConfig always holds one (the
            length a built model's positions are sized for, 4096 where nothing is stated); False: the CLI has no
            limit to warn past (:attr:`context_limit` is None).
        v_head_dim: value head width ``Dv`` narrower than the key heads without MLA: a cache shape, not a model
            :class:`qkv.nn.DecoderLM` builds (an MLA model's :meth:`mha_equivalent`, a HF config stating
            ``v_head_dim`` without a latent), so not a DecoderConfig field a built model would ignore. None:
            the config's own widths.

    Example:
        >>> p = PRESETS["gemma-3-27b"]
        >>> p.attention_kind, p.layer_counts, p.config.sliding_window
        ('gqa', {'global': 10, 'local': 52}, 1024)
    """

    config: DecoderConfig
    source: str = ""
    notes: str = ""
    encoder_layers: int = 0
    context_stated: bool = True
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        c = self.config
        if not isinstance(c, DecoderConfig):
            raise TypeError(f"ModelPreset: config must be a qkv.config.DecoderConfig, got {type(c).__name__}; build "
                            "one, or read a HF config.json with preset_from_hf_config")
        if not c.name:
            raise ValueError("ModelPreset: config.name must name the preset (a lowercase-hyphen slug), got ''")
        enc = self.encoder_layers
        if not isinstance(enc, int) or isinstance(enc, bool) or enc < 0:
            raise ValueError(f"{c.name}: encoder_layers must be an int >= 0, got {enc!r}")
        dv = self.v_head_dim
        if dv is not None and (not isinstance(dv, int) or isinstance(dv, bool) or dv <= 0 or c.latent is not None):
            raise ValueError(f"{c.name}: v_head_dim is the value width of non-MLA heads, a positive int (MLA's is "
                             f"config.latent.v_head_dim); got v_head_dim={dv!r} with latent={c.latent!r}")
        if not isinstance(self.context_stated, bool):
            raise TypeError(f"{c.name}: context_stated must be a bool, got {self.context_stated!r}")

    @property
    def name(self) -> str:
        """The preset's slug, ``config.name``."""
        return self.config.name

    @property
    def attention_kind(self) -> str:
        """``"mla"``, ``"csa/hca"`` (DeepSeek-V4's compressed attention: keys compressed per layer kind, one shared
        KV head), ``"mha"``, ``"mqa"`` or ``"gqa"``."""
        c = self.config
        if c.latent is not None:
            return "mla"
        if c.compressed is not None:
            return "csa/hca"
        if c.num_key_value_heads == c.num_attention_heads:
            return "mha"
        return "mqa" if c.num_key_value_heads == 1 else "gqa"

    @property
    def key_head_dim(self) -> int:
        """``Dqk``, the width of a query/key head: ``qk_nope_head_dim + qk_rope_head_dim`` for MLA."""
        lat = self.config.latent
        return lat.qk_head_dim if lat is not None else self.config.head_dim

    @property
    def value_head_dim(self) -> int:
        """``Dv``, the width of a value head (:attr:`key_head_dim` unless MLA or ``v_head_dim`` say otherwise)."""
        lat = self.config.latent
        return lat.v_head_dim if lat is not None else self.v_head_dim or self.config.head_dim

    @property
    def layer_counts(self) -> dict[str, int]:
        """Layers per kind, ``{"global": n, "local": m, "recurrent": r}``, kinds with no layer left out."""
        types = self.config.layer_types
        counts = {kind: types.count(t) for t, kind in _LAYER_KIND.items()}
        return {kind: c for kind, c in counts.items() if c}

    @property
    def context_limit(self) -> int | None:
        """The longest context the source states (HF's ``max_position_embeddings``), None where it states none."""
        return self.config.max_position_embeddings if self.context_stated else None

    @property
    def whole_model(self) -> bool:
        """Whether this is a whole decoder-only model (not attention only, not an encoder-decoder)."""
        return not self.config.attention_only and not self.encoder_layers

    @property
    def description(self) -> DecoderConfig:
        """:attr:`config`, where it says all of this preset: ``ValueError`` for the one shape it cannot hold, value
        heads narrower than key heads without MLA (``v_head_dim``, an MLA preset's :meth:`mha_equivalent`).

        Example:
            >>> PRESETS["llama-70b-mha"].description.num_key_value_heads
            64
        """
        if self.v_head_dim is not None and self.v_head_dim != self.config.head_dim:
            raise ValueError(f"{self.name}: value heads of {self.v_head_dim} beside key heads of "
                             f"{self.config.head_dim} without MLA have no DecoderConfig; describe the latent or "
                             "equal widths")
        return self.config

    @classmethod
    def from_config(cls, config: DecoderConfig, *, source: str = "", notes: str = "") -> ModelPreset:
        """The preset of a :class:`qkv.config.DecoderConfig`, so :mod:`qkv.costs` counts any description (its
        parameter count equals the built model's). ``ValueError`` for what the cost arithmetic does not count.

        Example:
            >>> from qkv.config import get_config
            >>> ModelPreset.from_config(get_config("tiny-gemma")).layer_counts
            {'global': 2, 'local': 2}
        """
        c = config
        if not isinstance(c, DecoderConfig):
            raise TypeError(f"ModelPreset.from_config: expected a qkv.config.DecoderConfig, got {type(c).__name__}")
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
        return cls(config=c if c.name else c.replace(name="config"), source=source, notes=notes)

    def mha_equivalent(self) -> ModelPreset:
        """The same model with one key/value head per query head and no latent compression (nor DeepSeek-V4's
        compressed entries and sliding window: full attention on every layer; nor Gemma 4's cross-layer sharing:
        every layer caches its own keys and values).

        For MLA this is the expanded cache: per head a :attr:`key_head_dim` key and a :attr:`value_head_dim`
        value (a cache shape, held by ``v_head_dim``: no model builds it).

        Example:
            >>> PRESETS["llama-3-70b"].mha_equivalent().config.num_key_value_heads
            64
        """
        c = self.config
        changes: dict[str, Any] = dict(name=f"{self.name} (MHA-equivalent)", num_key_value_heads=c.num_attention_heads)
        v_head_dim = self.v_head_dim
        if c.latent is not None:
            changes.update(latent=None, indexer=None, head_dim=self.key_head_dim, position="rope")
            v_head_dim = self.value_head_dim
        if c.kv_heads_by_type or c.kv_shared_from is not None:  # Gemma 4: every type's heads, every layer its own
            changes.update(kv_heads_by_type={t: c.num_attention_heads for t in c.kv_heads_by_type},
                           kv_shared_from=None)
        if c.compressed is not None:  # DeepSeek-V4: every token's key and value in every head, no compression
            changes.update(compressed=None, hyper=None, layer_types=(FULL,) * c.num_hidden_layers,
                           sliding_window=None, position="rope")
        return dataclasses.replace(self, config=c.replace(**changes), v_head_dim=v_head_dim,
                                   notes=f"{self.name} with one KV head per query head")


def require_whole_model(preset: ModelPreset, what: str) -> None:
    """Raise a ValueError when ``preset`` lacks the fields a whole-model count needs."""
    c = preset.config
    missing = [f for f in ("vocab_size", "intermediate_size") if getattr(c, f) is None]
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
    "nope_layers", "linear_pre_norms",  # no count changes; norms per layer: DecoderConfig.layer_norms
    "compressed", "hyper",  # DeepSeek-V4: its mixer kinds count themselves (config.mixers), mHC in costs.params
    "head_dim_by_type", "kv_heads_by_type", "k_eq_v_types", "value_norm", "kv_shared_from",  # Gemma 4: per layer
    "per_layer_input_size", "per_layer_vocab_size", "layer_scalars", "intermediate_sizes",
})


def _pattern(num_layers: int, period: int) -> tuple[str, ...]:
    """HF's interleave: layer ``i`` is global iff ``(i + 1) % period == 0`` (Gemma 2: period 2)."""
    return tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(num_layers))


def _deepseek_v4(name: str, *, hidden_size: int, num_hidden_layers: int, num_attention_heads: int,
                 q_lora_rank: int, n_routed_experts: int, moe_intermediate_size: int, o_groups: int,
                 index_topk: int) -> DecoderConfig:
    """A DeepSeek-V4 shape: what transformers 5.25's ``DeepseekV4Config`` defaults (V4-Flash) hold beside the
    fields that differ between the released sizes. Layers 0 and 1 are HCA (128 : 1), then HCA and CSA (4 : 1,
    overlapping windows, an indexer of 64 heads of 128) alternate; every layer has its 128-token sliding branch,
    one K = V head of 512 (64 rotary), sinks, 4 mHC streams; the first 3 MoE layers are hash-routed."""
    n = num_hidden_layers
    kinds = ("hca", "hca") + tuple("csa" if i % 2 else "hca" for i in range(2, n))
    return DecoderConfig(
        name=name, vocab_size=129280, hidden_size=hidden_size, num_hidden_layers=n,
        num_attention_heads=num_attention_heads, num_key_value_heads=1, head_dim=512,
        intermediate_size=moe_intermediate_size, rms_norm_eps=1e-6, position="none", attention_sinks=True,
        sliding_window=128, layer_types=(SLIDING,) * n, tie_word_embeddings=False, max_position_embeddings=1048576,
        moe=MoEConfig(n_routed_experts=n_routed_experts, num_experts_per_tok=6,
                      moe_intermediate_size=moe_intermediate_size, n_shared_experts=1, routed_scaling_factor=1.5,
                      topk_method="sqrtsoftplus", norm_topk_prob=True, hash_layers=(0, 1, 2), silu_limit=10.0),
        compressed=CompressedAttentionConfig(
            attention_types=kinds, q_lora_rank=q_lora_rank, o_groups=o_groups, o_lora_rank=1024,
            qk_rope_head_dim=64, index_n_heads=64, index_head_dim=128, index_topk=index_topk,
            compress_rates={"csa": 4, "hca": 128}, main_rope=RopeParams(theta=10000.0, interleaved=True),
            compress_rope=RopeParams(theta=160000.0, interleaved=True)),
        hyper=HyperConfig(hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6))


def _gemma4_dense(name: str, *, hidden_size: int, num_hidden_layers: int, num_key_value_heads: int, period: int,
                  shared: int, double_wide: bool) -> DecoderConfig:
    """Gemma 4's small dense decoders (E2B, E4B): 8 query heads, local layers of 256-wide heads with a 512-token
    window, one global layer each ``period`` (heads 512 wide, proportional RoPE rotating a quarter at theta 1e6), the
    last ``shared`` layers reading the keys and values of the last earlier layer of their type (as
    ``qkv.config.hf_config`` reads ``num_kv_shared_layers``), 256-wide per-layer inputs from a full-vocabulary table,
    a 4x MLP (doubled on the shared layers where ``double_wide``), a tied head soft-capped at 30."""
    types = _pattern(num_hidden_layers, period)
    first = num_hidden_layers - shared
    d_ff = 4 * hidden_size
    return DecoderConfig(
        name=name, vocab_size=262144, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=8, intermediate_size=d_ff, num_key_value_heads=num_key_value_heads, head_dim=256,
        hidden_act="gelu_pytorch_tanh", sandwich_norms=True, qk_norm=True, attention_scale=1.0,
        scale_embeddings=True, tie_word_embeddings=True, final_logit_softcapping=30.0, sliding_window=512,
        layer_types=types, max_position_embeddings=131072,
        rope={SLIDING: RopeParams(theta=10000.0),
              FULL: RopeParams(theta=1_000_000.0, scaling={"rope_type": "proportional"}, partial_rotary_factor=0.25)},
        head_dim_by_type={FULL: 512}, kv_heads_by_type={FULL: num_key_value_heads}, value_norm=True,
        kv_shared_from=kv_share_sources(types, shared, name),
        layer_scalars=True, per_layer_input_size=256, per_layer_vocab_size=262144,
        intermediate_sizes=tuple(d_ff * (2 if i >= first else 1) for i in range(num_hidden_layers))
        if double_wide else None)


def _gemma4_preset(size: str, *, effective: str, with_tables: str, **shape: Any) -> ModelPreset:
    """A Gemma 4 small-model preset (:func:`_gemma4_dense`) with its source and notes stated from its shape."""
    c = _gemma4_dense(f"gemma4-{size}", **shape)
    n, kv, shared = c.num_hidden_layers, c.num_key_value_heads, shape["shared"]
    own = [t for t, s in zip(c.layer_types, c.kv_shared_from) if s is None]
    local, global_ = own.count(SLIDING), own.count(FULL)
    reads = sorted(set(s for s in c.kv_shared_from if s is not None))
    wide = " with a double-wide MLP" if shape["double_wide"] else ""
    return ModelPreset(
        config=c,
        source=f"Google DeepMind 2026, Gemma 4 model card ({size.upper()}: {effective} effective parameters, "
               f"{with_tables} with its per-layer embeddings, vision and audio encoders; 128K context); the text "
               f"config as public reimplementations state it alike ({n} layers of width {c.hidden_size}, "
               f"{shape['period'] - 1} local : 1 global, {kv} KV head{'s' if kv > 1 else ''}, heads 256 / 512 wide, "
               f"window 512, the last {shared} layers KV-shared{wide}, 256-wide per-layer inputs)",
        notes=f"Per-layer input tables (262,144 x {n} x 256 = {262144 * n * 256 / 1e9:.2f}B) are looked up, not "
              f"multiplied: the effective count is the total less them. Only {local + global_} layers hold keys and "
              f"values ({local} local windows of 512 tokens, {global_} global); the {shared} shared ones read layers "
              f"{' and '.join(map(str, reads))}.")


def _gemma4_large(size: str, *, hidden_size: int, num_hidden_layers: int, num_attention_heads: int,
                  num_key_value_heads: int, global_kv_heads: int, intermediate_size: int, published: str,
                  experts: tuple[int, int, int] | None = None) -> ModelPreset:
    """Gemma 4's 31B and 26B-A4B decoders: local layers of 256-wide heads with a 1024-token window, one global layer
    in six (heads 512 wide, proportional RoPE rotating a quarter at theta 1e6) whose keys serve as values (K = V,
    ``global_kv_heads`` KV heads), no KV sharing or per-layer inputs, a tied head soft-capped at 30, 256K context;
    ``experts`` (count, per token, width) run beside the dense MLP on every layer (26B-A4B)."""
    types = _pattern(num_hidden_layers, 6)
    moe = None if experts is None else MoEConfig(n_routed_experts=experts[0], num_experts_per_tok=experts[1],
                                                 moe_intermediate_size=experts[2], norm_topk_prob=True,
                                                 beside_dense=True)
    c = DecoderConfig(
        name=f"gemma4-{size}", vocab_size=262144, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
        num_key_value_heads=num_key_value_heads, head_dim=256, hidden_act="gelu_pytorch_tanh", sandwich_norms=True,
        qk_norm=True, attention_scale=1.0, scale_embeddings=True, tie_word_embeddings=True,
        final_logit_softcapping=30.0, sliding_window=1024, layer_types=types, max_position_embeddings=262144,
        rope={SLIDING: RopeParams(theta=10000.0),
              FULL: RopeParams(theta=1_000_000.0, scaling={"rope_type": "proportional"}, partial_rotary_factor=0.25)},
        head_dim_by_type={FULL: 512}, kv_heads_by_type={FULL: global_kv_heads}, k_eq_v_types=(FULL,),
        value_norm=True, layer_scalars=True, moe=moe)
    block = (f"{experts[0]} experts of width {experts[2]}, {experts[1]} per token, beside a dense GeGLU MLP of "
             f"{intermediate_size} on every layer" if experts else f"a dense GeGLU MLP of {intermediate_size}")
    return ModelPreset(
        config=c,
        source=f"Google DeepMind 2026, Gemma 4 model card ({size.upper()}: {published}, with a vision encoder of about "
               f"550M; 256K context); the text config as Google's MaxText states it (configs/models/gemma4-"
               f"{size.split('-')[0]}.yml: {num_hidden_layers} layers of width {hidden_size}, {num_attention_heads} "
               f"query heads, {num_key_value_heads} KV heads of 256 on local layers and {global_kv_heads} of 512 on "
               f"global ones with shared K/V projections, window 1024, {block})",
        notes=f"The 5 local : 1 global interleave (HF's default layer_types) gives {types.count(FULL)} global layers "
              f"whose one projection gives keys and values (K = V); qkv caches that tensor once (values_only). The "
              f"published totals equal this text model's count to their rounding; the vision encoder is outside "
              f"them and not counted here.")


def _hybrid(num_layers: int, interval: int) -> tuple[str, ...]:
    """HF Qwen3-Next / Qwen3.5: layer ``i`` is full attention iff ``(i + 1) % interval == 0``, else recurrent."""
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


# Every number is the cited source's; what a source does not say takes the family's usual value (SiLU gates,
# tanh-GELU for the dense feed-forwards and for Gemma's, RoPE with theta 10000).
_PRESET_LIST = (
    ModelPreset(
        config=DecoderConfig(
            name='transformer-base',
            vocab_size=37000, hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=2048,
            num_key_value_heads=8, hidden_act='gelu_tanh', gated_mlp=False, norm='layer', qkv_bias=True, o_bias=True,
            mlp_bias=True, tie_word_embeddings=True, max_position_embeddings=4096,
        ),
        encoder_layers=6, context_stated=False,
        source='Vaswani et al. 2017, Attention Is All You Need, arXiv:1706.03762, Sec. 3.2.2 and 5.1, Table 3',
        notes='Encoder-decoder, 6 + 6 layers, d_model 512 = 8 heads x 64; shared source-target BPE vocabulary of '
            'about 37,000 tokens (English-German), one matrix for both embeddings and the pre-softmax layer; '
            'sinusoidal positions (no parameters). Table 3 reports 65M parameters.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='gpt-2-small',
            vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
            num_key_value_heads=12, hidden_act='gelu_tanh', gated_mlp=False, norm='layer', position='learned',
            qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True, max_position_embeddings=1024,
        ),
        source='Radford et al. 2019, Language Models are Unsupervised Multitask Learners, Table 2; '
            'openai-community/gpt2 config.json',
        notes="Context 1024. 124,439,808 parameters with the tied LM head (the paper's table says 117M).",
    ),
    ModelPreset(
        config=DecoderConfig(
            name='gpt-2-medium',
            vocab_size=50257, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
            num_key_value_heads=16, hidden_act='gelu_tanh', gated_mlp=False, norm='layer', position='learned',
            qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True, max_position_embeddings=1024,
        ),
        source='Radford et al. 2019, Language Models are Unsupervised Multitask Learners, Table 2; '
            'openai-community/gpt2-medium config.json',
        notes="Context 1024. 354,823,168 parameters (the paper's table says 345M).",
    ),
    ModelPreset(
        config=DecoderConfig(
            name='gpt-3-175b',
            vocab_size=50257, hidden_size=12288, num_hidden_layers=96, num_attention_heads=96,
            intermediate_size=49152, num_key_value_heads=96, hidden_act='gelu_tanh', gated_mlp=False, norm='layer',
            position='learned', qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True,
            max_position_embeddings=2048,
        ),
        source='Brown et al. 2020, Language Models are Few-Shot Learners, arXiv:2005.14165, Table 2.1',
        notes='Context 2048. The paper alternates dense and locally banded sparse layers without publishing the '
            "band; modelled here as dense MHA. GPT-2's vocabulary and layout (Sec. 2.1).",
    ),
    ModelPreset(
        config=DecoderConfig(
            name='llama-2-70b',
            vocab_size=32000, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
            intermediate_size=28672, num_key_value_heads=8, max_position_embeddings=4096,
        ),
        source='Touvron et al. 2023, Llama 2, arXiv:2307.09288 (GQA for 34B/70B); meta-llama/Llama-2-70b-hf '
            'config.json',
        notes='Context 4096.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='llama-3-8b',
            vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
            intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=8192,
        ),
        source='Llama Team 2024, The Llama 3 Herd of Models, arXiv:2407.21783, Table 3; meta-llama/Meta-Llama-3-8B'
            ' config.json',
        notes='Context 8192 (Llama 3); 131072 in Llama 3.1, same attention shape.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='llama-3-70b',
            vocab_size=128256, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
            intermediate_size=28672, num_key_value_heads=8, max_position_embeddings=8192,
        ),
        source='Llama Team 2024, The Llama 3 Herd of Models, arXiv:2407.21783, Table 3; '
            'meta-llama/Meta-Llama-3-70B config.json',
        notes='Context 8192 (Llama 3); 131072 in Llama 3.1, same attention shape.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='mistral-7b-v0.1',
            vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
            intermediate_size=14336, num_key_value_heads=8, sliding_window=4096, layer_types=(SLIDING,) * 32,
            max_position_embeddings=32768,
        ),
        source='Jiang et al. 2023, Mistral 7B, arXiv:2310.06825, Table 1; mistralai/Mistral-7B-v0.1 config.json '
            '(sliding_window 4096)',
        notes='Every layer slides over 4096 tokens (rolling-buffer cache): the cache stops growing at 4096 tokens,'
            ' 8x less than v0.3 at 32K.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='mistral-7b-v0.2',
            vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
            intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=32768,
        ),
        source='mistralai/Mistral-7B-Instruct-v0.2 config.json (sliding_window null, rope_theta 1e6); Mistral AI '
            'release notes',
        notes='No sliding window: full attention over a 32K context.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='mistral-7b-v0.3',
            vocab_size=32768, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
            intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=32768,
        ),
        source='mistralai/Mistral-7B-v0.3 config.json (sliding_window null, vocab_size 32768)',
        notes='No sliding window: full attention over a 32K context; vocabulary extended to 32768.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='gemma-2-27b',
            vocab_size=256000, hidden_size=4608, num_hidden_layers=46, num_attention_heads=32,
            intermediate_size=36864, num_key_value_heads=16, head_dim=128, hidden_act='gelu_pytorch_tanh',
            sandwich_norms=True, tie_word_embeddings=True, sliding_window=4096, layer_types=_pattern(46, 2),
            max_position_embeddings=8192,
        ),
        source='Gemma Team 2024, Gemma 2, arXiv:2408.00118, Table 1; google/gemma-2-27b config.json',
        notes='Local (window 4096) and global layers alternate, layer 0 local; context 8192.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='gemma-3-27b',
            vocab_size=262208, hidden_size=5376, num_hidden_layers=62, num_attention_heads=32,
            intermediate_size=21504, num_key_value_heads=16, head_dim=128, hidden_act='gelu_pytorch_tanh',
            sandwich_norms=True, qk_norm=True, tie_word_embeddings=True, sliding_window=1024,
            layer_types=_pattern(62, 6), max_position_embeddings=131072,
        ),
        source='Gemma Team 2025, Gemma 3 Technical Report, arXiv:2503.19786 (5 local : 1 global, local span 1024);'
            ' google/gemma-3-27b-pt config.json text_config',
        notes='Every 6th layer global (10 of 62); context 128K. The language model only (no vision tower).',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='deepseek-v2',
            vocab_size=102400, hidden_size=5120, num_hidden_layers=60, num_attention_heads=128,
            intermediate_size=12288, num_key_value_heads=128, max_position_embeddings=163840,
            latent=LatentConfig(
                hidden_size=5120, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128
            ),
            moe=MoEConfig(
                n_routed_experts=160, num_experts_per_tok=6, moe_intermediate_size=1536, n_shared_experts=2,
                first_k_dense_replace=1
            ),
        ),
        source='DeepSeek-AI 2024, DeepSeek-V2, arXiv:2405.04434, Sec. 2.1, 3.1 and App. B; deepseek-ai/DeepSeek-V2'
            ' config.json',
        notes='MLA caches kv_lora_rank + qk_rope_head_dim = 576 elements per token per layer. 236B parameters, 21B'
            " active per token (the paper's figures).",
    ),
    ModelPreset(
        config=DecoderConfig(
            name='gpt-oss-20b',
            vocab_size=201088, hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
            intermediate_size=2880, num_key_value_heads=8, head_dim=64, qkv_bias=True, o_bias=True, mlp_bias=True,
            attention_sinks=True, sliding_window=128, layer_types=_pattern(24, 2), max_position_embeddings=131072,
            moe=MoEConfig(
                n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880, router_bias=True,
                swiglu_limit=7.0
            ),
        ),
        source='OpenAI 2025, gpt-oss-120b & gpt-oss-20b Model Card, arXiv:2508.10925; openai/gpt-oss-20b '
            'config.json (preset format 1)',
        notes='Local (window 128) and global layers alternate, layer 0 local; a learned sink logit per head; 32 '
            'experts with biases, 4 per token, router with a bias; YaRN x32 from 4096 to 131072. The MXFP4 '
            'checkpoint stores experts in 4.25 bits.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='gpt-oss-120b',
            vocab_size=201088, hidden_size=2880, num_hidden_layers=36, num_attention_heads=64,
            intermediate_size=2880, num_key_value_heads=8, head_dim=64, qkv_bias=True, o_bias=True, mlp_bias=True,
            attention_sinks=True, sliding_window=128, layer_types=_pattern(36, 2), max_position_embeddings=131072,
            moe=MoEConfig(
                n_routed_experts=128, num_experts_per_tok=4, moe_intermediate_size=2880, router_bias=True,
                swiglu_limit=7.0
            ),
        ),
        source='OpenAI 2025, gpt-oss-120b & gpt-oss-20b Model Card, arXiv:2508.10925; openai/gpt-oss-120b '
            'config.json (preset format 1)',
        notes='As gpt-oss-20b with 36 layers and 128 experts.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='qwen3-8b',
            vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
            intermediate_size=12288, num_key_value_heads=8, qk_norm=True, max_position_embeddings=40960,
        ),
        source='Qwen Team 2025, Qwen3 Technical Report, arXiv:2505.09388, Table 1; Qwen/Qwen3-8B config.json '
            '(preset format 1)',
        notes='Per-head QK RMSNorm; context 40960 (32K native, 128K with YaRN).',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='qwen3-32b',
            vocab_size=151936, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
            intermediate_size=25600, num_key_value_heads=8, head_dim=128, qk_norm=True,
            max_position_embeddings=40960,
        ),
        source='Qwen Team 2025, Qwen3 Technical Report, arXiv:2505.09388, Table 1; Qwen/Qwen3-32B config.json '
            '(preset format 1)',
        notes='Per-head QK RMSNorm; context 40960.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='qwen3-235b-a22b',
            vocab_size=151936, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
            intermediate_size=12288, num_key_value_heads=4, head_dim=128, qk_norm=True,
            max_position_embeddings=40960,
            moe=MoEConfig(n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536),
        ),
        source='Qwen Team 2025, Qwen3 Technical Report, arXiv:2505.09388, Table 2; Qwen/Qwen3-235B-A22B '
            'config.json (preset format 1)',
        notes='128 experts, 8 per token (renormalized), no shared expert, every layer a mixture; 235B parameters, '
            "22B active (the report's figures).",
    ),
    ModelPreset(
        config=DecoderConfig(
            name='deepseek-v3',
            vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
            intermediate_size=18432, num_key_value_heads=128, max_position_embeddings=163840,
            latent=LatentConfig(
                hidden_size=7168, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128
            ),
            moe=MoEConfig(
                n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                first_k_dense_replace=3
            ),
        ),
        source='DeepSeek-AI 2024, DeepSeek-V3 Technical Report, arXiv:2412.19437, Sec. 4.2; '
            'deepseek-ai/DeepSeek-V3 config.json (preset format 1)',
        notes='MLA with q-LoRA; sigmoid routing with a correction bias (a buffer, not a parameter), 8 groups, 4 '
            'kept, 8 of 256 experts plus 1 shared, first 3 layers dense; YaRN x40 from 4096. 671B parameters '
            'without the multi-token-prediction module (published checkpoint: 685B with it), 37B active.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='deepseek-v3.2',
            vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
            intermediate_size=18432, num_key_value_heads=128, max_position_embeddings=163840,
            latent=LatentConfig(
                hidden_size=7168, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128
            ),
            moe=MoEConfig(
                n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                first_k_dense_replace=3
            ),
            indexer=IndexerConfig(index_n_heads=64, index_head_dim=128, index_topk=2048),
        ),
        source='DeepSeek-AI 2025, DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek Sparse '
            'Attention, Sec. 2.1; transformers 5.25 DeepseekV32Config defaults (checkpoint '
            'deepseek-ai/DeepSeek-V3.2-Exp)',
        notes="DeepSeek-V3's shape with DeepSeek Sparse Attention on every layer: a lightning indexer (64 heads of"
            ' 128, FP8 in the release) scores every cached token and MLA reads the 2048 best per query; each '
            'token caches its 128-wide indexer key beside the 576-wide latent. 671.9B parameters without the '
            "multi-token-prediction module: DeepSeek-V3's 671.0B plus 0.85B of indexers.",
    ),
    ModelPreset(
        config=_deepseek_v4('deepseek-v4-flash', hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
                            q_lora_rank=1024, n_routed_experts=256, moe_intermediate_size=2048, o_groups=8,
                            index_topk=512),
        source='DeepSeek-AI 2026, DeepSeek-V4 technical report; transformers 5.25 DeepseekV4Config defaults '
            '(checkpoint deepseek-ai/DeepSeek-V4-Flash)',
        notes='43 layers of width 4096: a 128-token sliding branch on every layer beside HCA (128 : 1, dense) or '
            'CSA (4 : 1 overlapping windows, the indexer keeps 512 entries); one K = V head of 512 (64 rotary), 64 '
            'query heads, grouped low-rank output (8 groups of rank 1024), 4 mHC streams, 6 of 256 experts plus 1 '
            'shared (sqrt-softplus routing, hash-routed first 3 layers). 284B parameters without the multi-token-'
            'prediction module (published 284B), 13B active. Shape only: from_hf reads the RoPE scaling and routing.',
    ),
    ModelPreset(
        config=_deepseek_v4('deepseek-v4-pro', hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                            q_lora_rank=1536, n_routed_experts=384, moe_intermediate_size=3072, o_groups=16,
                            index_topk=1024),
        source='DeepSeek-AI 2026, DeepSeek-V4 technical report; model card deepseek-ai/DeepSeek-V4-Pro (the fields '
            'that differ from DeepseekV4Config defaults)',
        notes="V4-Flash's design at 61 layers of width 7168, 128 query heads, q-LoRA 1536, 16 output groups, 6 of "
            '384 experts of 3072, the indexer keeping 1024 entries. 1.6T parameters without the multi-token-'
            'prediction module (published 1.6T), 49B active. Per token and layer the cache holds 1/4 (CSA) or '
            '1/128 (HCA) of a 512-wide entry, CSA layers also 1/4 of a 128-wide indexer key, plus 128 window tokens '
            "per layer: about 10% of DeepSeek-V3.2's bytes at 1M tokens (the report's figure).",
    ),
    ModelPreset(
        config=DecoderConfig(
            name='glm-5',
            vocab_size=154880, hidden_size=6144, num_hidden_layers=78, num_attention_heads=64,
            intermediate_size=12288, num_key_value_heads=64, max_position_embeddings=202752,
            latent=LatentConfig(
                hidden_size=6144, num_attention_heads=64, kv_lora_rank=512, q_lora_rank=2048, qk_nope_head_dim=192,
                qk_rope_head_dim=64, v_head_dim=256
            ),
            moe=MoEConfig(
                n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                first_k_dense_replace=3
            ),
            indexer=IndexerConfig(index_n_heads=32, index_head_dim=128, index_topk=2048),
        ),
        source='Z.ai 2026, GLM-5 (zai-org/GLM-5 model card); transformers 5.25 GlmMoeDsaConfig defaults '
            '(checkpoint zai-org/GLM-5)',
        notes="DeepSeek-V3.2's design at GLM-5's shape: MLA (q-LoRA 2048, 192 + 64 query/key dims, 256 value dims) "
            'with DeepSeek Sparse Attention on all 78 layers (indexer 32 heads of 128, interleaved RoPE, top 2048), '
            '8 of 256 experts plus 1 shared, first 3 layers dense. 743.9B parameters without the multi-token-'
            "prediction layer (the published 744B), 41.8B active with the embeddings (published: 40B active); each "
            'token caches 512 + 64 latent values and a 128-wide indexer key per layer, 109,824 bytes in BF16. '
            'Shape only, as the other presets: from_hf reads the routing and the indexer RoPE layout.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='olmo-2-32b',
            vocab_size=100352, hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
            intermediate_size=27648, num_key_value_heads=8, sandwich_norms=True, qk_norm=True,
            qk_norm_scope='projection', pre_norms=False, max_position_embeddings=4096,
        ),
        source='OLMo Team 2025, 2 OLMo 2 Furious, arXiv:2501.00656; allenai/OLMo-2-0325-32B config.json (preset '
            'format 1)',
        notes='Post-norm blocks (a norm after each branch, none before), QK RMSNorm over whole projections.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='olmo-3-7b',
            vocab_size=100278, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
            intermediate_size=11008, num_key_value_heads=32, sandwich_norms=True, qk_norm=True,
            qk_norm_scope='projection', pre_norms=False, sliding_window=4096, layer_types=_pattern(32, 4),
            max_position_embeddings=65536,
        ),
        source='Ai2 2025, OLMo 3; allenai/Olmo-3-1025-7B config.json (preset format 1)',
        notes="OLMo 2's blocks with three sliding-window (4096) layers per global layer; MHA.",
    ),
    ModelPreset(
        config=DecoderConfig(
            name='qwen3-next-80b-a3b',
            vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
            intermediate_size=5632, num_key_value_heads=2, head_dim=256, qk_norm=True, layer_types=_hybrid(48, 4),
            max_position_embeddings=32768,
            moe=MoEConfig(
                n_routed_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, n_shared_experts=1,
                shared_expert_intermediate_size=512, shared_expert_gate=True
            ),
            linear_attention=LinearAttentionConfig(
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128
            ),
            attn_output_gate=True,
        ),
        source='HF transformers 5.25 Qwen3NextConfig defaults, documented there as the Qwen3-Next-80B-A3B '
            'configuration (checkpoint Qwen/Qwen3-Next-80B-A3B-Instruct); every number is the class default',
        notes='Hybrid: 36 Gated DeltaNet layers (fixed state) and 12 gated full-attention layers (every 4th), '
            'partial RoPE (a quarter of each head); 512 experts, 10 per token, one gated shared expert. The '
            "config class's defaults give max_position_embeddings 32768 (the released config.json states more).",
    ),
    ModelPreset(
        config=DecoderConfig(
            name='qwen3.5-9b',
            vocab_size=248320, hidden_size=4096, num_hidden_layers=32, num_attention_heads=16,
            intermediate_size=12288, num_key_value_heads=4, qk_norm=True, layer_types=_hybrid(32, 4),
            max_position_embeddings=32768,
            linear_attention=LinearAttentionConfig(
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, mixer='gated_deltanet_split'
            ),
            attn_output_gate=True,
        ),
        source='HF transformers 5.25 Qwen3_5TextConfig defaults, documented there as the Qwen3.5-9B style '
            'configuration; every number is the class default',
        notes='Hybrid: 24 Gated DeltaNet layers (fixed state) and 8 gated full-attention layers (every 4th), '
            'partial RoPE; dense SwiGLU feed-forward. The language model of the multimodal Qwen3.5.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='kimi-linear-48b-a3b',
            vocab_size=163840, hidden_size=2304, num_hidden_layers=27, num_attention_heads=32,
            intermediate_size=9216, num_key_value_heads=32, position='none',
            layer_types=tuple(FULL if i + 1 in (4, 8, 12, 16, 20, 24, 27) else LINEAR_ATTENTION for i in range(27)),
            max_position_embeddings=1048576,
            latent=LatentConfig(
                hidden_size=2304, num_attention_heads=32, kv_lora_rank=512, use_rope=False, q_lora_rank=None,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
            ),
            moe=MoEConfig(
                n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024, n_shared_experts=1,
                first_k_dense_replace=1
            ),
            linear_attention=LinearAttentionConfig(
                linear_num_key_heads=32, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, mixer='kda'
            ),
        ),
        source='Kimi Team 2025, Kimi Linear: An Expressive, Efficient Attention Architecture, arXiv:2510.26692; '
            'widths, heads, experts and context: transformers 5.25 KimiLinearConfig defaults (its checkpoint '
            "moonshotai/Kimi-Linear-48B-A3B-Instruct); layer pattern: that checkpoint's config.json "
            'linear_attn_config, full_attn_layers 4, 8, 12, 16, 20, 24, 27 counted from 1 (preset format 1)',
        notes='20 Kimi Delta Attention layers (32 heads of 128, per-channel decay, a recurrent state flat in the '
            "context: 32 x 128 x 128 fp32 plus the convolution's last 3 inputs per layer and sequence) and 7 MLA"
            ' layers without positions (NoPE), no q-LoRA; sigmoid routing with a correction bias, 8 of 256 '
            "experts plus 1 shared, first layer dense. transformers' default layer_types (MLA at layers 4, 8, "
            "..., 24 counted from 0) differ from the checkpoint's.",
    ),
    _gemma4_preset('e2b', effective='2.3B', with_tables='5.1B', hidden_size=1536, num_hidden_layers=35,
                   num_key_value_heads=1, period=5, shared=20, double_wide=True),
    _gemma4_preset('e4b', effective='4.5B', with_tables='8B', hidden_size=2560, num_hidden_layers=42,
                   num_key_value_heads=2, period=6, shared=18, double_wide=False),
    _gemma4_large('31b', hidden_size=5376, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16,
                  global_kv_heads=4, intermediate_size=21504, published='30.7B parameters'),
    _gemma4_large('26b-a4b', hidden_size=2816, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
                  global_kv_heads=2, intermediate_size=2112, published='25.2B parameters, 3.8B active',
                  experts=(128, 8, 704)),
    ModelPreset(
        config=DecoderConfig(
            name='smollm3-3b',
            vocab_size=128256, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
            intermediate_size=11008, num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=65536,
            rope={FULL: RopeParams(theta=5_000_000.0)}, nope_layers=tuple(range(3, 36, 4)),
        ),
        source='Hugging Face 2025, SmolLM3: smol, multilingual, long-context reasoner (blog and model card, '
            'HuggingFaceTB/SmolLM3-3B: 3.08B parameters); that config.json: widths, GQA 16:4, tied embeddings, '
            'rope_theta 5e6, no_rope_layer_interval 4, 65536 positions',
        notes='Llama-shaped GQA decoder whose every 4th layer is NoPE (no RoPE: layers 3, 7, ..., 35); all 36 '
            'layers full attention, 72 KiB of bf16 K/V per token.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='olmo-hybrid-7b',
            vocab_size=100352, hidden_size=3840, num_hidden_layers=32, num_attention_heads=30,
            intermediate_size=11008, num_key_value_heads=30, sandwich_norms=True, qk_norm=True,
            qk_norm_scope='projection', pre_norms=False, linear_pre_norms=True, layer_types=_hybrid(32, 4),
            max_position_embeddings=65536,
            linear_attention=LinearAttentionConfig(
                linear_num_key_heads=30, linear_num_value_heads=30, linear_key_head_dim=96,
                linear_value_head_dim=192, mixer='gated_deltanet_split', allow_neg_eigval=True, norm_eps=1e-5
            ),
        ),
        source='Ai2 2026, Olmo Hybrid (model card, allenai/Olmo-Hybrid-7B); transformers 5.25 OlmoHybridConfig '
            'defaults, documented there as that checkpoint (linear heads and widths derived as the class does: '
            '30 heads, keys 0.75 * 3840 / 30 = 96 wide, values twice that)',
        notes='24 Gated DeltaNet layers with beta in [0, 2] (negative eigenvalues; a 30 x 96 x 192 fp32 state per '
            'layer and sequence) and 8 OLMo 3 attention layers (every 4th, MHA 30 x 128, post-norms); 7.43B '
            'parameters, 120 KiB of bf16 K/V per token.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='mistral-small-4-119b',
            vocab_size=131072, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
            intermediate_size=12288, num_key_value_heads=32, max_position_embeddings=1048576,
            rope={FULL: RopeParams(theta=10000.0, interleaved=True, scaling={
                "rope_type": "yarn", "factor": 128.0, "original_max_position_embeddings": 8192, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})},
            latent=LatentConfig(
                hidden_size=4096, num_attention_heads=32, kv_lora_rank=256, q_lora_rank=1024, qk_nope_head_dim=64,
                qk_rope_head_dim=64, v_head_dim=128, rope_scaling={
                    "rope_type": "yarn", "factor": 128.0, "original_max_position_embeddings": 8192,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                max_position_embeddings=1048576, query_scale_beta=0.1, query_scale_period=8192
            ),
            moe=MoEConfig(
                n_routed_experts=128, num_experts_per_tok=4, moe_intermediate_size=2048, n_shared_experts=1,
                topk_method='group_limited_top2', n_group=1, topk_group=1, norm_topk_prob=True
            ),
        ),
        source='Mistral AI 2026, Mistral Small 4 (model card, mistralai/Mistral-Small-4-119B-2603: 119B parameters, '
            '6.5B active); transformers 5.25 Mistral4Config defaults, documented there as that checkpoint',
        notes='MLA (latent 256 + 64 rotated channels, 320 per token and layer: 22.5 KiB bf16 for 36 layers) with '
            'interleaved YaRN RoPE and Llama 4 query scaling; 128 experts of 2048, 4 per token, plus 1 shared.',
    ),
    ModelPreset(
        config=DecoderConfig(
            name='llama-70b-mha',
            vocab_size=32000, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
            intermediate_size=28672, num_key_value_heads=64, max_position_embeddings=4096,
        ),
        context_stated=False,
        source='Teaching example: the Llama 2 70B shape (arXiv:2307.09288) without GQA',
        notes="2 x 128,000 x 64 x 128 x 2 B = 4.19 GB per layer, 335 GB for 80 layers at fp16; the texts' '128K' "
            'is decimal, 128,000 tokens.',
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

    The layout (layer types, window, head widths, MLA dims) is :func:`qkv.config.hf_config.read_layout`'s, the
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
    whole = _whole_model_fields(cfg, layout.name)
    v_head_dim = cfg.get("v_head_dim") if lat is None else None
    head_dim = lat.qk_head_dim if lat is not None else layout.head_dim
    config = _hf_decoder_config(
        name=name or layout.name or "config",
        num_hidden_layers=layout.num_hidden_layers,
        num_attention_heads=layout.num_attention_heads,
        num_key_value_heads=layout.num_key_value_heads,
        head_dim=head_dim,
        hidden_size=layout.hidden_size,
        sliding_window=layout.sliding_window,
        layer_types=layout.layer_types,
        latent=lat,
        linear_attention=layout.linear_attention,
        **{**whole, **_per_layer_fields(cfg, layout)},
    )
    return ModelPreset(config=config, source=source, context_stated=whole["max_position_embeddings"] is not None,
                       v_head_dim=v_head_dim if v_head_dim not in (None, head_dim) else None)


def _per_layer_fields(cfg: Mapping[str, Any], layout: DecoderConfig) -> dict[str, Any]:
    """Gemma 4's per-layer shapes: the layout's per-type heads, K = V and KV sharing, and the config's per-layer
    inputs, double-wide MLP on the KV-shared layers, value norm, layer scalars and the experts beside the dense MLP
    (as ``family_gemma4`` builds)."""
    if layout.name != "gemma4_text":
        return {}
    n, shared = layout.num_hidden_layers, layout.kv_shared_from
    widths = None
    if cfg.get("use_double_wide_mlp") and shared is not None:
        widths = tuple(cfg["intermediate_size"] * (2 if shared[i] is not None else 1) for i in range(n))
    ple = cfg.get("hidden_size_per_layer_input") or None
    return dict(head_dim_by_type=layout.head_dim_by_type, kv_heads_by_type=layout.kv_heads_by_type,
                k_eq_v_types=layout.k_eq_v_types, kv_shared_from=shared, value_norm=True, layer_scalars=True,
                sandwich_norms=True, qk_norm=True,
                per_layer_input_size=ple, per_layer_vocab_size=cfg.get("vocab_size_per_layer_input") if ple else None,
                intermediate_sizes=widths, moe=read_moe({**cfg, "model_type": "gemma4_text"}))


def _hf_decoder_config(*, name: str, hidden_size: int, num_attention_heads: int, head_dim: int, latent,
                       mlp: str, sandwich_norms: bool, pre_norms: bool, attention_bias: bool, qkv_bias: bool,
                       learned_positions: int | None, max_position_embeddings: int | None,
                       q_lora_rank: int | None = None, index_n_heads: int | None = None,
                       index_head_dim: int | None = None, index_topk: int | None = None,
                       n_routed_experts: int | None = None, num_experts_per_tok: int | None = None,
                       moe_intermediate_size: int | None = None, n_shared_experts: int = 0,
                       first_k_dense_replace: int = 0, router_bias: bool = False,
                       shared_expert_intermediate_size: int | None = None, shared_expert_gate: bool = False,
                       **same: Any) -> DecoderConfig:
    """The DecoderConfig of a HF config's fields (:func:`_whole_model_fields` and the layout's): HF's flat names
    mapped onto the description, what HF leaves to the family taking its usual value (SiLU gates, tanh-GELU for
    dense feed-forwards and for Gemma's pre- and post-norm layout, RoPE unless a learned position table or MLA
    without positions; experts with biases are GPT-OSS's clamped SwiGLU experts, HF's default limit 7)."""
    dense = mlp == "dense"
    kw: dict[str, Any] = dict(
        name=name, hidden_size=hidden_size, num_attention_heads=num_attention_heads, gated_mlp=not dense,
        hidden_act="gelu_tanh" if dense else ("gelu_pytorch_tanh" if sandwich_norms and pre_norms else "silu"),
        qkv_bias=attention_bias or qkv_bias, o_bias=attention_bias, sandwich_norms=sandwich_norms,
        pre_norms=pre_norms, position="learned" if learned_positions else "rope",
        max_position_embeddings=learned_positions or max_position_embeddings or 4096, **same)
    if head_dim != hidden_size // num_attention_heads and latent is None:
        kw["head_dim"] = head_dim
    if set(kw["layer_types"]) == {FULL}:  # all global: a window no layer uses is not stated
        kw.update(sliding_window=None, layer_types=None)
    if latent is not None:
        kw["latent"] = LatentConfig(hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                                    kv_lora_rank=latent.kv_lora_rank, q_lora_rank=q_lora_rank,
                                    qk_nope_head_dim=latent.qk_nope_head_dim, qk_rope_head_dim=latent.qk_rope_head_dim,
                                    v_head_dim=latent.v_head_dim, use_rope=latent.use_rope)
        if not latent.use_rope:
            kw["position"] = "none"
    if index_topk is not None:
        kw["indexer"] = IndexerConfig(index_n_heads=index_n_heads, index_head_dim=index_head_dim,
                                      index_topk=index_topk)
    if n_routed_experts is not None and moe_intermediate_size is not None:
        kw["moe"] = MoEConfig(n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok,
                              moe_intermediate_size=moe_intermediate_size, n_shared_experts=n_shared_experts,
                              first_k_dense_replace=first_k_dense_replace, router_bias=router_bias,
                              swiglu_limit=7.0 if kw["mlp_bias"] else None,
                              shared_expert_intermediate_size=shared_expert_intermediate_size,
                              shared_expert_gate=shared_expert_gate)
    elif n_routed_experts is not None:  # experts of an unstated width: attention only, never counted as dense
        kw["intermediate_size"] = None
    return DecoderConfig(**kw)


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
        >>> get_preset("Llama_3_70B").config.num_key_value_heads
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
