"""FLOPs of a whole decoder: attention beside the projections, the feed-forward and the LM head.

A weight matrix ``(in, out)`` costs ``2 * in * out`` FLOPs per token (one multiply-add per weight); biases,
norms, activations, softmax and the embedding lookup are not counted (they are O(d) per token). A
mixture-of-experts layer counts its router, the ``num_experts_per_tok`` experts a token uses and the shared
ones. Attention is :func:`qkv.costs.attention_flops` per layer (causal, local layers windowed; MLA counted
expanded, ``Dqk + Dv`` per pair).

- prefill: one forward over a causal prompt; logits for its last token only (what generation needs).
- decode: one new token attending to ``context`` cached tokens (itself included); its logits.
- training: forward with logits at every position, plus backward: 2x forward for the matmuls (the weight
  and the input gradients), 2.5x forward for attention (FlashAttention-2's count), so 3x and 3.5x in all.
- generation of ``T`` tokens after a prompt of ``P``: with a KV cache, one prefill then ``T - 1`` decode
  steps against ``P + 1 .. P + T - 1`` keys; without one, every step reruns a prefill over the whole
  sequence so far, ``P, P + 1, ..., P + T - 1`` tokens. Attention then grows as ``N^3`` in the sequence
  length instead of ``N^2`` (the texts' "O(N^3) to O(N^2)"), and the rest as ``N^2`` instead of ``N``.

The crossover is the shortest context at which attention's share of a training-style forward (logits at
every position) reaches the rest's: the scores and weighted values (``~ 2 N^2 Hq (Dqk + Dv)`` per layer,
causal) against ``2 N`` times the matmul weights. Models whose every layer slides never cross when the
window is short.

Example:
    >>> from qkv.costs import PRESETS, crossover_context, generation_flops
    >>> crossover_context(PRESETS["llama-2-70b"])
    104848
    >>> g0, g1 = (generation_flops(PRESETS["gpt-2-small"], 1, 1023, use_cache=c) for c in (False, True))
    >>> round(g0.total / g1.total)
    352
"""

from __future__ import annotations

from typing import NamedTuple

from ..config.mixers import mixer_of
from ..config.presets import ModelPreset
from .compressed import compressed_pairs
from .flops import attended_pairs_x2
from .params import decoder_side, layer_ffn_params, require_whole_model, resolve_preset

__all__ = [
    "FlopBreakdown",
    "GenerationFlops",
    "ModelFlops",
    "crossover_context",
    "forward_flops",
    "generation_flops",
    "model_flops",
]

_ATTN_TRAIN_NUM, _ATTN_TRAIN_DEN = 7, 2  # 3.5 x forward, exact in integers


class FlopBreakdown(NamedTuple):
    """FLOPs of one pass by part: ``attention`` (scores and weighted values), ``projections`` (query,
    key, value, output), ``ffn``, ``lm_head``; ``rest`` is everything but attention."""

    attention: int
    projections: int
    ffn: int
    lm_head: int

    @property
    def rest(self) -> int:
        return self.projections + self.ffn + self.lm_head

    @property
    def total(self) -> int:
        return self.attention + self.rest

    @property
    def attention_share(self) -> float:
        return self.attention / self.total if self.total else 0.0


def _check(preset, what: str) -> ModelPreset:
    """The preset (a name, HF config path or dict resolved), checked to be a whole model and decoder-only."""
    preset = resolve_preset(preset, what)
    require_whole_model(preset, what)
    if preset.encoder_layers:
        raise ValueError(f"{what}: {preset.name!r} is an encoder-decoder; whole-model FLOPs cover decoder-only "
                         "models (num_parameters counts it)")
    return preset


