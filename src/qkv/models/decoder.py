"""One decoder-only language model for the HF families qkv loads, configured by fields, not copied per model.

Llama (Touvron et al. 2023), Mistral (Jiang et al. 2023, arXiv:2310.06825), Qwen2 (Yang et al. 2024,
arXiv:2407.10671), Gemma 2 (arXiv:2408.00118), Gemma 3 (arXiv:2503.19786) and DeepSeek-V2
(arXiv:2405.04434) differ in a handful of switches, all of them fields of :class:`DecoderConfig`. Each
layer is two pre-norm residual branches::

    x = x + attn_out_norm(attn(attn_norm(x)))     # attn_out_norm, ffn_out_norm: Gemma 2/3 only
    x = x + ffn_out_norm(ffn(ffn_norm(x)))

- attention: grouped-query attention (Ainslie et al. 2023) with RoPE (Su et al. 2021) from
  :mod:`qkv.pos`, one fused QKV projection, optional QKV bias (Qwen2), per-head QK RMSNorm (Gemma 3), a
  score scale (Gemma's ``query_pre_attn_scalar``), tanh score soft-capping (Gemma 2, a :mod:`qkv.mods`
  modifier) and a sliding window on local layers (Mistral; Gemma's ``layer_types``), each layer type with
  its own RoPE base; or Multi-head Latent Attention (DeepSeek-V2) through
  :class:`qkv.nn.latent.LatentAttention`. Attention always runs through :func:`qkv.attention`, caches
  through the :mod:`qkv.cache` protocol.
- feed-forward: gated linear units (Shazeer 2020, "GLU Variants Improve Transformer") with one fused
  gate/up projection, SwiGLU or tanh-GeGLU; or DeepSeekMoE (Dai et al. 2024, arXiv:2401.06066): softmax
  top-k routed experts plus always-on shared experts, dense for the first ``first_k_dense_replace`` layers.
- RMSNorm (Gemma's variant scales by ``1 + w``), embeddings scaled by ``sqrt(d)`` (Gemma), final logits
  optionally soft-capped (Gemma 2), LM head tied to the embedding or not.

Family modules (``family_llama``, ``family_gemma``, ``family_deepseek``) turn an HF config into a
:class:`DecoderConfig` and HF tensor names into this model's names.

Decoding one token per row is bound by reading every weight once per step and, at small sizes, by
per-op overhead, so the decode path is kept short: fused QKV and gate/up projections; queries and keys
rotated in one call from a cos/sin table and handed to the cache already rotated (when the cache keeps
absolute positions); a positions mask over the single query row; single-row steps on the ``sdpa``
backend (``decode_backend``), skipping ``auto``'s per-call cost estimates; wide weights stored
input-major (``input_major_weights``) and few-row products spread over torch's threads
(:mod:`qkv.nn.skinny`); and ``logits_to_keep`` for the prefill. Batched decoding (several rows per step)
and prefill multiply faster through oneDNN-packed weights: ``qkv.nn.gemm.use_onednn(model)`` opts in, at
the cost of a second copy of every weight (1.1-1.8x the tokens/s of the default at batch 8 in
``benchmarks/generate.py``).

Shape legend: B batch, N new tokens, S cached slots, d hidden size, Hq query heads, Hkv key/value heads,
D head dim, R rotary dim, V vocabulary, T tokens (B * N), E routed experts, k experts per token, f expert
hidden size.

Example:
    >>> import torch
    >>> from qkv.models.decoder import DecoderConfig, DecoderLM
    >>> cfg = DecoderConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                     num_key_value_heads=2, intermediate_size=64)
    >>> lm = DecoderLM(cfg)
    >>> lm(torch.randint(0, 100, (2, 7))).shape
    torch.Size([2, 7, 100])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import masks, mods
from .._attention import attention
from ..cache.cache import KVCache
from ..cache.specs import FullSpec, LatentSpec, LayerSpec, SlidingWindowSpec
from ..nn.gemm import PackedWeight
from ..nn.gemm import linear as gemm_linear
from ..nn.latent import LatentAttention, LatentConfig
from ..nn.norm import rms_norm
from ..nn.skinny import InputMajorLinear, input_major
from ..pos.ids import batch_positions
from ..pos.rope import RotaryEmbedding, apply_rotary

__all__ = ["DecoderConfig", "RopeParams", "MoEConfig", "DecoderLM", "DecoderLayer",
           "FULL_ATTENTION", "SLIDING_ATTENTION", "ACTIVATIONS"]

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # HF ``layer_types`` values

#: HF ``hidden_act`` / ``hidden_activation`` names -> the function (exactly HF's, not an approximation).
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True, kw_only=True)
class RopeParams:
    """RoPE of one layer type: ``theta`` (HF ``rope_theta``), ``scaling`` (HF ``rope_parameters`` /
    ``rope_scaling`` dict with ``rope_type``), ``interleaved`` pairs ``(2f, 2f+1)`` (DeepSeek-V2) instead
    of ``(f, f + R/2)``."""

    theta: float = 10000.0
    scaling: Mapping[str, Any] | None = None
    interleaved: bool = False

    def embedding(self, rotary_dim: int, max_position_embeddings: int) -> RotaryEmbedding:
        return RotaryEmbedding(rotary_dim, theta=self.theta, scaling=dict(self.scaling) if self.scaling else None,
                               max_position_embeddings=max_position_embeddings, interleaved=self.interleaved)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """DeepSeekMoE feed-forward (HF DeepSeek-V2 field names).

    Layer ``i`` is a mixture of experts when ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``
    (DeepSeek's rule; HF transformers ignores ``moe_layer_freq``, which is 1 in every released checkpoint).
    Routing: softmax over ``n_routed_experts`` router logits (float32), top ``num_experts_per_tok`` by
    ``topk_method`` (``"greedy"``, or ``"group_limited_greedy"`` over ``n_group`` groups keeping
    ``topk_group``), weights renormalized when ``norm_topk_prob`` and multiplied by ``routed_scaling_factor``.
    """

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"MoEConfig: topk_method must be 'greedy' or 'group_limited_greedy', got "
                             f"{self.topk_method!r}")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"MoEConfig: num_experts_per_tok ({self.num_experts_per_tok}) must lie in "
                             f"[1, n_routed_experts={self.n_routed_experts}]")
        if self.topk_method == "group_limited_greedy" and (
                not self.n_group or not self.topk_group or self.n_routed_experts % self.n_group):
            raise ValueError(f"MoEConfig: group_limited_greedy needs n_group dividing n_routed_experts "
                             f"({self.n_routed_experts}) and topk_group; got n_group={self.n_group}, "
                             f"topk_group={self.topk_group}")

    def is_moe(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Everything that distinguishes the supported decoder families (HF field names where HF has one).

    Args:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size: as in HF.
        num_key_value_heads: KV heads (default ``num_attention_heads``; 1 is MQA).
        head_dim: per-head width (default ``hidden_size // num_attention_heads``).
        hidden_act: gate activation of the feed-forward, a key of ``ACTIVATIONS``.
        rms_norm_eps: epsilon of every RMSNorm.
        norm_offset: RMSNorm scales by ``norm_offset + weight`` (Gemma: 1.0, weights stored around 0).
        scale_embeddings: multiply token embeddings by ``sqrt(hidden_size)`` (Gemma).
        sandwich_norms: also normalize each branch's output (Gemma 2/3 post-attention and
            post-feed-forward norms).
        qkv_bias, o_bias, mlp_bias: biases of the QKV, output and feed-forward projections.
        qk_norm: per-head RMSNorm of queries and keys before RoPE (Gemma 3).
        attention_scale: score scale (default ``head_dim ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``).
        attn_logit_softcapping: ``cap * tanh(score / cap)`` on attention scores (Gemma 2).
        final_logit_softcapping: the same on the output logits (Gemma 2).
        tie_word_embeddings: the LM head is the embedding matrix.
        sliding_window: keys per query on ``sliding_attention`` layers, the query included (HF convention).
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"`` (default: all full).
        rope: RoPE per layer type (a missing type uses ``"full_attention"``'s).
        max_position_embeddings: context length (RoPE ``dynamic``/YaRN defaults).
        latent: Multi-head Latent Attention on every layer (DeepSeek-V2) instead of GQA: a
            :class:`qkv.nn.latent.LatentConfig` (its RoPE comes from ``rope``, its scale from itself).
        moe: DeepSeekMoE feed-forward on the layers it selects.
        backend: the :func:`qkv.attention` backend of every layer.
        decode_backend: the backend of single-query steps (one new token per row) when ``backend`` is
            ``"auto"`` and the layer's request allows it (no soft-capping). ``"sdpa"`` by default: measured
            fastest for one query row on CPU, and it skips ``auto``'s per-call cost estimates, which cost
            more than the attention itself at decode sizes. MLA layers use it for every step (one backend
            per :class:`qkv.nn.latent.LatentAttention`). None: always ``backend``.
        input_major_weights: store every projection with at least as many outputs as inputs (QKV, gate/up,
            square ones, such expert matrices, the LM head, a tied embedding) input-major: same shape, names
            and values, transposed strides (:class:`qkv.nn.skinny.InputMajorLinear`). Decoding multiplies
            one row per sequence by each weight, and MKL streams an input-major matrix through that product
            1.1-2x faster on CPU (the LM head most; ``benchmarks/generate.py``), and, with several threads,
            few rows are spread over them (:func:`qkv.nn.skinny.skinny_linear`). Such weights are
            non-contiguous: call ``.contiguous()`` on them before ``safetensors.torch.save_file``.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    norm_offset: float = 0.0
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    attention_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope: Mapping[str, RopeParams] = field(default_factory=lambda: {FULL_ATTENTION: RopeParams()})
    max_position_embeddings: int = 2048
    latent: LatentConfig | None = None
    moe: MoEConfig | None = None
    backend: str = "auto"
    decode_backend: str | None = "sdpa"
    input_major_weights: bool = True

    def __deepcopy__(self, memo) -> DecoderConfig:  # immutable (its mappings are read-only views): share it
        return self

    def __post_init__(self) -> None:
        def set_(key, value):
            object.__setattr__(self, key, value)

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"DecoderConfig: {name} must be a positive int, got {v!r}")
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DecoderConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"DecoderConfig: hidden_act {self.hidden_act!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        if self.layer_types is None:
            set_("layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
        set_("layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"DecoderConfig: layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if bad:
            raise ValueError(f"DecoderConfig: layer_types must be {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}, got "
                             f"{sorted(bad)}")
        if SLIDING_ATTENTION in self.layer_types and not (isinstance(self.sliding_window, int)
                                                         and self.sliding_window > 0):
            raise ValueError(f"DecoderConfig: sliding_attention layers need sliding_window (keys per query, a "
                             f"positive int), got {self.sliding_window!r}")
        if self.latent is not None and SLIDING_ATTENTION in self.layer_types:
            raise ValueError("DecoderConfig: latent attention (MLA) layers have no sliding window")
        if FULL_ATTENTION not in self.rope:
            raise ValueError(f"DecoderConfig: rope needs a {FULL_ATTENTION!r} entry, got {sorted(self.rope)}")
        set_("rope", MappingProxyType(dict(self.rope)))
        for kind, softcap in (("attn_logit_softcapping", self.attn_logit_softcapping),
                              ("final_logit_softcapping", self.final_logit_softcapping)):
            if softcap is not None and not softcap > 0:
                raise ValueError(f"DecoderConfig: {kind} must be > 0 or None, got {softcap!r}")

    def window_for(self, layer_idx: int) -> int | None:
        """Keys per query of layer ``layer_idx`` (None: full causal attention)."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    def rope_for(self, layer_type: str) -> RopeParams:
        return self.rope.get(layer_type, self.rope[FULL_ATTENTION])

    def replace(self, **changes) -> DecoderConfig:
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------------------- pieces
class _RMSNorm(nn.Module):
    """RMSNorm scaling by ``offset + weight``: ``offset = 0`` is :func:`qkv.nn.rms_norm` (Llama), ``offset = 1``
    Gemma's variant, whose stored weights start at 0. Low-precision inputs normalize in float32; float32 and
    float64 ones go through torch's fused ``F.rms_norm`` (the same arithmetic in one op instead of eight,
    which matters when decoding one token)."""

    def __init__(self, dim: int, *, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = x.dtype in (torch.float32, torch.float64)
        if self.offset == 0:
            if full and self.weight.dtype == x.dtype:
                return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return rms_norm(x, self.weight, eps=self.eps)
        work = x.dtype if full else torch.float32
        return (rms_norm(x.to(work), eps=self.eps) * (self.offset + self.weight.to(work))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (f", offset={self.offset:g}" if self.offset else "")


class _GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one projection ``gate_up_proj`` (d -> 2f,
    gate rows first): one matmul instead of two, which matters when decoding one token at a time."""

    def __init__(self, d: int, f: int, act: str, *, bias: bool) -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (..., f) each
        return self.down_proj(self.act(gate) * up)


class _Experts(nn.Module):
    """``E`` gated experts stored stacked, as HF transformers 5 keeps them: ``gate_up_proj`` (E, 2f, d),
    ``down_proj`` (E, d, f)."""

    def __init__(self, n: int, d: int, f: int, act: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * f, d).normal_(std=0.02))
        self.down_proj = nn.Parameter(torch.empty(n, d, f).normal_(std=0.02))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, d); idx (T, k) chosen experts; weights (T, k) float32 -> (T, d), the weighted sum."""
        T, k = idx.shape
        if T == 1:  # one token (a one-sequence decode step): its k experts in ascending id, as below
            out = torch.zeros_like(x)
            for e, j in sorted((e, j) for j, e in enumerate(idx[0].tolist())):
                gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                out += (F.linear(self.act(gate) * up, self.down_proj[e]) * weights[:, j:j + 1]).to(out.dtype)
            return out
        flat = idx.reshape(-1)  # (T * k,)
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token = order // k
        w = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            t = token[start:start + n]
            gate, up = F.linear(x[t], self.gate_up_proj[e]).chunk(2, dim=-1)  # (n, f) each
            y = F.linear(self.act(gate) * up, self.down_proj[e]) * w[start:start + n, None]  # float32 weights
            out.index_add_(0, t, y.to(out.dtype))
            start += n
        return out


class _MoE(nn.Module):
    """DeepSeekMoE: ``shared_experts(x) + sum_k w_k expert_k(x)`` over the top-k routed experts."""

    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        m = self.config = c.moe
        self.router = nn.Linear(c.hidden_size, m.n_routed_experts, bias=False)
        self.experts = _Experts(m.n_routed_experts, c.hidden_size, m.moe_intermediate_size, c.hidden_act)
        self.shared_experts = (_GatedMLP(c.hidden_size, m.moe_intermediate_size * m.n_shared_experts, c.hidden_act,
                                         bias=c.mlp_bias) if m.n_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, d) -> (weights (T, k) float32, expert ids (T, k)); the router runs in float32, as HF's."""
        m = self.config
        scores = F.linear(x.float(), self.router.weight.float()).softmax(dim=-1)  # (T, E)
        if m.topk_method == "group_limited_greedy":
            T, E = scores.shape
            best = scores.view(T, m.n_group, E // m.n_group).amax(dim=-1)  # (T, groups)
            keep = torch.zeros_like(best).scatter_(1, best.topk(m.topk_group, dim=-1, sorted=False).indices, 1.0)
            scores = scores.masked_fill(~keep.bool().repeat_interleave(E // m.n_group, dim=1), 0.0)
        weights, idx = scores.topk(m.num_experts_per_tok, dim=-1, sorted=False)
        if m.norm_topk_prob and m.num_experts_per_tok > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, d)
        weights, idx = self.route(flat)
        out = self.experts(flat, idx, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)


class _RopeTable:
    """cos/sin of a :class:`qkv.pos.RotaryEmbedding` kept as a table over positions ``0 .. L-1`` (grown by
    doubling, angles in float64), so a decode step costs one gather per layer instead of recomputing
    frequencies. ``dynamic`` scaling depends on the sequence length and is computed per call instead.

    Calling it, ``table(x, positions)``, rotates ``x`` (B, H, N, R); that is the ``rope`` callable given to
    caches that re-position keys (StreamingLLM sinks) and to MLA. Positions must be below the reserved
    length (:meth:`DecoderLM.forward` reserves the step's largest position once).
    """

    def __init__(self, emb: RotaryEmbedding) -> None:
        self.emb = emb
        self.dynamic = emb.rope_type == "dynamic"
        self.length = 0
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def reserve(self, n: int) -> None:
        """Make positions ``< n`` available."""
        if n > self.length and not self.dynamic:
            self.length = max(64, 1 << (n - 1).bit_length())
            self._tables.clear()

    def _table(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._tables:
            pos = torch.arange(self.length, device=device)
            cos, sin = self.emb.cos_sin(pos, dtype=torch.float64)  # (L, R)
            self._tables[key] = (cos.to(dtype), sin.to(dtype))
        return self._tables[key]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, N) or (N,) (negative: padding, treated as 0) -> cos, sin (..., R) in ``dtype``."""
        if self.dynamic:
            return self.emb.cos_sin(positions, dtype=dtype)
        cos, sin = self._table(positions.device, dtype)
        p = positions.clamp_min(0)
        return cos[p], sin[p]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions, x.dtype if x.dtype == torch.float64 else torch.float32)
        return apply_rotary(x, cos, sin, interleaved=self.emb.interleaved)


class _Step:
    """What every layer of one forward pass shares: positions, cache, masks and RoPE tables of the step."""

    __slots__ = ("positions", "cache", "n", "dtype", "_cos_sin", "_masks", "_specs")

    def __init__(self, positions: torch.Tensor | None, cache, n: int, dtype: torch.dtype) -> None:
        self.positions, self.cache, self.n, self.dtype = positions, cache, n, dtype
        self._cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[int | None, masks.Mask] = {}
        self._specs = getattr(cache, "specs", None)

    def keys_at_absolute_positions(self, layer_idx: int) -> bool:
        """True when the cache keeps this layer's keys at their absolute positions (full and sliding-window
        layers), so keys may be rotated before ``cache.update`` together with the queries; False for caches
        that re-position keys (StreamingLLM sinks) or that do not say, which get un-rotated keys and ``rope``."""
        return self._specs is not None and isinstance(self._specs[layer_idx], (FullSpec, SlidingWindowSpec))

    def cos_sin(self, table: _RopeTable, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(table)
        if key not in self._cos_sin:
            pos = self.positions if self.positions is not None else torch.arange(self.n, device=device)
            work = torch.float64 if self.dtype == torch.float64 else torch.float32
            self._cos_sin[key] = table.cos_sin(pos, work)
        return self._cos_sin[key]

    def self_mask(self, window: int | None) -> masks.Mask:
        """Causal (and windowed) mask of a step without a cache."""
        if window not in self._masks:
            if self.positions is not None:
                self._masks[window] = masks.positions(self.positions, self.positions, causal=True, window=window)
            else:
                self._masks[window] = masks.sliding_window(window - 1) if window else masks.causal()
        return self._masks[window]


class _SelfAttention(nn.Module):
    """Grouped-query self attention with RoPE, one fused QKV projection and the cache protocol.

    ``qkv_proj`` (d -> (Hq + 2 Hkv) D) stacks HF's ``q_proj``, ``k_proj``, ``v_proj`` rows in that order, so
    queries and keys are adjacent heads of one tensor and rotate in one call.
    """

    def __init__(self, c: DecoderConfig, layer_idx: int, rope: _RopeTable) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.layer_idx, self.window, self.rope = layer_idx, c.window_for(layer_idx), rope
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, (Hq + 2 * Hkv) * D, bias=c.qkv_bias)
        self.o_proj = nn.Linear(Hq * D, c.hidden_size, bias=c.o_bias)
        self.q_norm = _RMSNorm(D, eps=c.rms_norm_eps, offset=c.norm_offset) if c.qk_norm else None
        self.k_norm = _RMSNorm(D, eps=c.rms_norm_eps, offset=c.norm_offset) if c.qk_norm else None
        self.scale = c.attention_scale
        self.score_mod = mods.softcap(c.attn_logit_softcapping) if c.attn_logit_softcapping else None
        self.backend = c.backend
        self.decode_backend = (c.decode_backend if c.backend == "auto" and c.decode_backend and self.score_mod is None
                               else c.backend)

    def _rotate_qk(self, q: torch.Tensor, k: torch.Tensor, qk: torch.Tensor | None, cos, sin):
        """Rotate queries and keys; in one call when they are still adjacent heads of ``qk``."""
        interleaved = self.rope.emb.interleaved
        if qk is not None:
            return apply_rotary(qk, cos, sin, interleaved=interleaved).split((self.n_heads, self.n_kv_heads), dim=1)
        return (apply_rotary(q, cos, sin, interleaved=interleaved),
                apply_rotary(k, cos, sin, interleaved=interleaved))

    def forward(self, x: torch.Tensor, step: _Step) -> torch.Tensor:
        B, N, _ = x.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(B, N, Hq + 2 * Hkv, D).transpose(1, 2)  # (B, Hq + 2 Hkv, N, D)
        qk, v = qkv.split((Hq + Hkv, Hkv), dim=1)  # (B, Hq + Hkv, N, D), (B, Hkv, N, D)
        q, k = qk.split((Hq, Hkv), dim=1)
        if self.q_norm is not None:
            q, k, qk = self.q_norm(q), self.k_norm(k), None
        cos, sin = step.cos_sin(self.rope, x.device)  # (B, N, R) or (N, R)
        cache = step.cache
        if cache is None:
            q, k = self._rotate_qk(q, k, qk, cos, sin)
            mask = step.self_mask(self.window)
        else:
            if step.keys_at_absolute_positions(self.layer_idx):
                q, k = self._rotate_qk(q, k, qk, cos, sin)
                view = cache.update(self.layer_idx, k, v, positions=step.positions, rope=None)
            else:  # the cache rotates keys where it keeps them and says where queries sit
                view = cache.update(self.layer_idx, k, v, positions=step.positions, rope=self.rope)
                q = self.rope(q, view.q_positions)
            k, v = view.k, view.v  # (B, Hkv, S, D)
            mask = masks.positions(view.q_positions, view.kv_positions, causal=True, window=self.window)
        backend = self.decode_backend if N == 1 else self.backend
        out = None
        if N == 1 and self.backend == "auto" and self.score_mod is None and isinstance(cache, KVCache):
            out = cache.decode(self.layer_idx, q, scale=self.scale or D ** -0.5, window=self.window)  # paged on GPU
        if out is None:
            out = attention(q, k, v, mask=mask, score_mod=self.score_mod, scale=self.scale, backend=backend)
        if cache is not None and hasattr(cache, "observe"):
            cache.observe(self.layer_idx, q, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, N, Hq * D))  # (B, N, d)

    def extra_repr(self) -> str:
        extra = f", window={self.window}" if self.window else ""
        extra += f", score_mod={self.score_mod!r}" if self.score_mod is not None else ""
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}{extra}"


class DecoderLayer(nn.Module):
    """One layer: attention and feed-forward branches, each pre-normed (and post-normed with sandwich norms)."""

    def __init__(self, c: DecoderConfig, layer_idx: int, rope: _RopeTable) -> None:
        super().__init__()

        def norm():
            return _RMSNorm(c.hidden_size, eps=c.rms_norm_eps, offset=c.norm_offset)

        self.attn_norm = norm()
        self.latent = c.latent is not None
        if self.latent:
            backend = (c.decode_backend if c.backend == "auto" and c.decode_backend
                       and not c.latent.attention_dropout else c.backend)
            self.self_attn = LatentAttention(c.latent, rope=rope, backend=backend, layer_idx=layer_idx)
        else:
            self.self_attn = _SelfAttention(c, layer_idx, rope)
        self.attn_out_norm = norm() if c.sandwich_norms else None
        self.ffn_norm = norm()
        self.mlp = (_MoE(c) if c.moe is not None and c.moe.is_moe(layer_idx)
                    else _GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias))
        self.ffn_out_norm = norm() if c.sandwich_norms else None

    def forward(self, x: torch.Tensor, step: _Step) -> torch.Tensor:
        if self.latent:
            h = self.self_attn(self.attn_norm(x), positions=step.positions, cache=step.cache).out
        else:
            h = self.self_attn(self.attn_norm(x), step)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        x = x + h
        h = self.mlp(self.ffn_norm(x))
        if self.ffn_out_norm is not None:
            h = self.ffn_out_norm(h)
        return x + h


def _store_wide_weights_input_major(model: nn.Module) -> None:
    """Make every ``nn.Linear`` with at least as many outputs as inputs an
    :class:`qkv.nn.skinny.InputMajorLinear` (same names and values, input-major storage), store such
    stacked expert matrices input-major too, and the embedding when it is the (tied) LM head."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.out_features >= child.in_features:
                setattr(parent, name, InputMajorLinear.from_linear(child))
        if isinstance(parent, _Experts):
            for name, p in list(parent.named_parameters(recurse=False)):
                if p.shape[1] >= p.shape[2]:  # (E, out, in): each expert's (out, in) matrix input-major
                    setattr(parent, name, nn.Parameter(p.detach().transpose(1, 2).contiguous().transpose(1, 2),
                                                       requires_grad=p.requires_grad))
    if getattr(model, "lm_head", None) is None:
        emb = model.embed_tokens.weight
        model.embed_tokens.weight = nn.Parameter(input_major(emb), requires_grad=emb.requires_grad)


class DecoderLM(nn.Module):
    """The decoder-only language model of :class:`DecoderConfig`; a :class:`qkv.cache.DecoderModel`.

    ``forward(input_ids, *, positions=None, cache=None, logits_to_keep=0)``:
        input_ids (B, N) int64. positions (B, N) or (N,) int64 absolute positions, ``-1`` for padding tokens
        (never attended); default ``0 .. N-1``, or continuing from ``cache.seq_length`` with a cache.
        cache: a :mod:`qkv.cache` cache (e.g. ``KVCache(model.cache_specs())``). logits_to_keep: when > 0,
        only the last that many columns get logits (prefill for generation needs one).
        Returns logits (B, N or logits_to_keep, V) in the model's dtype.

    ``cache_specs()``: one :mod:`qkv.cache` layer spec per layer: ``FullSpec``, ``SlidingWindowSpec`` for
    local layers, ``LatentSpec`` for MLA.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        c = self.config = config
        self.ropes: dict[str, _RopeTable] = {}
        rotary_dim = c.latent.qk_rope_head_dim if c.latent is not None else c.head_dim
        for kind in dict.fromkeys(c.layer_types):
            self.ropes[kind] = _RopeTable(c.rope_for(kind).embedding(rotary_dim, c.max_position_embeddings))
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i, self.ropes[t]) for i, t in enumerate(c.layer_types))
        self.norm = _RMSNorm(c.hidden_size, eps=c.rms_norm_eps, offset=c.norm_offset)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.input_major_weights:
            _store_wide_weights_input_major(self)
        self._head_packed: PackedWeight | None = None  # set_gemm("onednn")

    def forward(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None, cache=None,
                logits_to_keep: int = 0) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"DecoderLM: input_ids must be (B, N) int64, got {getattr(input_ids, 'shape', input_ids)}")
        B, N = input_ids.shape
        device = input_ids.device
        if positions is not None:
            positions = batch_positions(positions, B, N, owner="DecoderLM", device=device)
        elif cache is not None:
            offset = int(getattr(cache, "seq_length", 0))
            positions = torch.arange(offset, offset + N, device=device).expand(B, N)
        longest = int(positions.max()) + 1 if positions is not None and positions.numel() else N
        for table in self.ropes.values():
            table.reserve(longest)
        x = self.embed_tokens(input_ids)  # (B, N, d)
        if self.config.scale_embeddings:  # Gemma: sqrt(d) rounded to the weights' dtype, as HF does
            x = x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype)
        step = _Step(positions, cache, N, x.dtype)
        for layer in self.layers:
            x = layer(x, step)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        x = self.norm(x)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = gemm_linear(x, head.weight, None, self._head_packed)  # (B, N, V)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def set_gemm(self, engine: str) -> None:
        """``"onednn"``: the LM head multiplies several rows through a packed oneDNN copy (called by
        :func:`qkv.nn.gemm.use_onednn`, which also swaps the linear layers); ``"blas"``: ``skinny_linear``."""
        if engine not in ("onednn", "blas"):
            raise ValueError(f"DecoderLM.set_gemm: engine must be 'onednn' or 'blas', got {engine!r}")
        self._head_packed = PackedWeight() if engine == "onednn" else None

    def cache_specs(self) -> list[LayerSpec]:
        c = self.config
        if c.latent is not None:
            return [LatentSpec(c.latent.kv_lora_rank, c.latent.qk_rope_head_dim) for _ in c.layer_types]
        return [SlidingWindowSpec(w, c.num_key_value_heads, c.head_dim) if (w := c.window_for(i)) else
                FullSpec(c.num_key_value_heads, c.head_dim) for i in range(c.num_hidden_layers)]


# ------------------------------------------------------------------- HF configs and names (family modules)
def _hf_error(msg: str) -> Exception:
    from .loading import CheckpointError

    return CheckpointError(msg)


def _hf_rope_params(cfg: Mapping[str, Any], layer_type: str | None = None, *, theta_key: str = "rope_theta",
                    interleaved: bool = False) -> RopeParams:
    """RoPE of ``layer_type`` from an HF config dict, old style (``rope_theta`` + ``rope_scaling``) or
    transformers 5 style (``rope_parameters``, per layer type for Gemma 3)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if isinstance(params, Mapping) and set(params) & {FULL_ATTENTION, SLIDING_ATTENTION}:
        params = params.get(FULL_ATTENTION)
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        if theta_key in cfg:
            params.setdefault("rope_theta", cfg[theta_key])
    params = dict(params or {})
    if float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise _hf_error("from_hf: partial_rotary_factor != 1 is not supported for this family")
    theta = float(params.pop("rope_theta", cfg.get(theta_key) or 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return RopeParams(theta=theta, scaling=None if kind == "default" else params, interleaved=interleaved)


def _hf_decoder_config(cfg: Mapping[str, Any], **family: Any) -> DecoderConfig:
    """A :class:`DecoderConfig` from the fields every HF decoder config shares, plus a family's switches."""
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if cfg.get(k) is None]
    if missing:
        raise _hf_error(f"from_hf: the {cfg.get('model_type')} config lacks {missing}")
    common = dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"], intermediate_size=cfg["intermediate_size"],
        num_key_value_heads=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048))
    common.update(family)
    try:
        return DecoderConfig(**common)
    except (TypeError, ValueError) as e:
        raise _hf_error(f"from_hf: cannot build a {cfg.get('model_type')} model from its config: {e}") from e


_ATTN_STACK = ("q_proj", "k_proj", "v_proj")
_MLP_STACK = ("gate_proj", "up_proj")


def _stack(state: dict[str, torch.Tensor], prefix: str, parts: tuple[str, ...], suffix: str,
           dim: int = 0) -> torch.Tensor | None:
    """Pop ``prefix + part + suffix`` for every part and concatenate them; None when none is there;
    ``CheckpointError`` naming the absent ones when only some are."""
    names = [f"{prefix}{p}{suffix}" for p in parts]
    have = [n for n in names if n in state]
    if not have:
        return None
    if len(have) != len(names):
        absent = [n for n in names if n not in state]
        raise _hf_error(f"from_hf: the checkpoint has {have} but lacks {absent}")
    return torch.cat([state.pop(n) for n in names], dim=dim)


def _hf_rename(state: Mapping[str, torch.Tensor], config: DecoderConfig, *,
               norms: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """HF decoder tensor names to :class:`DecoderLM` names.

    Args:
        state: the HF state dict (``model.`` prefix optional; ``lm_head.weight`` dropped when tied).
        config: the model's config (tied head, MLA, MoE).
        norms: HF layer-norm names to ours (``attn_norm``, ``attn_out_norm``, ``ffn_norm``, ``ffn_out_norm``).

    GQA layers stack ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``; MLA layers keep HF's names
    (:class:`qkv.nn.latent.LatentAttention` uses them); gated MLPs stack ``gate_proj``/``up_proj``.
    """
    src: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("rotary_emb.inv_freq") or name.endswith("original_inv_freq"):
            continue  # buffers qkv recomputes
        src[name.removeprefix("model.")] = t
    if config.tie_word_embeddings:
        src.pop("lm_head.weight", None)
    out: dict[str, torch.Tensor] = {}
    for key in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
        if key in src:
            out[key] = src.pop(key)
    for i in range(config.num_hidden_layers):
        hf, ours = f"layers.{i}.", f"layers.{i}."
        for a, b in norms.items():
            if f"{hf}{a}.weight" in src:
                out[f"{ours}{b}.weight"] = src.pop(f"{hf}{a}.weight")
        att = f"{hf}self_attn."
        if config.latent is None:
            for suffix in (".weight", ".bias"):
                t = _stack(src, att, _ATTN_STACK, suffix)
                if t is not None:
                    out[f"{ours}self_attn.qkv_proj{suffix}"] = t
        for rest in [n for n in src if n.startswith(att)]:
            out[f"{ours}self_attn.{rest[len(att):]}"] = src.pop(rest)
        mlp = f"{hf}mlp."
        if config.moe is not None and config.moe.is_moe(i):
            _rename_moe(src, out, mlp, f"{ours}mlp.", config.moe.n_routed_experts)
        else:
            t = _stack(src, mlp, _MLP_STACK, ".weight")
            if t is not None:
                out[f"{ours}mlp.gate_up_proj.weight"] = t
            t = _stack(src, mlp, _MLP_STACK, ".bias")
            if t is not None:
                out[f"{ours}mlp.gate_up_proj.bias"] = t
        for rest in [n for n in src if n.startswith(mlp)]:
            out[f"{ours}mlp.{rest[len(mlp):]}"] = src.pop(rest)
    out.update(src)  # anything left is reported as unexpected by the loader
    return out


def _rename_moe(src: dict[str, torch.Tensor], out: dict[str, torch.Tensor], hf: str, ours: str, n: int) -> None:
    """DeepSeek MoE: router ``gate.weight``; experts either stacked (transformers 5 in memory:
    ``experts.gate_up_proj`` (E, 2f, d), ``experts.down_proj`` (E, d, f)) or one module per expert (files on
    disk: ``experts.{e}.gate_proj.weight``, ...); shared experts' gate/up stacked like a dense MLP."""
    if f"{hf}gate.weight" in src:
        out[f"{ours}router.weight"] = src.pop(f"{hf}gate.weight")
    for name in ("gate_up_proj", "down_proj"):
        if f"{hf}experts.{name}" in src:
            out[f"{ours}experts.{name}"] = src.pop(f"{hf}experts.{name}")
    if f"{hf}experts.0.gate_proj.weight" in src or f"{hf}experts.0.down_proj.weight" in src:
        gate_up, down = [], []
        for e in range(n):
            gu = _stack(src, f"{hf}experts.{e}.", _MLP_STACK, ".weight")
            d = src.pop(f"{hf}experts.{e}.down_proj.weight", None)
            if gu is None or d is None:
                raise _hf_error(f"from_hf: the checkpoint lacks expert {e} of {n} ({hf}experts.{e}.*)")
            gate_up.append(gu)
            down.append(d)
        out[f"{ours}experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"{ours}experts.down_proj"] = torch.stack(down)
    t = _stack(src, f"{hf}shared_experts.", _MLP_STACK, ".weight")
    if t is not None:
        out[f"{ours}shared_experts.gate_up_proj.weight"] = t
    for rest in [k for k in src if k.startswith(f"{hf}shared_experts.")]:
        out[f"{ours}{rest[len(hf):]}"] = src.pop(rest)
