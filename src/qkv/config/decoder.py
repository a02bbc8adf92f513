"""Model configs (frozen dataclasses) and the named preset registry that tests, benchmarks and the CLI read.

- :class:`DecoderConfig`: the one decoder-only language model, :class:`qkv.nn.DecoderLM` (Llama, Mistral,
  Qwen2, Gemma 2/3, DeepSeek-V2, GPT-2, BLOOM shapes), under HF field names.
- :class:`TransformerConfig`: the encoder, decoder and encoder-decoder stacks of :mod:`qkv.nn.transformer`
  (BERT, T5, the Vaswani et al. model, the examples).

TransformerConfig's field names are short (``d_model``, ``n_heads``); HF transformers' names are read-only aliases
(``hidden_size``, ``num_attention_heads``, ...) and :meth:`TransformerConfig.from_dict` accepts either,
so an HF ``config.json`` maps over directly. Positional schemes: ``"rope"`` (Su et al. 2021),
``"learned"`` (GPT-2/BERT), ``"sinusoidal"`` (Vaswani et al. 2017), ``"alibi"`` (Press et al. 2022),
``"t5"`` (Raffel et al. 2020 buckets), ``"shaw"`` (Shaw et al. 2018) or ``"none"``.

Example:
    >>> from qkv.nn import PRESETS, get_config
    >>> cfg = get_config("tiny-llama", num_hidden_layers=1)
    >>> cfg.hidden_size, cfg.num_key_value_heads, cfg.position
    (64, 2, 'rope')
    >>> sorted(PRESETS)[:3]
    ['tiny-bloom', 'tiny-encoder', 'tiny-gemma']
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .compressed import CompressedAttentionConfig
from .dsa import IndexerConfig
from .gated_residual import GatedResidualConfig
from .hyper import HyperConfig
from .latent import LatentConfig
from .layer_types import DECODER_LAYER_TYPES, FULL_ATTENTION, LAYER_TYPES, LINEAR_ATTENTION, SLIDING_ATTENTION
from .linear import LinearAttentionConfig
from .moe import MoEConfig
from .msa import MSAConfig
from .ple import PLEConfig
from .qsa import QSAConfig
from .rope import RopeParams, check_rope_scaling

__all__ = ["DecoderConfig", "RopeParams", "TransformerConfig", "PRESETS", "get_config", "decoder_config_from_preset",
           "POSITIONS", "DECODER_POSITIONS", "FULL_ATTENTION", "SLIDING_ATTENTION", "ACTIVATION_NAMES", "NORMS"]

POSITIONS = ("rope", "learned", "sinusoidal", "alibi", "t5", "shaw", "none")
DECODER_POSITIONS = ("rope", "learned", "alibi", "none")
#: Feed-forward activations by name (the functions are :data:`qkv.nn.activations.ACTIVATIONS`, same keys).
ACTIVATION_NAMES = ("silu", "swish", "gelu", "gelu_tanh", "gelu_pytorch_tanh", "gelu_new", "relu", "swiglu", "geglu")
#: Norm kinds: ``"layer"`` (scale and shift) and ``"rms"`` (a scale per channel).
NORMS = ("layer", "rms")



def _positive_ints(owner: str, obj, names) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{owner}: {name} must be a positive int, got {v!r}")


def _check_layer_types(owner: str, layer_types: tuple[str, ...], n_layers: int, sliding_window,
                       known: tuple[str, ...] = LAYER_TYPES) -> None:
    if len(layer_types) != n_layers:
        raise ValueError(f"{owner}: layer_types has {len(layer_types)} entries for {n_layers} layers")
    bad = set(layer_types) - set(known)
    if bad:
        raise ValueError(f"{owner}: layer_types must be one of {known}, got {sorted(bad)}")
    if SLIDING_ATTENTION in layer_types and not (isinstance(sliding_window, int) and sliding_window > 0):
        raise ValueError(f"{owner}: sliding_attention layers need sliding_window (keys per query, a positive int), "
                         f"got {sliding_window!r}")

#: HF transformers names -> our field names.
_HF_ALIASES = {
    "hidden_size": "d_model",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "num_hidden_layers": "n_layers",
    "intermediate_size": "d_ff",
    "hidden_act": "activation",
    "rms_norm_eps": "norm_eps",
    "layer_norm_eps": "norm_eps",
}


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """One transformer stack's shape and choices. Derived fields are filled in ``__post_init__``.

    Args:
        d_model: model width (HF ``hidden_size``).
        n_heads: query heads (``num_attention_heads``).
        n_layers: blocks (``num_hidden_layers``); an encoder-decoder uses it for each side.
        n_kv_heads: key/value heads (``num_key_value_heads``; default ``n_heads``).
        head_dim: per-head width (default ``d_model // n_heads``).
        d_ff: feed-forward hidden width (``intermediate_size``; default ``4 * d_model``).
        activation: feed-forward activation, one of ``ACTIVATION_NAMES`` (``"swiglu"``, ``"geglu"``
            are gated).
        norm: ``"layer"`` or ``"rms"``; ``norm_eps`` its epsilon.
        norm_first: pre-norm (True, GPT-2 onwards) or post-norm (False, Vaswani et al., BERT).
        attention_bias, mlp_bias: biases on attention and feed-forward projections.
        qk_norm: ``None``, ``"rms"`` or ``"layer"`` per-head query/key norm.
        position: positional scheme, one of ``POSITIONS``.
        rope_theta, rope_scaling, partial_rotary_factor, rope_interleaved: RoPE (HF names; ``rope_scaling``
            is HF's dict with ``rope_type``).
        max_position_embeddings: context length (learned table size; RoPE ``dynamic`` threshold).
        sliding_window: keys per query on local layers, the query included (HF convention).
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"`` (HF); default: all sliding when
            ``sliding_window`` is set, else all full.
        relative_attention_num_buckets, relative_attention_max_distance: T5 buckets.
        shaw_max_distance, shaw_values: Shaw clipping distance and whether values get representations too.
        vocab_size: token vocabulary (token-level models).
        tie_word_embeddings: LM head shares the token embedding matrix.
        dropout: residual/embedding dropout; ``attention_dropout``: on attention probabilities.
        initializer_range: std of the normal init of linear and embedding weights.
        scale_embeddings: multiply token embeddings by ``sqrt(d_model)`` (Vaswani et al., Gemma).
        attention_scale: score scale override (None: ``head_dim ** -0.5``; T5 uses 1.0).
        backend: the ``qkv.attention`` backend every layer uses.
        name: preset name, informational.
    """

    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    activation: str = "gelu"
    norm: str = "layer"
    norm_eps: float = 1e-5
    norm_first: bool = True
    attention_bias: bool = True
    mlp_bias: bool = True
    qk_norm: str | None = None
    position: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    shaw_max_distance: int = 16
    shaw_values: bool = False
    vocab_size: int = 256
    tie_word_embeddings: bool = True
    dropout: float = 0.0
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    scale_embeddings: bool = False
    attention_scale: float | None = None
    backend: str = "auto"
    name: str = ""
    _derived: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        derived = set()

        def set_(key, value):  # frozen: only derived fields are filled in, and remembered as derived
            derived.add(key)
            object.__setattr__(self, key, value)

        _positive_ints("TransformerConfig", self, ("d_model", "n_heads", "n_layers"))
        if self.n_kv_heads is None:
            set_("n_kv_heads", self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"TransformerConfig: n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads})")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"TransformerConfig: d_model ({self.d_model}) is not divisible by n_heads "
                                 f"({self.n_heads}); set head_dim")
            set_("head_dim", self.d_model // self.n_heads)
        if self.d_ff is None:
            set_("d_ff", 4 * self.d_model)
        if self.activation not in ACTIVATION_NAMES:
            raise ValueError(f"TransformerConfig: activation must be one of {tuple(ACTIVATION_NAMES)}, got "
                             f"{self.activation!r}")
        if self.norm not in NORMS:
            raise ValueError(f"TransformerConfig: norm must be one of {NORMS}, got {self.norm!r}")
        if self.position not in POSITIONS:
            raise ValueError(f"TransformerConfig: position must be one of {POSITIONS}, got {self.position!r}")
        if self.rope_scaling is not None:
            # A private copy (callers' later edits do not leak in); a plain dict so configs pickle and deepcopy.
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
        if self.layer_types is None:
            kind = SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION
            set_("layer_types", (kind,) * self.n_layers)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        _check_layer_types("TransformerConfig", self.layer_types, self.n_layers, self.sliding_window)
        object.__setattr__(self, "_derived", frozenset(derived))
        if self.position == "rope":  # validate RoPE early, without building it
            check_rope_scaling(self.rope_scaling, owner="TransformerConfig")
            rotary = int(self.head_dim * self.partial_rotary_factor)
            if not 0 < rotary <= self.head_dim or rotary % 2:
                raise ValueError(f"TransformerConfig: the rotary dim must be even and in (0, head_dim="
                                 f"{self.head_dim}], got {rotary} (partial_rotary_factor={self.partial_rotary_factor})")
            if not self.rope_theta > 0:
                raise ValueError(f"TransformerConfig: rope_theta must be > 0, got {self.rope_theta}")

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def num_attention_heads(self) -> int:
        return self.n_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.n_kv_heads

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers

    @property
    def intermediate_size(self) -> int:
        return self.d_ff

    def window_for(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None for a full-attention layer)."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    @property
    def rope_params(self) -> RopeParams:
        """This config's RoPE as data (:meth:`qkv.pos.RotaryEmbedding.from_params` builds it)."""
        return RopeParams(theta=self.rope_theta, scaling=self.rope_scaling, interleaved=self.rope_interleaved,
                          partial_rotary_factor=self.partial_rotary_factor)

    def replace(self, **changes) -> TransformerConfig:
        """A copy with ``changes`` (HF names accepted); derived fields are recomputed unless given."""
        return TransformerConfig.from_dict({**self._explicit(), **changes})

    def _explicit(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.init and f.name not in self._derived}
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, strict: bool = True) -> TransformerConfig:
        """Build from a mapping with our names or HF names (``config.to_dict()`` of an HF config works with
        ``strict=False``, which ignores keys this config has no field for)."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = _HF_ALIASES.get(key, key)
            if name == "rope_parameters":
                name = "rope_scaling"
            if name not in names:
                if strict:
                    close = difflib.get_close_matches(key, [*names, *_HF_ALIASES], n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise ValueError(f"TransformerConfig: unknown field {key!r}{hint}")
                continue
            kwargs[name] = value
        if isinstance(kwargs.get("rope_scaling"), Mapping):  # HF's RoPE keys: read by the one reader
            from .hf_config import read_rope

            hf = {k: v for k, v in d.items() if k in ("rope_theta", "rope_scaling", "rope_parameters",
                                                       "partial_rotary_factor")}
            rope = read_rope(hf)[FULL_ATTENTION]
            kwargs.setdefault("rope_theta", rope.theta)
            kwargs["rope_scaling"] = dict(rope.scaling) if rope.scaling else None
            if rope.partial_rotary_factor != 1.0:
                kwargs.setdefault("partial_rotary_factor", rope.partial_rotary_factor)
        if isinstance(kwargs.get("layer_types"), list):
            kwargs["layer_types"] = tuple(kwargs["layer_types"])
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Everything that distinguishes the supported decoder families (HF field names where HF has one).

    Args:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size: as in HF.
            ``vocab_size`` and ``intermediate_size`` may be None in a description of the attention layout only
            (what :func:`qkv.config.hf_config.read_layout` reads from a config that states no more): the cache and the
            attention arithmetic need neither; :class:`qkv.nn.DecoderLM` and the whole-model counts refuse it.
        num_key_value_heads: KV heads (default ``num_attention_heads``; 1 is MQA).
        head_dim: per-head width (default ``hidden_size // num_attention_heads``).
        hidden_act: activation of the feed-forward (its gate when ``gated_mlp``), a key of
            :data:`qkv.nn.activations.ACTIVATIONS`.
        gated_mlp: a gated feed-forward with fused gate/up projection (:class:`qkv.nn.GatedMLP`, Llama and
            after); False: ``down(act(up(x)))`` (:class:`qkv.nn.FeedForward`, GPT-2, BLOOM).
        norm: ``"rms"`` (:class:`qkv.nn.RMSNorm`) or ``"layer"`` (``nn.LayerNorm`` with bias, GPT-2, BLOOM).
        rms_norm_eps: epsilon of every RMSNorm; layer_norm_eps: of every LayerNorm.
        norm_offset: RMSNorm scales by ``norm_offset + weight`` (Gemma: 1.0, weights stored around 0).
        position: ``"rope"`` (rotary, per layer type from ``rope``), ``"learned"`` (absolute embeddings added
            to the tokens, GPT-2), ``"alibi"`` (linear biases, Press et al. 2022, BLOOM) or ``"none"`` (no
            positions: order comes from the causal mask alone; Kimi Linear's MLA, ``latent.use_rope=False``).
        embed_norm: a LayerNorm right after the token embedding (BLOOM).
        scale_embeddings: multiply token embeddings by ``sqrt(hidden_size)`` (Gemma).
        sandwich_norms: also normalize each branch's output (Gemma 2/3 post-attention and
            post-feed-forward norms).
        qkv_bias, o_bias, mlp_bias: biases of the QKV, output and feed-forward projections.
        qk_norm: RMSNorm of queries and keys before RoPE (Gemma 3, Qwen3, OLMo 2/3).
        qk_norm_scope: what ``qk_norm`` normalizes: ``"head"`` each head's ``head_dim`` channels (Gemma 3,
            Qwen3) or ``"projection"`` the whole query / key projection, all heads at once (OLMo 2/3).
        pre_norms: normalize each branch's input (False: OLMo 2/3, whose blocks only normalize the branch
            outputs; set ``sandwich_norms`` with it).
        linear_pre_norms: ``linear_attention`` (recurrent) layers normalize each branch's input and nothing else
            (Llama's placement), whatever ``pre_norms`` and ``sandwich_norms`` say of the attention layers
            (OLMo-hybrid: OLMo 3's post-normed attention layers beside pre-normed Gated DeltaNet layers).
        attention_sinks: one learnable sink logit per query head joins every softmax (GPT-OSS,
            :mod:`qkv._sinks`); parameter ``self_attn.sinks`` (Hq,).
        attention_scale: score scale (default ``head_dim ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``).
        attn_logit_softcapping: ``cap * tanh(score / cap)`` on attention scores (Gemma 2).
        final_logit_softcapping: the same on the output logits (Gemma 2).
        tie_word_embeddings: the LM head is the embedding matrix.
        sliding_window: keys per query on ``sliding_attention`` layers, the query included (HF convention).
        layer_types: per layer ``"full_attention"``, ``"sliding_attention"`` or ``"linear_attention"`` (a
            recurrent layer, shaped by ``linear_attention``) (default: all full).
        rope: RoPE per layer type (a missing type uses ``"full_attention"``'s).
        nope_layers: indices of attention layers that rotate nothing (NoPE, Kazemnejad et al. 2023,
            arXiv:2305.19466; SmolLM3 leaves every fourth layer unrotated); the others keep ``rope``. Needs
            ``position="rope"`` and grouped-query attention (an MLA layer's NoPE is its ``use_rope``).
        max_position_embeddings: context length (RoPE ``dynamic``/YaRN defaults).
        latent: Multi-head Latent Attention on every layer (DeepSeek-V2) instead of GQA: a
            :class:`qkv.nn.latent.LatentConfig` (its RoPE comes from ``rope``, its scale from itself;
            ``position`` is ``"rope"``, or ``"none"`` exactly when its ``use_rope`` is False).
        moe: DeepSeekMoE feed-forward on the layers it selects.
        linear_attention: the recurrent mixer of the ``"linear_attention"`` layers (a
            :class:`qkv.config.linear.LinearAttentionConfig`: Gated DeltaNet of Qwen3-Next / Qwen3.5).
        attn_output_gate: the attention output is multiplied by ``sigmoid(gate)``, ``gate`` a per-channel
            projection of the layer input (Qwen3-Next's gated attention; HF folds it into ``q_proj``).
        indexer: DeepSeek Sparse Attention on every MLA layer (DeepSeek-V3.2): a
            :class:`qkv.config.dsa.IndexerConfig`; needs ``latent`` with a ``q_lora_rank``. Those layers
            (:class:`qkv.nn.SparseLatentAttention`) run on the ``gather`` backend when ``backend`` is ``"auto"``
            (each query reads only its ``index_topk`` latents, whatever the context).
        qsa: QSA indexed attention on every ``full_attention`` layer (Qwen4-Exp): a
            :class:`qkv.config.qsa.QSAConfig`; those layers (:class:`qkv.nn.IndexedAttention`) read only the
            tokens their indexer keeps, on the ``gather`` backend when ``backend`` is ``"auto"``.
        msa: MiniMax-M3's block-sparse attention on the layers it names (:class:`qkv.config.msa.MSAConfig`); those
            layers (:class:`qkv.nn.msa.BlockSparseAttention`) read only the key blocks their indexer keeps per KV
            group, on the ``gather`` backend when ``backend`` is ``"auto"``.
        gated_residual: Qwen4-Exp's gated hyper-connection (:class:`qkv.config.gated_residual.GatedResidualConfig`):
            ``streams`` residual streams, each block reading a gated mix of them (its norm: set ``pre_norms``
            False) and writing into every one (:class:`qkv.nn.GatedResidual`).
        ple: Qwen4-Exp's Per-Layer Embedding on the layers it names (:class:`qkv.config.ple.PLEConfig`); needs
            ``gated_residual``.
        final_norm: normalize the last hidden state before the LM head (False: Qwen4-Exp, whose residual read-out
            is normed already).
        head_dim_by_type, kv_heads_by_type: head width and KV heads of the attention layers of a layer type, where
            they differ from ``head_dim`` / ``num_key_value_heads`` (Gemma 4's global layers: wider heads, fewer
            KV heads); e.g. ``{"full_attention": 512}``.
        k_eq_v_types: layer types whose attention has no value projection: the key projection serves as both
            (K = V, Gemma 4's ``attention_k_eq_v`` on its global layers); keys are then normed and rotated, values
            taken before either (``value_norm`` still applies).
        value_norm: an RMSNorm without a scale on each value head (Gemma 4).
        kv_shared_from: per layer, None or the earlier layer whose keys and values it attends over instead of
            computing and caching its own (cross-layer KV sharing, Brandon et al. 2024, arXiv:2405.12981; Gemma 4's
            ``num_kv_shared_layers``): a layer of the same type that shares from no one. Such a layer has a query
            projection only and a :class:`qkv.cache.SharedSpec` cache that allocates nothing.
        per_layer_input_size: width of the per-layer input embeddings (Gemma 4's ``hidden_size_per_layer_input``,
            :class:`qkv.nn.PerLayerInputs`); None: none. ``per_layer_vocab_size``: their table's rows (default
            ``vocab_size``).
        layer_scalars: each layer's output is multiplied by a stored scalar (Gemma 4's ``layer_scalar``).
        intermediate_sizes: per layer, the feed-forward width where it differs from ``intermediate_size``
            (Gemma 4's double-wide MLP on the KV-shared layers).
        backend: the :func:`qkv.attention` backend of every layer.
        decode_backend: the backend of single-query steps (one new token per row) when ``backend`` is
            ``"auto"`` and the layer's request allows it (no soft-capping). ``"sdpa"`` by default: measured
            fastest for one query row on CPU, and it skips ``auto``'s per-call cost estimates, which cost
            more than the attention itself at decode sizes. MLA layers use it for every step (one backend
            per :class:`qkv.nn.latent.LatentAttention`). None: always ``backend``.
    """

    vocab_size: int | None
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int | None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    gated_mlp: bool = True
    norm: str = "rms"
    rms_norm_eps: float = 1e-6
    layer_norm_eps: float = 1e-5
    norm_offset: float = 0.0
    position: str = "rope"
    embed_norm: bool = False
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_scope: str = "head"
    pre_norms: bool = True
    linear_pre_norms: bool = False
    attention_sinks: bool = False
    attention_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope: Mapping[str, RopeParams] = field(default_factory=lambda: {FULL_ATTENTION: RopeParams()})
    nope_layers: tuple[int, ...] = ()
    max_position_embeddings: int = 2048
    latent: LatentConfig | None = None
    moe: MoEConfig | None = None
    linear_attention: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    indexer: IndexerConfig | None = None
    qsa: QSAConfig | None = None
    msa: MSAConfig | None = None
    gated_residual: GatedResidualConfig | None = None
    ple: PLEConfig | None = None
    final_norm: bool = True
    head_dim_by_type: Mapping[str, int] = field(default_factory=dict)
    kv_heads_by_type: Mapping[str, int] = field(default_factory=dict)
    k_eq_v_types: tuple[str, ...] = ()
    value_norm: bool = False
    kv_shared_from: tuple[int | None, ...] | None = None
    per_layer_input_size: int | None = None
    per_layer_vocab_size: int | None = None
    layer_scalars: bool = False
    intermediate_sizes: tuple[int, ...] | None = None
    compressed: CompressedAttentionConfig | None = None
    hyper: HyperConfig | None = None
    backend: str = "auto"
    decode_backend: str | None = "sdpa"
    name: str = ""
    _derived: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __deepcopy__(self, memo) -> DecoderConfig:  # immutable (its mappings are read-only views): share it
        return self

    def __reduce__(self):  # pickle the explicit fields, with plain dicts (read-only views do not pickle)
        kept = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.init and f.name not in self._derived}
        kept["rope"] = dict(self.rope)
        kept["head_dim_by_type"], kept["kv_heads_by_type"] = dict(self.head_dim_by_type), dict(self.kv_heads_by_type)
        return (_decoder_config, (kept,))

    def __post_init__(self) -> None:
        derived = set()

        def set_(key, value):  # only derived fields are filled in, and remembered as derived
            derived.add(key)
            object.__setattr__(self, key, value)

        _positive_ints("DecoderConfig", self, ("hidden_size", "num_hidden_layers", "num_attention_heads")
                       + tuple(f for f in ("vocab_size", "intermediate_size") if getattr(self, f) is not None))
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DecoderConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        _positive_ints("DecoderConfig", self, ("num_key_value_heads", "head_dim", "max_position_embeddings"))
        if self.hidden_act not in ACTIVATION_NAMES:
            raise ValueError(f"DecoderConfig: hidden_act {self.hidden_act!r} is not supported; supported: "
                             f"{', '.join(ACTIVATION_NAMES)}")
        if self.norm not in NORMS:
            raise ValueError(f"DecoderConfig: norm must be one of {NORMS}, got {self.norm!r}")
        if self.position not in DECODER_POSITIONS:
            raise ValueError(f"DecoderConfig: position must be one of {DECODER_POSITIONS}, got {self.position!r}")
        if self.layer_types is None:
            set_("layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        _check_layer_types("DecoderConfig", self.layer_types, self.num_hidden_layers, self.sliding_window,
                           DECODER_LAYER_TYPES)
        if (LINEAR_ATTENTION in self.layer_types) != (self.linear_attention is not None):
            raise ValueError(f"DecoderConfig: {LINEAR_ATTENTION!r} layers and linear_attention (their mixer's shape) "
                             f"go together; got {self.layer_types.count(LINEAR_ATTENTION)} such layers and "
                             f"linear_attention={self.linear_attention!r}")
        self._check_nope_layers()
        if self.latent is not None and SLIDING_ATTENTION in self.layer_types:
            raise ValueError("DecoderConfig: latent attention (MLA) layers have no sliding window")
        if self.latent is not None and self.latent.hidden_size != self.hidden_size:
            raise ValueError(f"DecoderConfig: latent.hidden_size ({self.latent.hidden_size}) must equal hidden_size "
                             f"({self.hidden_size}): the latent attention (MLA) layers read the residual stream; build "
                             f"it with LatentConfig(hidden_size={self.hidden_size}, ...) (DecoderConfig.replace and "
                             f"get_config carry a new hidden_size into the latent themselves)")
        if FULL_ATTENTION not in self.rope:
            raise ValueError(f"DecoderConfig: rope needs a {FULL_ATTENTION!r} entry, got {sorted(self.rope)}")
        object.__setattr__(self, "rope", MappingProxyType(dict(self.rope)))  # given (or defaulted), never derived
        for kind, softcap in (("attn_logit_softcapping", self.attn_logit_softcapping),
                              ("final_logit_softcapping", self.final_logit_softcapping)):
            if softcap is not None and not softcap > 0:
                raise ValueError(f"DecoderConfig: {kind} must be > 0 or None, got {softcap!r}")
        if self.qk_norm_scope not in ("head", "projection"):
            raise ValueError(f"DecoderConfig: qk_norm_scope must be 'head' or 'projection', got {self.qk_norm_scope!r}")
        if not self.pre_norms and not self.sandwich_norms and self.gated_residual is None:
            raise ValueError("DecoderConfig: pre_norms=False needs sandwich_norms=True (a block without any norm "
                             "is not a supported family)")
        if self.latent is not None and self.attn_output_gate:
            raise ValueError("DecoderConfig: attn_output_gate is not supported with latent attention (MLA)")
        if self.latent is not None and self.attention_sinks:
            raise ValueError("DecoderConfig: attention_sinks are not supported with latent attention (MLA)")
        if self.latent is not None and self.position != ("rope" if self.latent.use_rope else "none"):
            want = "'rope'" if self.latent.use_rope else "'none' (its use_rope is False: NoPE)"
            raise ValueError(f"DecoderConfig: this latent attention (MLA) needs position={want}, got "
                             f"position={self.position!r}")
        if self.indexer is not None and not isinstance(self.indexer, IndexerConfig):
            raise TypeError(f"DecoderConfig: indexer must be a qkv.config.dsa.IndexerConfig or None, got "
                            f"{type(self.indexer).__name__}")
        if self.indexer is not None and (self.latent is None or self.latent.q_lora_rank is None
                                         or self.indexer.index_head_dim < self.latent.qk_rope_head_dim):
            raise ValueError(f"DecoderConfig: indexer (DeepSeek Sparse Attention) needs latent with a q_lora_rank and "
                             f"index_head_dim >= its qk_rope_head_dim; got latent={self.latent!r}, "
                             f"indexer={self.indexer!r}")
        self._check_layer_shapes()
        self._check_deepseek_v4()
        if self.qsa is not None and (not isinstance(self.qsa, QSAConfig) or self.latent is not None
                                     or SLIDING_ATTENTION in self.layer_types):
            raise ValueError(f"DecoderConfig: qsa (Qwen4-Exp's indexed attention) needs a qkv.config.qsa.QSAConfig on "
                             f"grouped-query full-attention layers (no latent, no sliding layers); got "
                             f"qsa={self.qsa!r}, latent={self.latent!r}, layer_types={self.layer_types}")
        if self.msa is not None and (
                not isinstance(self.msa, MSAConfig) or self.latent is not None or self.qsa is not None
                or self.msa.index_n_heads != self.num_key_value_heads
                or any(i >= self.num_hidden_layers or self.layer_types[i] != FULL_ATTENTION for i in self.msa.layers)):
            raise ValueError(f"DecoderConfig: msa (MiniMax-M3's block-sparse attention) needs a "
                             f"qkv.config.msa.MSAConfig with one indexer head per KV head "
                             f"(num_key_value_heads={self.num_key_value_heads}) on grouped-query full-attention layers "
                             f"(no latent, no qsa); got msa={self.msa!r}, latent={self.latent!r}, "
                             f"layer_types={self.layer_types}")
        if self.ple is not None and (self.gated_residual is None or any(
                i >= self.num_hidden_layers or self.layer_types[i] != LINEAR_ATTENTION for i in self.ple.layers)):
            raise ValueError(f"DecoderConfig: ple (Per-Layer Embedding) needs gated_residual (it writes into the "
                             f"residual streams) and linear_attention layers only; got layers {self.ple.layers} of "
                             f"{self.layer_types}, gated_residual={self.gated_residual!r}")
        object.__setattr__(self, "_derived", frozenset(derived))

    def _check_layer_shapes(self) -> None:
        """Per-type head shapes, K = V, cross-layer KV sharing, per-layer inputs and widths (Gemma 4's options)."""
        attn_types = (FULL_ATTENTION, SLIDING_ATTENTION)
        for name in ("head_dim_by_type", "kv_heads_by_type"):
            given = getattr(self, name)
            if not isinstance(given, Mapping):
                raise TypeError(f"DecoderConfig: {name} must be a dict layer type -> int, got {type(given).__name__}")
            for kind, v in given.items():
                if kind not in attn_types or not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ValueError(f"DecoderConfig: {name} maps {attn_types} to positive ints, got {dict(given)}")
            object.__setattr__(self, name, MappingProxyType(dict(given)))
        if (self.head_dim_by_type or self.kv_heads_by_type) and self.latent is not None:
            raise ValueError("DecoderConfig: head_dim_by_type / kv_heads_by_type shape GQA layers, not latent (MLA) "
                             "ones")
        for kind, h in self.kv_heads_by_type.items():
            if self.num_attention_heads % h:
                raise ValueError(f"DecoderConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                                 f"of kv_heads_by_type[{kind!r}] ({h})")
        object.__setattr__(self, "k_eq_v_types", tuple(self.k_eq_v_types))
        if set(self.k_eq_v_types) - set(attn_types) or (self.k_eq_v_types and self.latent is not None):
            raise ValueError(f"DecoderConfig: k_eq_v_types lists attention layer types {attn_types} of a GQA model, "
                             f"got {self.k_eq_v_types}")
        n = self.num_hidden_layers
        if self.kv_shared_from is not None:
            shared = tuple(self.kv_shared_from)
            object.__setattr__(self, "kv_shared_from", shared)
            if len(shared) != n:
                raise ValueError(f"DecoderConfig: kv_shared_from has {len(shared)} entries for {n} layers")
            if self.latent is not None:
                raise ValueError("DecoderConfig: kv_shared_from (cross-layer KV sharing) is for GQA layers, not MLA")
            for i, src in enumerate(shared):
                if src is None:
                    continue
                if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < i:
                    raise ValueError(f"DecoderConfig: kv_shared_from[{i}] = {src!r} must be an earlier layer (an int "
                                     f"in [0, {i})): a layer reads the keys and values of a layer before it")
                if self.layer_types[src] != self.layer_types[i] or self.layer_types[i] not in attn_types:
                    raise ValueError(f"DecoderConfig: kv_shared_from[{i}] = {src}: layer {i} is "
                                     f"{self.layer_types[i]!r} and layer {src} {self.layer_types[src]!r}; a layer "
                                     f"reads the cache of an attention layer of its own type (same window and shape)")
                if shared[src] is not None:
                    raise ValueError(f"DecoderConfig: kv_shared_from[{i}] = {src}, itself shared from layer "
                                     f"{shared[src]}; point at the layer that computes the keys and values")
        if self.per_layer_input_size is not None:
            _positive_ints("DecoderConfig", self, ("per_layer_input_size",))
        if self.per_layer_vocab_size is not None:
            _positive_ints("DecoderConfig", self, ("per_layer_vocab_size",))
        if self.intermediate_sizes is not None:
            sizes = tuple(self.intermediate_sizes)
            object.__setattr__(self, "intermediate_sizes", sizes)
            if len(sizes) != n or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in sizes):
                raise ValueError(f"DecoderConfig: intermediate_sizes must be {n} positive ints (one per layer), "
                                 f"got {sizes}")

    def head_dim_for(self, layer_idx: int) -> int:
        """Head width of attention layer ``layer_idx`` (``head_dim_by_type`` of its type, else ``head_dim``)."""
        return self.head_dim_by_type.get(self.layer_types[layer_idx], self.head_dim)

    def kv_heads_for(self, layer_idx: int) -> int:
        """KV heads of attention layer ``layer_idx`` (``kv_heads_by_type`` of its type, else
        ``num_key_value_heads``)."""
        return self.kv_heads_by_type.get(self.layer_types[layer_idx], self.num_key_value_heads)

    def k_eq_v_for(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s keys serve as its values (one projection)."""
        return self.layer_types[layer_idx] in self.k_eq_v_types

    def kv_source(self, layer_idx: int) -> int | None:
        """The earlier layer whose keys and values layer ``layer_idx`` reads, or None (it computes its own)."""
        return None if self.kv_shared_from is None else self.kv_shared_from[layer_idx]

    def intermediate_size_for(self, layer_idx: int) -> int | None:
        """Feed-forward width of layer ``layer_idx``."""
        return self.intermediate_size if self.intermediate_sizes is None else self.intermediate_sizes[layer_idx]

    def _check_deepseek_v4(self) -> None:
        """DeepSeek-V4's attention (``compressed``) and residual streams (``hyper``)."""
        if self.hyper is not None and not isinstance(self.hyper, HyperConfig):
            raise TypeError(f"DecoderConfig: hyper must be a qkv.config.hyper.HyperConfig or None, got "
                            f"{type(self.hyper).__name__}")
        c = self.compressed
        if c is None:
            return
        if not isinstance(c, CompressedAttentionConfig):
            raise TypeError(f"DecoderConfig: compressed must be a qkv.config.compressed.CompressedAttentionConfig or "
                            f"None, got {type(c).__name__}")
        problems = []
        if len(c.attention_types) != self.num_hidden_layers:
            problems.append(f"compressed.attention_types has {len(c.attention_types)} entries for "
                            f"{self.num_hidden_layers} layers")
        if self.num_key_value_heads != 1:
            problems.append(f"one KV head shared by every query head (K = V), got num_key_value_heads="
                            f"{self.num_key_value_heads}")
        if set(self.layer_types) != {SLIDING_ATTENTION} or not self.sliding_window:
            problems.append("every layer 'sliding_attention' with a sliding_window (each has a sliding branch)")
        if not self.attention_sinks or self.position != "none" or self.latent is not None:
            problems.append("attention_sinks=True, position='none' (the layers rotate with compressed.main_rope / "
                            "compress_rope) and no latent")
        if (self.num_attention_heads * self.head_dim) % c.o_groups:
            problems.append(f"o_groups ({c.o_groups}) dividing num_attention_heads * head_dim "
                            f"({self.num_attention_heads * self.head_dim})")
        if c.qk_rope_head_dim > self.head_dim:
            problems.append(f"qk_rope_head_dim ({c.qk_rope_head_dim}) <= head_dim ({self.head_dim})")
        if problems:
            raise ValueError("DecoderConfig: DeepSeek-V4 attention (compressed) needs " + "; ".join(problems))
    def _check_nope_layers(self) -> None:
        nope = self.nope_layers
        if not isinstance(nope, (tuple, list)) or any(not isinstance(i, int) or isinstance(i, bool) for i in nope):
            raise TypeError(f"DecoderConfig: nope_layers must be a tuple of layer indices (ints), got {nope!r}")
        object.__setattr__(self, "nope_layers", tuple(nope))
        n = self.num_hidden_layers
        if list(nope) != sorted(set(nope)) or (nope and not 0 <= nope[0] <= nope[-1] < n):
            raise ValueError(f"DecoderConfig: nope_layers must be increasing distinct layer indices in [0, {n}), got "
                             f"{nope!r}")
        if not nope:
            return
        if self.position != "rope":
            raise ValueError(f"DecoderConfig: nope_layers (layers without RoPE) need position='rope' for the others, "
                             f"got position={self.position!r}")
        if self.latent is not None:
            raise ValueError("DecoderConfig: nope_layers is for grouped-query attention layers; latent attention "
                             "(MLA) without RoPE is LatentConfig(use_rope=False) with position='none'")
        recurrent = [i for i in nope if self.layer_types[i] == LINEAR_ATTENTION]
        if recurrent:
            raise ValueError(f"DecoderConfig: nope_layers {recurrent} are {LINEAR_ATTENTION!r} layers, which have no "
                             "RoPE to drop; list attention layers only")

    def layer_norms(self, layer_idx: int) -> tuple[bool, bool]:
        """``(pre, post)``: whether layer ``layer_idx`` normalizes each branch's input, and each branch's output."""
        if self.linear_pre_norms and self.layer_types[layer_idx] == LINEAR_ATTENTION:
            return True, False
        return self.pre_norms, self.sandwich_norms

    def uses_rope(self, layer_idx: int) -> bool:
        """Whether attention layer ``layer_idx`` rotates its queries and keys (RoPE, not a NoPE layer)."""
        return self.position == "rope" and layer_idx not in self.nope_layers

    @property
    def attention_only(self) -> bool:
        """Whether this describes the attention layout only (no ``vocab_size`` or ``intermediate_size``)."""
        return self.vocab_size is None or self.intermediate_size is None

    def window_for(self, layer_idx: int) -> int | None:
        """Keys per query of layer ``layer_idx`` (None: full causal attention)."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    def rope_for(self, layer_type: str) -> RopeParams:
        """The RoPE parameters of layers of ``layer_type`` (``"full_attention"``'s when it has none)."""
        return self.rope.get(layer_type, self.rope[FULL_ATTENTION])

    def replace(self, **changes) -> DecoderConfig:
        """A copy with ``changes``; derived fields (``num_key_value_heads``, ``head_dim``, ``layer_types``
        when they were left out) are derived again unless given.

        Example:
            >>> cfg = DecoderConfig(vocab_size=10, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            ...                     intermediate_size=128)
            >>> cfg.replace(hidden_size=128).head_dim
            32
        """
        names = {f.name for f in dataclasses.fields(self) if f.init}
        unknown = sorted(set(changes) - names)
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"DecoderConfig: unknown field {unknown[0]!r}{hint}")
        kept = {n: getattr(self, n) for n in names if n not in self._derived}
        if self.latent is not None and "latent" not in changes:
            # the MLA layers' width and heads are the model's: a new width or head count reaches them too
            carry = {f: changes[f] for f in ("hidden_size", "num_attention_heads") if f in changes}
            if carry:
                changes = {**changes, "latent": dataclasses.replace(self.latent, **carry)}
                if ("num_attention_heads" in carry and "num_key_value_heads" not in changes
                        and self.num_key_value_heads == self.num_attention_heads):
                    changes["num_key_value_heads"] = carry["num_attention_heads"]
        return DecoderConfig(**{**kept, **changes})


def _decoder_config(kwargs: dict[str, Any]) -> DecoderConfig:
    return DecoderConfig(**kwargs)


_TINY = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=256)
_TINY_STACK = dict(d_model=64, n_heads=4, n_layers=2, vocab_size=256, max_position_embeddings=256)

