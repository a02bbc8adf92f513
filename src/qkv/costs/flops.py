"""Attention FLOPs (scores and weighted values only; no projections) and score-matrix sizes.

Forward: ``QK^T`` and ``PV`` are ``Nq * Nk * D`` multiply-adds each per head, 2 FLOPs per
multiply-add, so ``4 * B * Hq * Nq * Nk * D`` (``2 * B * Hq * Nq * Nk * (Dqk + Dv)`` when the
widths differ). Which (query, key) pairs count:

- full: ``Nq * Nk``;
- causal with ``Nq == Nk``: half, ``Nq * Nk / 2``, the convention of the FlashAttention benchmarks
  (the exact count ``N (N + 1) / 2`` is ``N / 2`` pairs more);
- causal with ``Nq != Nk`` (decode, chunked prefill) or a sliding window: counted exactly, bottom-right
  aligned (query ``i`` sits at position ``i + Nk - Nq``) and seeing at most ``window`` keys, itself
  included (HF ``sliding_window``). A window that covers every key falls back to the rules above.

Training is forward + backward with backward = 2.5 x forward, so 3.5 x forward: the backward pass
runs five matmuls (recomputed ``QK^T``, ``dV``, ``dP``, ``dQ``, ``dK``) against the forward's two, as
counted by FlashAttention-2 (Dao 2023, arXiv:2307.08691).

MLA decode with the up-projections absorbed (DeepSeek-V2, arXiv:2405.04434, Sec. 2.1.2) attends in the
latent space: each head scores a ``kv_lora_rank`` latent query plus a ``qk_rope_head_dim`` RoPE query
against the cache and sums ``kv_lora_rank``-wide latent values, ``2 * B * Hq * pairs * (2 * kv_lora_rank
+ qk_rope_head_dim)``. The per-query absorption matmuls are projections and are not counted.

Recurrent layers of hybrid models (Gated DeltaNet, Yang et al. 2025, arXiv:2412.06464) have no scores: per token
and value head the recurrent form reads the state with the key (``S^T k``), writes a rank-1 correction and reads
it with the query, three ``Dk x Dv`` products, ``6 * B * H * N * Dk * Dv`` FLOPs whatever the context
(:func:`recurrent_flops`; the short convolution, the decay and the norms are O(channels) and not counted).
"""

from __future__ import annotations

from typing import NamedTuple

from ..config.layer_types import LINEAR_ATTENTION
from ..config.presets import ModelPreset

__all__ = [
    "TRAINING_MULTIPLIER",
    "AttentionFlops",
    "attention_flops",
    "mla_absorbed_flops",
    "model_attention_flops",
    "recurrent_flops",
    "score_elements",
]

TRAINING_MULTIPLIER = 3.5  # forward 1 + backward 2.5 (FlashAttention-2's count)


def _sum_clipped(lo: int, hi: int, cap: int) -> int:
    """``sum(min(max(t, 0), cap) for t in range(lo, hi + 1))`` in O(1)."""
    lo = max(lo, 1)
    if lo > hi:
        return 0
    mid = min(hi, cap)  # terms lo..mid count t, terms above mid count cap
    rising = (lo + mid) * (mid - lo + 1) // 2 if lo <= mid else 0
    return rising + cap * (hi - max(mid, lo - 1))


def attended_pairs_x2(q_len: int, kv_len: int, causal: bool, window: int | None) -> int:
    """Twice the (query, key) pairs computed, so the causal half of an odd square stays an int."""
    for arg, value in (("q_len", q_len), ("kv_len", kv_len), ("window", window)):
        if (value is not None or arg != "window") and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    if window is None or window >= kv_len:
        if not causal and window is None:
            return 2 * q_len * kv_len
        if q_len == kv_len:
            return q_len * kv_len
        window = kv_len
    # Query i sees keys up to position i + kv_len - q_len, at most `window` of them.
    return 2 * _sum_clipped(kv_len - q_len + 1, kv_len, window)


def attention_flops(
    batch: int, num_heads: int, q_len: int, kv_len: int, head_dim: int, *,
    v_head_dim: int | None = None, causal: bool = False, window: int | None = None,
) -> int:
    """Forward FLOPs of one attention layer, ``2 * B * Hq * pairs * (Dqk + Dv)``.

    Args:
        batch, num_heads: ``B`` and query heads ``Hq`` (KV heads do not change the count).
        q_len, kv_len: ``Nq`` and ``Nk``.
        head_dim: ``Dqk``; ``v_head_dim``: ``Dv`` (default ``Dqk``).
        causal: bottom-right causal mask; halves the count when ``Nq == Nk``.
        window: sliding window in keys, the query's own included (HF convention); implies causal.

    Example:
        >>> attention_flops(1, 1, 4, 4, 8)  # 4 * 4 * 4 * 8
        512
        >>> attention_flops(1, 1, 4, 4, 8, causal=True), attention_flops(1, 1, 4, 4, 8, window=2)
        (256, 224)
    """
    pairs_x2 = attended_pairs_x2(q_len, kv_len, causal, window)
    return batch * num_heads * pairs_x2 * (head_dim + (v_head_dim or head_dim))


