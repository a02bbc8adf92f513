"""The decoder-only language model of qkv: one class for the tiny presets, the examples and every HF decoder
family qkv loads, configured by fields (:class:`qkv.nn.DecoderConfig`), not copied per model.

Llama (Touvron et al. 2023), Mistral (Jiang et al. 2023, arXiv:2310.06825), Qwen2 (Yang et al. 2024,
arXiv:2407.10671), Gemma 2 (arXiv:2408.00118), Gemma 3 (arXiv:2503.19786), DeepSeek-V2 (arXiv:2405.04434),
GPT-2 (Radford et al. 2019), BLOOM (BigScience 2022) and the hybrid Qwen3-Next / Qwen3.5 differ in a handful of
switches. Each layer is two pre-norm residual branches::

    x = x + attn_out_norm(attn(attn_norm(x)))     # attn_out_norm, ffn_out_norm: Gemma 2/3 only
    x = x + ffn_out_norm(ffn(ffn_norm(x)))

where ``x + ...`` is the plain residual; how a branch reads its input from the residual stream and writes its
output back is a :class:`qkv.nn.residual.Residual` (:func:`qkv.nn.residual.residual_for` picks it per layer and
branch), so wider residual streams (hyper-connections) run through the same layers.

- attention (:class:`qkv.nn.SelfAttention`): grouped-query attention (Ainslie et al. 2023) with one fused QKV
  projection, RoPE (Su et al. 2021) per layer type, learned absolute positions (GPT-2) or ALiBi (Press et al.
  2022, BLOOM), optional QKV bias, per-head QK RMSNorm (Gemma 3), a score scale, tanh score soft-capping
  (Gemma 2) and a sliding window on local layers; or Multi-head Latent Attention (DeepSeek-V2) through
  :class:`qkv.nn.LatentAttention`. Attention runs through the module's ``attention_fn`` (default
  :func:`qkv.attention`), caches through the :mod:`qkv.cache` protocol. Optionally its output is gated,
  ``o * sigmoid(gate(x))`` before the output projection (Qwen3-Next's gated attention).
- or, on ``"linear_attention"`` layers of a hybrid model, a recurrent mixer, ``layers[i].linear_attn``
  (:class:`qkv.nn.GatedDeltaNet`, Yang et al. 2025, arXiv:2412.06464; Kimi Linear's
  :class:`qkv.nn.KimiDeltaAttention`, arXiv:2510.26692) whose state the cache keeps under a
  ``RecurrentSpec``: one :class:`qkv.cache.KVCache` holds both kinds of layer. Padding tokens (position
  ``-1``) are zeroed before the mixer, so a left-padded row leaves the state its real tokens alone leave.
- feed-forward: :class:`qkv.nn.GatedMLP` (SwiGLU, tanh-GeGLU), :class:`qkv.nn.FeedForward` (GPT-2, BLOOM)
  or :class:`qkv.nn.MoE` (DeepSeekMoE) on the layers the config selects, or experts beside the dense MLP
  (:class:`qkv.nn.parallel_moe.ParallelMoE`, Gemma 4 26B-A4B).
- :class:`qkv.nn.RMSNorm` (Gemma's ``1 + w`` variant included) or LayerNorm; embeddings optionally scaled by
  ``sqrt(d)`` (Gemma); final logits optionally soft-capped (Gemma 2); LM head tied to the embedding or not.

Each layer's mixer is the kind :func:`qkv.config.mixers.mixer_of` names (attention, MLA, DSA, Gated DeltaNet, KDA),
built by :func:`qkv.nn.mixers.build_mixer` and called one way, ``mixer.mix(x, step, keep)``
(:class:`qkv.nn.mixer.DecoderMixer`); nothing here chooses by kind.

Reading HF checkpoints into it is :mod:`qkv.models`' business (``qkv.models.hf`` and one family file each).

Decoding one token per row is bound by reading every weight once per step and, at small sizes, by per-op
overhead, so the decode path is kept short: fused QKV and gate/up projections; queries and keys rotated in
one call from a cos/sin table and handed to the cache already rotated (when the cache keeps the layer's
keys at absolute positions); a positions mask over the single query row; single-row steps on the ``sdpa``
backend (``decode_backend``), skipping ``auto``'s per-call cost estimates; and ``logits_to_keep`` for the
prefill, where the last layer stores every column's keys and values but attends and runs its feed-forward for
the kept columns only (what llama.cpp also skips; about 1/L of a prompt's layer work on L layers). The model
is built plain (``nn.Linear`` layers; the tied LM head and the experts multiply through ``linear_fn``,
``F.linear``); :func:`qkv.cpu.optimize` swaps in the CPU products (few rows cut into blocks of the weight over
torch's threads, many rows through oneDNN-prepacked weights, as its measured rule says), and
``qkv.models.from_hf`` and ``qkv.models.generate`` call it by default. ``state_dict()`` holds standard
contiguous tensors either way.

Shape legend: B batch, N new tokens, S cached slots, d hidden size, Hq query heads, Hkv key/value heads,
D head dim, R rotary dim, V vocabulary.

Example:
    >>> import torch
    >>> from qkv.nn import DecoderConfig, DecoderLM
    >>> cfg = DecoderConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                     num_key_value_heads=2, intermediate_size=64)
    >>> lm = DecoderLM(cfg)
    >>> lm(torch.randint(0, 100, (2, 7))).logits.shape
    torch.Size([2, 7, 100])
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .. import masks
from ..cache.describe import cache_specs_of
from ..cache.protocol import AttentionCache
from ..cache.specs import LayerSpec
from ..config.decoder import DecoderConfig
from ..config.layer_types import LINEAR_ATTENTION
from ..config.mixers import mixer_of
from ..pos.ids import batch_positions, positions_from_padding
from ..pos.learned import LearnedPositionalEmbedding
from ..pos.rope import RotaryEmbedding, apply_rotary
from .cached import attention_mask, refuse_scoring_cache
from .ffn import FeedForward, GatedMLP
from .mixer import DecoderMixer
from .mixers import build_mixer
from .moe import ClampedSwiGLUMLP, MoE
from .norm import RMSNorm
from .parallel_moe import ParallelMoE
from .per_layer_embed import PerLayerBranch, PerLayerInputs
from .ple import PerLayerEmbedding
from .residual import Residual, residual_for
from .self_attention import SelfAttention


class TokenScreen(Protocol):
    """Greedy tokens of an LM head without its whole float32 product, set into :class:`DecoderLM`'s ``head_screen``
    from outside (``qkv.cpu.optimize`` sets a ``qkv.cpu.greedy.HeadScreen`` where its int8 screen runs)."""

    def tokens(self, x: torch.Tensor, weight: torch.Tensor, cap: float | None = None) -> torch.Tensor:
        """``(x @ weight.T).argmax(-1)`` for x (..., K) and weight (V, K); with ``cap``, the argmax of the
        soft-capped logits ``cap * tanh(x @ weight.T / cap)`` as computed in x's dtype (ties to the first)."""

    def screens(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether :meth:`tokens` is the faster way for these rows (else the model computes its logits)."""

__all__ = ["DecoderLM", "DecoderLayer", "DecoderOutput", "SelfAttention", "positions_from_attention_mask"]


class DecoderOutput(NamedTuple):
    """What :meth:`DecoderLM.forward` returns: ``logits`` (B, N or logits_to_keep, V) in the model's dtype,
    and the ``cache`` it was given (updated in place), or None."""

    logits: torch.Tensor
    cache: AttentionCache | None


def positions_from_attention_mask(attention_mask: torch.Tensor, n_new: int) -> torch.Tensor:
    """Absolute positions (B, n_new) of the last ``n_new`` columns of a 0/1 padding mask (B, M), M >= n_new.

    A real token's position counts the real tokens before it in its row; a padding token gets ``-1`` (never
    attended). Padding may sit anywhere: on the left (generation), on the right (training batches).

    Example:
        >>> import torch
        >>> positions_from_attention_mask(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]]), 4).tolist()
        [[-1, -1, 0, 1], [0, 1, 2, -1]]
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        seen = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
        raise ValueError(f"attention_mask must be a (B, M) tensor of 0/1, got {seen!r}")
    if attention_mask.dtype != torch.bool:
        if attention_mask.dtype.is_floating_point or not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (real token) only, as HF tokenizers return it")
    pos = positions_from_padding(attention_mask)
    return pos[:, pos.shape[1] - n_new:]