_PRESETS: dict[str, DecoderConfig | TransformerConfig] = {
    # Llama 2/3 shape: RMSNorm, SwiGLU, GQA, RoPE, no biases, untied head.
    "tiny-llama": DecoderConfig(**_TINY, num_key_value_heads=2, intermediate_size=172, name="tiny-llama"),
    # Mistral 7B v0.1 shape: Llama plus a sliding window on every layer.
    "tiny-mistral": DecoderConfig(**_TINY, num_key_value_heads=2, intermediate_size=172, sliding_window=16,
                                  layer_types=(SLIDING_ATTENTION,) * 2, name="tiny-mistral"),
    # Gemma 2/3 shape: alternating local (sliding) and global layers, tanh-GeGLU, QK norm, RMSNorm around 1 + w,
    # sandwich norms, scaled embeddings, tied head.
    "tiny-gemma": DecoderConfig(**{**_TINY, "num_hidden_layers": 4}, num_key_value_heads=1, intermediate_size=128,
                                hidden_act="gelu_pytorch_tanh", norm_offset=1.0, sandwich_norms=True, qk_norm=True,
                                scale_embeddings=True, sliding_window=8,
                                layer_types=(SLIDING_ATTENTION, FULL_ATTENTION) * 2, tie_word_embeddings=True,
                                name="tiny-gemma"),
    # GPT-2 shape: learned absolute positions, LayerNorm, tanh-GELU MLP, biases, tied head.
    "tiny-gpt": DecoderConfig(**_TINY, intermediate_size=256, hidden_act="gelu_tanh", gated_mlp=False, norm="layer",
                              position="learned", qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True,
                              name="tiny-gpt"),
    # BLOOM shape: ALiBi instead of positions, LayerNorm (also on the embeddings), tanh-GELU MLP, tied head.
    "tiny-bloom": DecoderConfig(**_TINY, intermediate_size=256, hidden_act="gelu_tanh", gated_mlp=False, norm="layer",
                                position="alibi", embed_norm=True, qkv_bias=True, o_bias=True, mlp_bias=True,
                                tie_word_embeddings=True, name="tiny-bloom"),
    # BERT shape: bidirectional, post-norm, learned positions, GELU, biases.
    "tiny-encoder": TransformerConfig(**_TINY_STACK, activation="gelu", norm="layer", norm_eps=1e-12,
                                      norm_first=False, position="learned", name="tiny-encoder"),
    # T5 v1.1 shape: encoder-decoder, RMSNorm, GeGLU, bucketed relative bias, no biases, unscaled scores.
    "tiny-t5": TransformerConfig(**_TINY_STACK, d_ff=128, activation="geglu", norm="rms", norm_eps=1e-6,
                                 attention_bias=False, mlp_bias=False, position="t5", relative_attention_num_buckets=32,
                                 relative_attention_max_distance=128, attention_scale=1.0, tie_word_embeddings=False,
                                 name="tiny-t5"),
    # Vaswani et al. 2017 base shape, shrunk: post-norm, ReLU, sinusoidal positions, scaled embeddings.
    "tiny-transformer": TransformerConfig(**_TINY_STACK, activation="relu", norm="layer", norm_first=False,
                                          position="sinusoidal", scale_embeddings=True, name="tiny-transformer"),
}