def mla_absorbed_flops(
    batch: int, num_heads: int, q_len: int, kv_len: int, *, kv_lora_rank: int, qk_rope_head_dim: int,
    causal: bool = False, window: int | None = None,
) -> int:
    """Forward FLOPs of one MLA layer attending in the latent space (up-projections absorbed).

    ``2 * B * Hq * pairs * (2 * kv_lora_rank + qk_rope_head_dim)``: scores over ``kv_lora_rank +
    qk_rope_head_dim``, values ``kv_lora_rank`` wide.

    Example:
        >>> mla_absorbed_flops(1, 128, 1, 1000, kv_lora_rank=512, qk_rope_head_dim=64)
        278528000
    """
    pairs_x2 = attended_pairs_x2(q_len, kv_len, causal, window)
    return batch * num_heads * pairs_x2 * (2 * kv_lora_rank + qk_rope_head_dim)


def score_elements(q_len: int, kv_len: int | None = None, *, batch: int = 1, num_heads: int = 1,
                   num_layers: int = 1) -> int:
    """Elements of the score matrices ``QK^T``: ``B * H * L * Nq * Nk`` (``N**2`` per head per layer).

    Example:
        >>> score_elements(2048), score_elements(131072)
        (4194304, 17179869184)
    """
    kv_len = q_len if kv_len is None else kv_len
    return batch * num_heads * num_layers * q_len * kv_len


class AttentionFlops(NamedTuple):
    """Attention FLOPs of a whole model at a context length (all layers, all ``batch`` sequences).

    ``prefill``: forward over a causal prompt of ``context`` tokens. ``decode``: one new token against
    ``context`` cached tokens. ``training``: forward + backward over ``context`` tokens, 3.5 x prefill.
    ``decode_absorbed``: ``decode`` for MLA with absorbed up-projections, ``None`` for other models.
    """

    preset: str
    context: int
    batch: int
    prefill: int
    decode: int
    training: int
    decode_absorbed: int | None


def recurrent_flops(preset: ModelPreset, n_tokens: int, *, batch: int = 1) -> int:
    """FLOPs of one recurrent (``linear_attention``) layer of ``preset`` over ``n_tokens`` new tokens per sequence:
    ``6 * B * H * N * Dk * Dv`` (module notes), independent of the context before them.

    Example:
        >>> from qkv.costs import PRESETS
        >>> recurrent_flops(PRESETS["qwen3-next-80b-a3b"], 1) == 6 * 32 * 128 * 128
        True
    """
    lin = preset.config.linear_attention
    if lin is None:
        raise ValueError(f"recurrent_flops: {preset.name} has no recurrent (linear_attention) layers")
    return 6 * batch * lin.linear_num_value_heads * n_tokens * lin.linear_key_head_dim * lin.linear_value_head_dim


def model_attention_flops(preset: ModelPreset, *, context: int, batch: int = 1) -> AttentionFlops:
    """Prefill, per-token decode and training attention FLOPs of ``preset``; local layers use the window,
    recurrent layers :func:`recurrent_flops`.

    Example:
        >>> from qkv.costs import PRESETS
        >>> f = model_attention_flops(PRESETS["llama-3-8b"], context=8192)
        >>> f.prefill == 32 * attention_flops(1, 32, 8192, 8192, 128, causal=True)
        True
    """
    c, lat = preset.config, preset.config.latent
    prefill = decode = 0
    absorbed = 0 if lat is not None else None
    for kind, n in preset.layer_counts.items():
        if kind == "recurrent":
            prefill += n * recurrent_flops(preset, context, batch=batch)
            decode += n * recurrent_flops(preset, 1, batch=batch)
            absorbed = None if absorbed is None else absorbed + n * recurrent_flops(preset, 1, batch=batch)
            continue
        window = c.sliding_window if kind == "local" else None
        shape = dict(head_dim=preset.key_head_dim, v_head_dim=preset.value_head_dim, causal=True, window=window)
        if c.head_dim_by_type:  # Gemma 4: a layer type's own head width (every layer of one kind shares it)
            i = next(i for i in range(c.num_hidden_layers) if c.window_for(i) == window
                     and c.layer_types[i] != LINEAR_ATTENTION)
            shape.update(head_dim=c.head_dim_for(i), v_head_dim=c.head_dim_for(i))
        prefill += n * attention_flops(batch, c.num_attention_heads, context, context, **shape)
        decode += n * attention_flops(batch, c.num_attention_heads, 1, context, **shape)
        if absorbed is not None:
            absorbed += n * mla_absorbed_flops(
                batch, c.num_attention_heads, 1, context, kv_lora_rank=lat.kv_lora_rank,
                qk_rope_head_dim=lat.qk_rope_head_dim, causal=True, window=window,
            )
    num, den = TRAINING_MULTIPLIER.as_integer_ratio()  # exact integers: counts pass 2**53
    training = prefill * num // den
    return AttentionFlops(preset.name, context, batch, prefill, decode, training, absorbed)