class RopeTable:
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

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, *, width: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, N) or (N,) (negative: padding, treated as 0) -> cos, sin (..., R) in ``dtype``; ``width``:
        the first ``width`` columns only (gathered alone)."""
        if self.dynamic:
            cos, sin = self.emb.cos_sin(positions, dtype=dtype)
            return (cos, sin) if width is None else (cos[..., :width], sin[..., :width])
        cos, sin = self._table(positions.device, dtype)
        if width is not None:
            cos, sin = cos[:, :width], sin[:, :width]
        p = positions.clamp_min(0)
        return cos[p], sin[p]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions, x.dtype if x.dtype == torch.float64 else torch.float32)
        return apply_rotary(x, cos, sin, interleaved=self.emb.interleaved)


class _ForwardContext:
    """What every layer of one forward pass shares: positions, cache, masks and RoPE tables of the step."""

    __slots__ = ("positions", "cache", "n", "dtype", "input_ids", "_cos_sin", "_masks", "_real", "shared_kv",
                 "per_layer", "side_states")

    def __init__(self, positions: torch.Tensor | None, cache: AttentionCache | None, n: int,
                 dtype: torch.dtype, input_ids: torch.Tensor | None = None) -> None:
        self.positions, self.cache, self.n, self.dtype = positions, cache, n, dtype
        self.shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # KV sharing without a cache, by layer
        self.per_layer: torch.Tensor | None = None  # (B, N, L, P) per-layer inputs (Gemma 4)
        self.side_states: dict[int, tuple[torch.Tensor, ...]] = {}  # with a cache: state kept beside a layer's
        self.input_ids = input_ids  # (B, N): what hash-routed experts choose by
        self._cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[int | None, masks.Mask] = {}
        self._real: tuple[torch.Tensor | None] | None = None

    def real_tokens(self) -> torch.Tensor | None:
        """(B, N, 1) 1 on real tokens and 0 on padding (position -1), for recurrent layers; None without padding."""
        if self._real is None:
            pos = self.positions
            pad = pos is not None and pos.dim() == 2 and bool((pos < 0).any())
            self._real = ((pos >= 0).unsqueeze(-1).to(self.dtype) if pad else None,)
        return self._real[0]

    def cos_sin(self, table: RopeTable, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(table)
        if key not in self._cos_sin:
            pos = self.positions if self.positions is not None else torch.arange(self.n, device=device)
            work = torch.float64 if self.dtype == torch.float64 else torch.float32
            self._cos_sin[key] = table.cos_sin(pos, work)
        return self._cos_sin[key]

    def self_mask(self, window: int | None) -> masks.Mask:
        """Causal (and windowed) mask of a step without a cache, built once for every layer of that window."""
        if window not in self._masks:
            self._masks[window] = attention_mask(self.positions, self.positions, causal=True, window=window)
        return self._masks[window]


def _norm(c: DecoderConfig, dim: int) -> nn.Module:
    if c.norm == "layer":
        return nn.LayerNorm(dim, eps=c.layer_norm_eps)
    return RMSNorm(dim, eps=c.rms_norm_eps, offset=c.norm_offset)


def _feed_forward(c: DecoderConfig, layer_idx: int) -> nn.Module:
    if c.moe is not None and c.moe.is_moe(layer_idx) and c.moe.beside_dense:  # Gemma 4 26B-A4B
        return ParallelMoE(c.hidden_size, c.intermediate_size_for(layer_idx), c.moe, activation=c.hidden_act,
                           eps=c.rms_norm_eps)
    if c.moe is not None and c.moe.is_moe(layer_idx):
        hashed = c.vocab_size if layer_idx in c.moe.hash_layers else None  # DeepSeek-V4: experts by token id
        return MoE(c.hidden_size, c.moe, activation=c.hidden_act, bias=c.mlp_bias, hash_vocab=hashed)
    width = c.intermediate_size_for(layer_idx)
    if c.moe is not None and c.moe.swiglu_limit is not None and c.moe.moe_layers is not None:
        # MiniMax-M3: its dense layers use the experts' clamped SwiGLU
        return ClampedSwiGLUMLP(c.hidden_size, width, alpha=c.moe.swiglu_alpha, limit=c.moe.swiglu_limit)
    if c.gated_mlp:
        return GatedMLP(c.hidden_size, width, activation=c.hidden_act, bias=c.mlp_bias)
    return FeedForward(c.hidden_size, width, activation=c.hidden_act, bias=c.mlp_bias)


class DecoderLayer(nn.Module):
    """One layer: a token mixer and a feed-forward branch, each pre-normed (and post-normed with sandwich norms).

    The mixer is the kind :func:`qkv.config.mixers.mixer_of` names for the layer, built and called one way
    (:class:`qkv.nn.mixer.DecoderMixer`) and held under HF's name for its kind (``self_attn`` for attention,
    ``linear_attn`` for a recurrent mixer); :attr:`mixer` is it, whatever the name."""

    def __init__(self, c: DecoderConfig, layer_idx: int, rope: RopeTable | None) -> None:
        super().__init__()
        kind = mixer_of(c, layer_idx)
        self.kind, self.recurrent, self._mixer_name = kind.name, kind.recurrent, kind.attribute
        pre, post = c.layer_norms(layer_idx)
        self.attn_norm = _norm(c, c.hidden_size) if pre else None
        setattr(self, kind.attribute, build_mixer(c, layer_idx, rope))
        self.attn_out_norm = _norm(c, c.hidden_size) if post else None
        self.ffn_norm = _norm(c, c.hidden_size) if pre else None
        self.mlp = _feed_forward(c, layer_idx)
        self.ffn_out_norm = _norm(c, c.hidden_size) if post else None
        self._hashed = isinstance(self.mlp, MoE) and self.mlp.hashed
        self._reads_raw = isinstance(self.mlp, ParallelMoE)  # its router and experts read the un-normed branch input
        self.attn_residual: Residual = residual_for(c, layer_idx, "attn")
        self.ffn_residual: Residual = residual_for(c, layer_idx, "ffn")
        self.layer_idx = layer_idx
        self.ple = PerLayerEmbedding.for_decoder(c, layer_idx)  # Qwen4-Exp's n-gram embedding, on some layers
        self.per_layer_input = (PerLayerBranch(c.hidden_size, c.per_layer_input_size, activation=c.hidden_act,
                                               eps=c.rms_norm_eps) if c.per_layer_input_size else None)
        if c.layer_scalars:  # Gemma 4: the layer's output times a stored scalar
            self.register_buffer("layer_scalar", torch.ones(1))
        else:
            self.layer_scalar = None

    @property
    def mixer(self) -> DecoderMixer:
        """This layer's token mixer (``self_attn`` or ``linear_attn``)."""
        return getattr(self, self._mixer_name)

    def forward(self, x: torch.Tensor, step: _ForwardContext, keep: int = 0) -> torch.Tensor:
        """The residual streams (B, N, ...) -> (B, N, ...) (the hidden state (B, N, d) itself with the plain
        residual, :mod:`qkv.nn.residual`); with ``0 < keep < N`` only the last ``keep`` columns go on: the mixer
        still reads every column (the cache stores all keys and values, a recurrent state takes every token),
        grouped-query attention attends only the kept queries, the feed-forward runs on the kept columns (a
        decoder's last layer before logits of the last columns)."""
        keep = keep if 0 < keep < x.shape[1] else 0
        if self.ple is not None:
            x = x + self.ple.mix(x, step)
        a, ctx = self.attn_residual.enter(x)
        h = self.mixer.mix(a if self.attn_norm is None else self.attn_norm(a), step, keep)  # no pre-norm: OLMo 2/3
        if keep:
            h = h[:, -keep:]  # a no-op view for an output already kept
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        x = self.attn_residual.leave(x, h, ctx)
        raw, ctx = self.ffn_residual.enter(x)
        a = raw if self.ffn_norm is None else self.ffn_norm(raw)
        if self._hashed:
            h = self.mlp(a, input_ids=step.input_ids[:, step.input_ids.shape[1] - a.shape[1]:])
        elif self._reads_raw:
            h = self.mlp(a, raw)
        else:
            h = self.mlp(a)
        if self.ffn_out_norm is not None:
            h = self.ffn_out_norm(h)
        x = self.ffn_residual.leave(x, h, ctx)
        if self.per_layer_input is not None:
            e = step.per_layer[:, :, self.layer_idx]
            x = self.per_layer_input(x, e[:, -x.shape[1]:])
        return x if self.layer_scalar is None else x * self.layer_scalar