#: Named presets, read-only. ``get_config(name, **overrides)`` copies one with changes.
PRESETS: Mapping[str, DecoderConfig | TransformerConfig] = MappingProxyType(_PRESETS)


def get_config(name: str, **overrides) -> DecoderConfig | TransformerConfig:
    """The preset ``name`` (a :class:`DecoderConfig` for the decoder-only shapes, a :class:`TransformerConfig`
    for the encoder and encoder-decoder ones), with ``overrides`` applied through its ``replace``.

    ``name`` may also be a model preset of :mod:`qkv.costs` (``"llama-3-8b"``, ``"mistral-7b-v0.1"``,
    ``"deepseek-v2"``, ...; ``qkv presets`` lists them): the result is a :class:`DecoderConfig` shaped like
    that model (heads, KV heads, head width, window and layer pattern, feed-forward kind, norms, biases,
    tying, MLA, MoE). A random model of the published size is large; shrink it with overrides. Fewer layers
    keep the first layers of the preset's local/global pattern.

    Example:
        >>> cfg = get_config("llama-2-70b", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
        ...                  vocab_size=1000, head_dim=32)
        >>> cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
        (64, 8, 2)
    """
    if name not in PRESETS:
        from .presets import AMBIGUOUS, get_preset
        from .presets import PRESETS as MODEL_PRESETS

        if name in MODEL_PRESETS or name in AMBIGUOUS:
            preset = get_preset(name)
            n = overrides.get("num_hidden_layers", preset.config.num_hidden_layers)
            if "layer_types" not in overrides and isinstance(n, int) and n > 0:  # keep the pattern's first n
                types = preset.config.layer_types
                overrides["layer_types"] = tuple(types[i % len(types)] for i in range(n))
                if "local" not in preset.layer_counts and "recurrent" not in preset.layer_counts:
                    del overrides["layer_types"]
            if "nope_layers" not in overrides and isinstance(n, int) and preset.config.nope_layers:
                overrides["nope_layers"] = tuple(i for i in preset.config.nope_layers if i < n)  # the first n too
            for field in ("kv_shared_from", "intermediate_sizes"):  # per-layer tuples (Gemma 4): the first n too
                per_layer = getattr(preset.config, field)
                if field not in overrides and isinstance(n, int) and per_layer is not None:
                    first = tuple(per_layer[i % len(per_layer)] for i in range(n))
                    if field == "intermediate_sizes" and "intermediate_size" in overrides:  # the same multiples
                        base = preset.config.intermediate_size
                        first = tuple(w * overrides["intermediate_size"] // base for w in first)
                    overrides[field] = first if any(v is not None for v in first) else None
            cfg = decoder_config_from_preset(preset)
            return cfg.replace(**overrides) if overrides else cfg
        known = list(PRESETS) + list(MODEL_PRESETS)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint} Known: {', '.join(sorted(PRESETS))}; and the model "
                         f"presets of qkv.costs: {', '.join(MODEL_PRESETS)}")
    cfg = PRESETS[name]
    return cfg.replace(**overrides) if overrides else cfg


def decoder_config_from_preset(preset) -> DecoderConfig:
    """The :class:`DecoderConfig` of a :class:`qkv.config.ModelPreset` that describes a whole decoder-only model (its
    ``config``, what :class:`qkv.nn.DecoderLM` builds and ``get_config(name)`` returns).

    Raises:
        ValueError: an encoder-decoder preset, or one that describes attention only.
    """
    from .presets import require_whole_model

    require_whole_model(preset, "get_config")
    if preset.encoder_layers:
        raise ValueError(f"get_config: {preset.name!r} is an encoder-decoder; qkv.nn.DecoderLM is decoder-only (use "
                         "TransformerConfig with EncoderDecoder)")
    return preset.description