def _positive(what: str, **values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{what}: {name} must be a positive int, got {v!r}")


def _matmul_weights(preset: ModelPreset) -> tuple[int, int]:
    """Weights a token multiplies by, all layers: (every layer's mixer projections, feed-forward actually used)."""
    p, c = preset, decoder_side(preset)
    ffn = sum(layer_ffn_params(p, i, bias=False)[1] for i in range(c.num_hidden_layers))
    return sum(mixer_of(c, i).weights(c, i) for i in range(c.num_hidden_layers)), ffn


def forward_flops(preset: ModelPreset, q_len: int, kv_len: int | None = None, *, batch: int = 1,
                  logits: str = "all") -> FlopBreakdown:
    """FLOPs of one forward over ``q_len`` new tokens attending to ``kv_len`` keys (cached ones included).

    Args:
        preset: a whole-model :class:`ModelPreset` (decoder-only).
        q_len: new tokens per sequence; ``kv_len``: keys they attend to (default ``q_len``, no cache).
        batch: sequences.
        logits: ``"all"`` (every new token, training) or ``"last"`` (one per sequence, generation).

    Example:
        >>> from qkv.costs import PRESETS
        >>> f = forward_flops(PRESETS["gpt-2-small"], 1024)
        >>> f.lm_head == 2 * 1024 * 768 * 50257
        True
    """
    preset = _check(preset, "forward_flops")
    kv_len = q_len if kv_len is None else kv_len
    _positive("forward_flops", q_len=q_len, kv_len=kv_len, batch=batch)
    if kv_len < q_len:
        raise ValueError(f"forward_flops: kv_len ({kv_len}) must be >= q_len ({q_len}): the new tokens are keys too")
    if logits not in ("all", "last"):
        raise ValueError(f"forward_flops: logits must be 'all' or 'last', got {logits!r}")
    p, c = preset, decoder_side(preset)
    attn = 0
    for i in range(c.num_hidden_layers):  # each layer's mixer: per attended (query, key) pair and per new token
        kind = mixer_of(c, i)
        pairs_x2 = attended_pairs_x2(q_len, kv_len, True, kind.window(c, i))
        attn += batch * (pairs_x2 * kind.pair_flops(c, i) // 2 + q_len * kind.token_flops(c, i))
        if c.compressed is not None and c.compressed.attention_types[i] != "sliding":
            attn += batch * _compressed_entry_flops(c, i, q_len, kv_len)
    proj, ffn = _matmul_weights(p)
    tokens = batch * q_len
    head_rows = tokens if logits == "all" else batch
    return FlopBreakdown(attn, 2 * tokens * proj, 2 * tokens * ffn, 2 * head_rows * c.hidden_size * c.vocab_size)


def _compressed_entry_flops(c, i: int, q_len: int, kv_len: int) -> int:
    """DeepSeek-V4's compressed entries beside the window (DeepSeek-AI 2026, DeepSeek-V4 report, Section 2.3): an
    entry of ``rate`` tokens is visible once all its tokens are; HCA attends every visible entry, CSA the indexer's
    ``index_topk`` of them, after the indexer scored every visible entry (``2 Hi Di`` per pair). Per attended entry
    the scores and values of every query head, as a window key."""
    cc = c.compressed
    kind = cc.attention_types[i]
    rate = cc.compress_rates[kind]
    attended = compressed_pairs(kv_len, rate=rate, topk=cc.index_topk if kind == "csa" else None, q_len=q_len)
    flops = attended * 4 * c.num_attention_heads * c.head_dim
    if kind == "csa":
        flops += compressed_pairs(kv_len, rate=rate, q_len=q_len) * 2 * cc.index_n_heads * cc.index_head_dim
    return flops


class ModelFlops(NamedTuple):
    """Prefill, one decode step and one training step of ``preset`` at ``context`` tokens (see module doc)."""

    preset: str
    context: int
    batch: int
    prefill: FlopBreakdown
    decode: FlopBreakdown
    training: FlopBreakdown


def model_flops(preset: ModelPreset, *, context: int, batch: int = 1) -> ModelFlops:
    """Prefill, per-token decode and training FLOPs of the whole model, split attention vs the rest.

    Example:
        >>> from qkv.costs import PRESETS
        >>> m = model_flops(PRESETS["llama-3-8b"], context=8192)
        >>> round(m.training.total / m.prefill.total, 2)
        3.26
    """
    preset = _check(preset, "model_flops")
    _positive("model_flops", context=context, batch=batch)
    prefill = forward_flops(preset, context, batch=batch, logits="last")
    decode = forward_flops(preset, 1, context, batch=batch, logits="last")
    fwd = forward_flops(preset, context, batch=batch, logits="all")
    training = FlopBreakdown(fwd.attention * _ATTN_TRAIN_NUM // _ATTN_TRAIN_DEN, 3 * fwd.projections, 3 * fwd.ffn,
                             3 * fwd.lm_head)
    return ModelFlops(preset.name, context, batch, prefill, decode, training)


def crossover_context(preset: ModelPreset, *, limit: int = 1 << 40) -> int | None:
    """The shortest context at which attention's FLOPs in a forward (logits at every position) reach the
    rest's; ``None`` if that never happens below ``limit`` tokens (every layer sliding over a short window).

    Example:
        >>> from qkv.costs import PRESETS
        >>> crossover_context(PRESETS["gpt-2-small"])
        13405
    """
    preset = _check(preset, "crossover_context")

    def attention_dominates(n: int) -> bool:
        f = forward_flops(preset, n)
        return f.attention >= f.rest

    if not attention_dominates(limit):
        return None
    lo, hi = 1, limit  # attention's share grows with n: binary search the first n where it dominates
    while lo < hi:
        mid = (lo + hi) // 2
        if attention_dominates(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class GenerationFlops(NamedTuple):
    """Cumulative FLOPs of generating ``new_tokens`` after ``prompt_tokens`` (per ``batch`` sequences)."""

    preset: str
    prompt_tokens: int
    new_tokens: int
    use_cache: bool
    batch: int
    attention: int
    rest: int

    @property
    def total(self) -> int:
        return self.attention + self.rest


def generation_flops(preset: ModelPreset, prompt_tokens: int, new_tokens: int, *, use_cache: bool = True,
                     batch: int = 1) -> GenerationFlops:
    """FLOPs of greedy generation: with a KV cache, or recomputing every step (see the module docstring).

    Args:
        preset: a whole-model :class:`ModelPreset` (decoder-only).
        prompt_tokens: ``P``, the prompt length (at least 1).
        new_tokens: ``T``, tokens generated (at least 1; the first comes from the prefill).
        use_cache: keep keys and values (one prefill, then one-token steps) or recompute everything.
        batch: sequences generated together.

    Example:
        >>> from qkv.costs import PRESETS
        >>> g = generation_flops(PRESETS["llama-2-70b"], 1000, 1000)
        >>> g.total > 2 * 2000 * 68e9
        True
    """
    preset = _check(preset, "generation_flops")
    _positive("generation_flops", prompt_tokens=prompt_tokens, new_tokens=new_tokens, batch=batch)
    if not isinstance(use_cache, bool):
        raise TypeError(f"generation_flops: use_cache must be a bool, got {type(use_cache).__name__}")
    first = forward_flops(preset, prompt_tokens, batch=batch, logits="last")
    attn, rest = first.attention, first.rest
    for i in range(1, new_tokens):
        n = prompt_tokens + i
        step = (forward_flops(preset, 1, n, batch=batch, logits="last") if use_cache
                else forward_flops(preset, n, batch=batch, logits="last"))
        attn += step.attention
        rest += step.rest
    return GenerationFlops(preset.name, prompt_tokens, new_tokens, use_cache, batch, attn, rest)