def _refuse_inner_padding(real: torch.Tensor, state, layer_idx: int) -> None:
    """Padding (B, N) between a row's real tokens: the recurrent state would decay through it and the convolution
    would read zeros, so the row's later tokens would be wrong. Left padding of a fresh row and trailing padding
    are exact."""
    before = real.cumsum(1) > 0  # a real token at or before each column, this step
    if state is not None:
        seen = (state[0] != 0).flatten(1).any(1) | (state[1] != 0).flatten(1).any(1)  # rows with earlier tokens
        before = before | seen[:, None]
    after = real.flip(1).cumsum(1).flip(1) > 0  # a real token at or after each column
    bad = (~real & before & after).any(1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"DecoderLM: layer {layer_idx} (recurrent) got padding (position -1) between real tokens of "
                         f"row {row}; a recurrent state cannot skip tokens inside a sequence. Pad rows on the left of "
                         "their first token (or after their last one)")


_PROTOCOL_CACHES: set[type] = set()  # cache types already checked against the protocol (a decode step is short)


def _check_cache(cache) -> None:
    if not isinstance(cache, AttentionCache):
        raise TypeError(f"DecoderLM: cache must follow qkv.cache.AttentionCache (e.g. "
                        f"qkv.cache.KVCache(model.cache_specs())), got {type(cache).__name__}")
    _PROTOCOL_CACHES.add(type(cache))


def _refuse_scoring_cache(model: DecoderLM, cache: AttentionCache) -> None:
    """Before anything is written: a layer with score modifiers cannot be ranked by q.k alone (H2O, SnapKV)."""
    for i in model._modified_scores:
        refuse_scoring_cache(cache, i, owner="DecoderLM", modifiers=model.layers[i].mixer.score_modifiers())


def _plain_product(head) -> bool:
    """Whether an LM head (an ``nn.Linear``, or the tied head's ``linear_fn``) computes ``F.linear`` and nothing
    more: ``nn.Linear`` itself, ``F.linear``, or an object that says so (``computes_linear``, as
    :mod:`qkv.cpu.gemm`'s products do)."""
    return head is F.linear or type(head) is nn.Linear or getattr(head, "computes_linear", False) is True


class DecoderLM(nn.Module):
    """The decoder-only language model of a :class:`qkv.nn.DecoderConfig`; a :class:`qkv.cache.DecoderModel`.

    Args:
        config: the model's shape and switches (``qkv.nn.get_config("tiny-llama")``, or what
            :func:`qkv.models.from_hf` reads from a checkpoint).

    ``next_tokens(ids, positions=, cache=)`` gives the greedy tokens after the last column without handing out
    logits (through an int8 screen of the head where :func:`qkv.cpu.optimize` set one: :mod:`qkv.cpu.greedy`).

    Submodules keep the names HF users know: ``embed_tokens``, ``layers[i].self_attn`` (``qkv_proj``,
    ``o_proj``), ``layers[i].mlp``, ``norm``, ``lm_head`` (None when tied to ``embed_tokens``). Every product
    is a plain ``nn.Linear`` or, for the tied head, ``linear_fn`` (``F.linear``); :func:`qkv.cpu.optimize`
    swaps in CPU products from outside.

    ``cache_specs()``: one :mod:`qkv.cache` layer spec per layer: ``FullSpec``, ``SlidingWindowSpec`` for
    local layers, ``LatentSpec`` for MLA, ``RecurrentSpec`` for recurrent layers; ``KVCache(model.cache_specs())``
    is a cache for it.

    Example:
        >>> import torch
        >>> from qkv.cache import KVCache
        >>> from qkv.nn import DecoderLM, get_config
        >>> lm = DecoderLM(get_config("tiny-llama")).eval()
        >>> ids = torch.randint(0, 256, (2, 6))
        >>> out = lm(ids, cache=KVCache(lm.cache_specs()))
        >>> step = lm(ids[:, :1], cache=out.cache)   # continues at position 6
        >>> out.logits.shape, step.logits.shape
        (torch.Size([2, 6, 256]), torch.Size([2, 1, 256]))
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"DecoderLM: config must be a qkv.nn.DecoderConfig (e.g. qkv.nn.get_config('tiny-llama')), "
                            f"got {type(config).__name__}")
        if config.attention_only:
            raise ValueError(f"DecoderLM: {config.name or 'the config'} describes the attention layout only "
                             f"(vocab_size={config.vocab_size}, intermediate_size={config.intermediate_size}); a "
                             "model needs both: give them with config.replace(vocab_size=..., intermediate_size=...)")
        c = self.config = config
        self.ropes: dict[str, RopeTable] = {}
        if c.position == "rope":
            for kind in dict.fromkeys(t for t in c.layer_types if t != LINEAR_ATTENTION):
                rotary_dim = c.latent.qk_rope_head_dim if c.latent is not None else c.head_dim_by_type.get(kind,
                                                                                                          c.head_dim)
                self.ropes[kind] = RopeTable(RotaryEmbedding.from_params(c.rope_for(kind), rotary_dim,
                                                                         c.max_position_embeddings))
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.pos_embed = (LearnedPositionalEmbedding(c.max_position_embeddings, c.hidden_size)
                          if c.position == "learned" else None)
        self.embed_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps) if c.embed_norm else None
        self.embed_per_layer = (PerLayerInputs(c.per_layer_vocab_size or c.vocab_size, c.hidden_size,
                                               c.num_hidden_layers, c.per_layer_input_size, eps=c.rms_norm_eps)
                                if c.per_layer_input_size else None)
        self.layers = nn.ModuleList(DecoderLayer(c, i, self.ropes.get(t) if c.uses_rope(i) else None)
                                    for i, t in enumerate(c.layer_types))
        self.residual: Residual = residual_for(c, None, "model")  # widens the embedding, collapses before the norm
        self.norm = _norm(c, c.hidden_size) if c.final_norm else None
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.linear_fn = F.linear  # the tied head's product (qkv.cpu.optimize swaps in its own)
        self.head_screen: TokenScreen | None = None  # greedy tokens' int8 screen (qkv.cpu.optimize sets one)
        # layers whose scores carry modifiers (ALiBi, softcap): a cache that ranks tokens by q.k alone is refused
        self._modified_scores = [i for i, layer in enumerate(self.layers) if layer.mixer.score_modifiers()]
        self._recurrent = [i for i, layer in enumerate(self.layers) if layer.recurrent]

    def _positions(self, input_ids: torch.Tensor, attention_mask, positions, cache) -> torch.Tensor | None:
        B, N = input_ids.shape
        device = input_ids.device
        if attention_mask is not None:
            if positions is not None:
                raise ValueError("DecoderLM: pass attention_mask or positions, not both (positions are absolute "
                                 "token positions, -1 on padding; attention_mask is HF's 0/1 padding mask)")
            past = cache.seq_length if cache is not None else 0
            if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) not in (
                    (B, past + N),) + (((B, N),) if past == 0 else ()):
                seen = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
                raise ValueError(f"DecoderLM: attention_mask must be (B, cached + new) = {(B, past + N)} (0 for "
                                 f"padding, 1 for real tokens, the cached columns first), got {seen}")
            return positions_from_attention_mask(attention_mask.to(device), N)
        if positions is not None:
            return batch_positions(positions, B, N, owner="DecoderLM", device=device)
        if cache is not None:
            offset = cache.seq_length
            return torch.arange(offset, offset + N, device=device).expand(B, N)
        return None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, cache: AttentionCache | None = None,
                logits_to_keep: int = 0) -> DecoderOutput:
        """Logits of the next token at every (or the last ``logits_to_keep``) position.

        Args:
            input_ids: (B, N) int64 token ids.
            attention_mask: HF's (B, M) padding mask, 1 for real tokens and 0 for padding (left or right),
                ``M = N`` without a cache, or the cached columns followed by the new ones. A token's position
                counts the real tokens before it; padding tokens are never attended. Exclusive with
                ``positions``.
            positions: (B, N) or (N,) int64 absolute positions of the new tokens, ``-1`` for padding tokens.
                Default: ``0 .. N-1``, or continuing from ``cache.seq_length`` with a cache.
            cache: a :class:`qkv.cache.AttentionCache` (e.g. ``KVCache(model.cache_specs())``), updated in
                place with this step's keys and values.
            logits_to_keep: when > 0, only the last that many columns get logits (a prefill for generation
                needs one).

        Returns:
            :class:`DecoderOutput` ``(logits (B, N or logits_to_keep, V), cache)``.
        """
        if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool) or logits_to_keep < 0:
            raise ValueError(f"DecoderLM: logits_to_keep must be an int >= 0 (0: every position), got "
                             f"{logits_to_keep!r}")
        x = self._hidden(input_ids, attention_mask, positions, cache, logits_to_keep)
        logits = self.linear_fn(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)  # (B, N, V)
        cap = self.config.final_logit_softcapping
        return DecoderOutput(logits if cap is None else cap * torch.tanh(logits / cap), cache)

    def next_tokens(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                    cache: AttentionCache | None = None) -> torch.Tensor:
        """Greedy next tokens (B,) int64 after the last column: ``forward(...).logits[:, -1].argmax(-1)``, the first
        largest logit of each row. With a :class:`qkv.cpu.greedy.HeadScreen` in ``head_screen`` (set by
        :func:`qkv.cpu.optimize` where it runs) the float32 head product is replaced, for as many rows as the screen
        says it is faster (``screens``), by its int8 screen and a float64 check of the few tokens the screen leaves
        (the same tokens wherever float32 logits tell them apart); a final logit softcap is monotonic but may round
        two logits to one float32 value, so the screen is told the cap and leaves rows whose capped winner is that
        close to another token to the float32 logits.
        Arguments as :meth:`forward`."""
        x = self._hidden(input_ids, None, positions, cache, 1)[:, -1]  # (B, d)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        bias = None if self.lm_head is None else self.lm_head.bias
        screen = self.head_screen
        cap = self.config.final_logit_softcapping
        if (screen is not None and bias is None
                and _plain_product(self.linear_fn if self.lm_head is None else self.lm_head)
                and screen.screens(x, weight)):
            return screen.tokens(x, weight, cap)
        logits = self.linear_fn(x, weight) if self.lm_head is None else self.lm_head(x)
        return (logits if cap is None else cap * torch.tanh(logits / cap)).argmax(-1)

    def _hidden(self, input_ids: torch.Tensor, attention_mask, positions, cache, keep: int) -> torch.Tensor:
        """The final norm's output (B, N or keep, d): the checks, embeddings and every layer of :meth:`forward`."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            seen = (f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
                    else type(input_ids).__name__)
            raise ValueError(f"DecoderLM: input_ids must be an integer tensor (B, N), got {seen}")
        if cache is not None and type(cache) not in _PROTOCOL_CACHES:
            _check_cache(cache)
        if cache is not None and self._modified_scores:
            _refuse_scoring_cache(self, cache)
        N = input_ids.shape[1]
        positions = self._positions(input_ids, attention_mask, positions, cache)
        longest = int(positions.max()) + 1 if positions is not None and positions.numel() else N
        for table in self.ropes.values():
            table.reserve(longest)
        x = self.embed_tokens(input_ids)  # (B, N, d)
        if self.config.scale_embeddings:  # Gemma: sqrt(d) rounded to the weights' dtype, as HF does
            x = x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype)
        if self.pos_embed is not None:
            pos = positions if positions is not None else torch.arange(N, device=x.device)
            x = x + self.pos_embed(pos).to(x.dtype)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        step = _ForwardContext(positions, cache, N, x.dtype, input_ids)
        if self.embed_per_layer is not None:
            step.per_layer = self.embed_per_layer(input_ids, x)
        if self._recurrent and N > 1 and (real := step.real_tokens()) is not None:  # before any layer writes
            i = self._recurrent[0]
            _refuse_inner_padding(real[..., 0] > 0, None if cache is None else cache.recurrent_state(i), i)
        x = self.residual.widen(x)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):  # the last layer carries on only the kept columns
            x = layer(x, step, keep if i == last else 0)
        if keep and x.shape[1] > keep:  # a model without layers
            x = x[:, -keep:]
        x = self.residual.collapse(x)
        return x if self.norm is None else self.norm(x)

    def cache_specs(self, *, values_only: bool = True) -> list[LayerSpec]:
        """One :mod:`qkv.cache` layer spec per layer (:func:`qkv.cache.describe.cache_specs_of` its config);
        ``values_only=False``: K = V layers store keys and values apart (for eviction policies and quantized
        caches), not the values alone."""
        return cache_specs_of(self.config, values_only=values_only)
