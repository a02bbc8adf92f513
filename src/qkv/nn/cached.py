"""Cached attention written once: :func:`cached_attention` runs the sequence every attention module of
:mod:`qkv.nn` runs around its operator, with or without a KV cache::

    refuse score-ranked eviction      a layer whose cache ranks tokens by q.k alone (H2O, SnapKV) while this call's
                                      scores carry modifiers is refused before anything is written
    cache update + rotate (RoPE)      keys at absolute positions: rotate q and k, store k rotated; a cache that
                                      re-positions keys (StreamingLLM sinks): store k un-rotated with ``rope``,
                                      rotate q at the positions the cache reports
    positions mask                    masks.positions(q_positions, kv_positions, causal=, window=) & mask
    attention_fn                      the module's operator hook (or a cache's in-place decode kernel for a
                                      plain single-query step, :class:`qkv.cache.DecodingCache`)
    head gate                         out * head_gate per query head (:func:`qkv.nn.protocol.apply_head_gate`)
    observe                           cache.observe(layer_idx, q): the rotated queries, for eviction policies

Modules own weights and projections; variants pass what differs as arguments: their q/k/v (QK norm and
gated outputs happen before and after the call), ``window``, ``scale``, ``sinks``, ``score_mod``, a
``position_bias``, an extra ``mask`` (a top-k key selection, document boundaries). Multi-head latent attention
(:class:`qkv.nn.LatentAttention`) keeps latents instead of per-head keys, so its update and its two paths are
its own; it shares the mask (:func:`attention_mask`), the decode-kernel rule (:func:`plain_decode_step`), the
eviction refusal (:func:`refuse_scoring_cache`), the head gate and the observation.

Cache capabilities are read once per cache class, so a decode step pays a dict lookup per layer, not a
protocol check.

Shape legend: B batch, Hq query heads, Hkv key/value heads, N new tokens (queries), S keys attended (cached
and new), D head dim of queries and keys, Dv of values.

Example:
    >>> import torch
    >>> from qkv.cache import FullSpec, KVCache
    >>> from qkv.nn.cached import cached_attention
    >>> from qkv.pos import RotaryEmbedding
    >>> cache, rope = KVCache([FullSpec(2, 8)]), RotaryEmbedding(8)
    >>> q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    >>> pre = cached_attention(q, k, v, cache=cache, positions=torch.arange(5)[None], rope=rope)
    >>> q1, k1, v1 = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    >>> step = cached_attention(q1, k1, v1, cache=cache, positions=torch.tensor([[5]]), rope=rope)
    >>> pre.out.shape, step.out.shape, cache.seq_length
    (torch.Size([1, 4, 5, 8]), torch.Size([1, 4, 1, 8]), 6)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .. import masks
from .._attention import attention
from ..cache.protocol import AttentionCache, DecodingCache, DeferredViewCache, KeysFromValues, LatentCache, RopeFn
from ..pos.relative import PositionalBias
from .protocol import AttentionFn, apply_head_gate

__all__ = ["AttentionHeads", "cached_attention", "attention_mask", "plain_decode_step", "refuse_scoring_cache",
           "CacheCapabilities", "cache_capabilities"]

#: ``rotate(q, k) -> (q, k)``: RoPE on this step's queries and keys at the call's positions, in one go.
RotateFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class AttentionHeads(NamedTuple):
    """Per-head attention output: ``out`` (B, Hq, N, Dv) in the input dtype; ``lse`` (B, Hq, N) float32 when
    asked for (``return_lse``), else None."""

    out: torch.Tensor
    lse: torch.Tensor | None


class CacheCapabilities(NamedTuple):
    """What a cache class declares, read once per class: the base protocol (:class:`qkv.cache.AttentionCache`),
    latents (:class:`qkv.cache.LatentCache`), in-place decoding (:class:`qkv.cache.DecodingCache`), views built
    only when a decode declines (:class:`qkv.cache.DeferredViewCache`), layers storing values only (K = V: a
    ``values_only(layer_idx)`` method, :meth:`qkv.cache.KVCache.values_only`)."""

    attention: bool
    latent: bool
    decoding: bool
    deferred_view: bool = False
    values_only: bool = False


_CAPABILITIES: dict[type, CacheCapabilities] = {}


def cache_capabilities(cache) -> CacheCapabilities:
    """The protocols ``cache`` follows, checked once per cache class (capabilities are methods of the class).

    Example:
        >>> from qkv.cache import FullSpec, KVCache
        >>> cache_capabilities(KVCache([FullSpec(1, 4)]))
        CacheCapabilities(attention=True, latent=True, decoding=True, deferred_view=True, values_only=True)
    """
    kind = type(cache)
    caps = _CAPABILITIES.get(kind)
    if caps is None:
        decoding = isinstance(cache, DecodingCache)
        caps = _CAPABILITIES[kind] = CacheCapabilities(isinstance(cache, AttentionCache),
                                                       isinstance(cache, LatentCache), decoding,
                                                       decoding and isinstance(cache, DeferredViewCache),
                                                       callable(getattr(kind, "values_only", None)))
    return caps


def attention_mask(q_positions: torch.Tensor | None, kv_positions: torch.Tensor | None, *, causal: bool,
                   window: int | None = None, mask=None):
    """The mask of an attention call: by positions when there are any, else by index (bottom-right), AND-ed
    with an extra ``mask``.

    Args:
        q_positions: (B, N) int64 positions of the queries (``-1``: padding, attends nothing), or None.
        kv_positions: (B, S) int64 positions of the keys (``-1``: empty or padding, never attended), or None
            (exactly when ``q_positions`` is).
        causal: a query at position ``p`` sees keys at positions ``<= p``.
        window: keys kept per query, the query included (HF ``sliding_window``); needs ``causal``.
        mask: an extra :mod:`qkv.masks` mask AND-ed with the built one.

    Returns:
        A :mod:`qkv.masks` mask, or None when every pair may interact.

    Example:
        >>> print(attention_mask(None, None, causal=True, window=4))
        sliding_window(3, 0)
    """
    if (q_positions is None) != (kv_positions is None):
        raise ValueError("attention_mask: pass both q_positions and kv_positions, or neither (bottom-right by index)")
    if window is not None and not causal:
        raise ValueError(f"attention_mask: window={window} needs causal=True; for a bidirectional local window pass "
                         f"mask=qkv.masks.sliding_window(left, right)")
    if q_positions is not None:
        built = masks.positions(q_positions, kv_positions, causal=causal, window=window)
    elif causal:
        built = masks.sliding_window(window - 1) if window else masks.causal()
    else:
        built = None
    if built is None or mask is None:
        return built if mask is None else mask
    return built & mask


def plain_decode_step(n_queries: int, *, attention_fn: AttentionFn | None, backend: str, causal: bool = True,
                      mask=None, score_mod=None, sinks=None, dropout_p: float = 0.0) -> bool:
    """Whether an attention call may go to a specialised single-query decode kernel (a cache's in-place
    :meth:`~qkv.cache.DecodingCache.decode`, MLA's latent kernel): one query per row, causal, the default
    operator (not a capture or a distribution hook) on ``backend="auto"``, and nothing else for the kernel to
    honour (no extra mask, score modifier, sinks or dropout).

    Example:
        >>> import qkv
        >>> plain_decode_step(1, attention_fn=qkv.attention, backend="auto")
        True
        >>> plain_decode_step(1, attention_fn=qkv.attention, backend="auto", score_mod=qkv.mods.softcap(30.0))
        False
    """
    return n_queries == 1 and _plain_call(attention_fn=attention_fn, backend=backend, causal=causal, mask=mask,
                                          score_mod=score_mod, sinks=sinks, dropout_p=dropout_p)


def _plain_call(*, attention_fn, backend, causal, mask, score_mod, sinks, dropout_p) -> bool:
    """:func:`plain_decode_step`'s conditions but the query count: what a cache's in-place kernel honours."""
    return (causal and attention_fn is attention and backend == "auto" and mask is None and score_mod is None
            and sinks is None and not dropout_p)


def refuse_scoring_cache(cache: AttentionCache, layer_idx: int, *, owner: str, modifiers: Sequence[object]) -> None:
    """Raise when layer ``layer_idx`` of ``cache`` evicts by the attention it observes (H2O, SnapKV), which it
    computes from ``q`` and the stored keys alone, while the caller's scores carry ``modifiers`` (score
    modifiers, positional modules or words naming them; None entries are skipped): it would rank tokens by
    other scores than the caller attends with. The message is built only when raising.

    Example:
        >>> from qkv.cache import FullSpec, KVCache, H2O
        >>> cache = KVCache([FullSpec(1, 4)], policy=H2O(heavy=2, recent=2))
        >>> try:
        ...     refuse_scoring_cache(cache, 0, owner="demo", modifiers=["softcap(30.0)"])
        ... except ValueError as e:
        ...     print(str(e)[:50])
        demo: layer 0's cache evicts by observed attention
    """
    if cache.scores_attention(layer_idx):
        named = ", ".join(m if isinstance(m, str) else repr(m) for m in modifiers if m is not None)
        raise ValueError(f"{owner}: layer {layer_idx}'s cache evicts by observed attention (H2O/SnapKV), computed "
                         f"from q.k alone, but the scores carry modifiers ({named}); it would rank tokens by "
                         f"other scores than it attends with. Use a policy that does not score (StreamingLLM, a "
                         f"sliding window) or none here")


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer_idx: int = 0,
                     cache: AttentionCache | None = None, positions: torch.Tensor | None = None,
                     rope: RopeFn | None = None, rotate: RotateFn | None = None, causal: bool = True,
                     window: int | None = None, mask=None, step_mask=None, score_mod=None,
                     position_bias: PositionalBias | None = None, scale: float | None = None,
                     sinks: torch.Tensor | None = None, attention_fn: AttentionFn = attention,
                     backend: str = "auto", decode_backend: str | None = None, dropout_p: float = 0.0,
                     return_lse: bool = False, head_gate: torch.Tensor | None = None,
                     queries_to_keep: int = 0, read_only: bool = False,
                     keys_from_values: KeysFromValues | None = None, mask_from_view=None,
                     value_width: int | None = None, owner: str = "cached_attention") -> AttentionHeads:
    """One attention call of a module, over a KV cache or not (the sequence in the module notes).

    Args:
        q: (B, Hq, N, D) queries, not rotated yet (QK norm already applied).
        k: (B, Hkv, N, D) this step's keys, not rotated yet; ``Hq % Hkv == 0``.
        v: (B, Hkv, N, Dv) this step's values.
        layer_idx: the layer's index in ``cache``.
        cache: a :class:`qkv.cache.AttentionCache`, updated in place; None attends over ``k``, ``v`` alone.
        positions: (B, N) int64 absolute positions of the new tokens (``-1``: padding, never attended); required
            with a cache; without one, None means ``0 .. N-1`` by index (bottom-right).
        rope: ``rope(x, positions) -> x`` rotating (B, H, N, D) at (B, N) positions, or None (no RoPE).
        rotate: ``rotate(q, k) -> (q, k)`` rotating both at ``positions`` at once (a module's faster way, e.g.
            one call over adjacent heads of a fused projection); default ``rope`` on each. Needs ``rope`` too,
            for caches that re-position keys.
        causal: causal self attention (positions ``<= p``); False for bidirectional or cross attention.
        window: keys kept per query, the query included (HF ``sliding_window``); needs ``causal``.
        mask: an extra :mod:`qkv.masks` mask AND-ed with the positions mask (padding, documents, a top-k
            selection).
        step_mask: without a cache, the positions mask already built for ``positions``, ``causal`` and
            ``window`` (a decoder shares one across its layers); None builds it here.
        score_mod: static :mod:`qkv.mods` modifier(s) (softcap, a tensor bias).
        position_bias: a :class:`qkv.pos.PositionalBias` (ALiBi, T5 buckets, Shaw) given this call's query and
            key positions; its modifier comes before ``score_mod``.
        scale: score scale (default ``D ** -0.5``).
        sinks: (Hq,) learnable sink logits (GPT-OSS), passed to the operator.
        attention_fn: the module's operator hook, with :func:`qkv.attention`'s signature.
        backend: the operator's backend; ``decode_backend`` (default ``backend``) for single-query steps.
        dropout_p: attention-probability dropout (the module passes 0 in eval mode).
        return_lse: also return the log-sum-exp (B, Hq, N).
        head_gate: (Hq,) multiplier of each head's output, or None.
        queries_to_keep: when ``0 < queries_to_keep < N``, only the last that many queries attend and the
            outputs are theirs, ``(B, Hq, queries_to_keep, Dv)``; every key and value of the step is still stored
            (a decoder's last layer over a prompt, whose other columns' outputs nothing reads). A cache that ranks
            tokens by observed attention (H2O, SnapKV) still sees every query: there all attend, and the last
            are returned. 0 (default): every query.
        read_only: with a cache, attend over ``cache.view(layer_idx)`` without writing ``k`` and ``v`` (unused,
            may be None): a layer that shares an earlier layer's keys and values (:class:`qkv.cache.SharedSpec`,
            whose view is its source's, written earlier in the step); only ``q`` is rotated.
        keys_from_values: K = V: ``f(values, kv_positions) -> rotated keys``. Where the cache stores this layer's
            values only (:meth:`qkv.cache.KVCache.values_only`) it stores ``v`` and attends with the keys ``f``
            derives from every stored value (``k`` is not stored); elsewhere ignored.
        mask_from_view: with a cache, ``f(view) -> mask``: a :mod:`qkv.masks` mask over the cache's slots computed
            from its view after this step is stored (a selection that scores cached tokens, MiniMax-M3's MSA), AND-ed
            with ``mask``; such a step never attends in place.
        value_width: with a cache, attend over the first ``value_width`` channels of the stored values (an
            :class:`qkv.cache.IndexedSpec` layer's value rows carry its indexer key after them).
        owner: the caller's name in error messages.

    Returns:
        :class:`AttentionHeads` ``(out (B, Hq, N, Dv), lse (B, Hq, N) or None)`` (N the kept queries).

    A step over a :class:`qkv.cache.DecodingCache` with a plain call (:func:`plain_decode_step`'s conditions but
    the query count, no ``return_lse``; for one query per row ``decode_backend`` None, ``"auto"`` or ``"sdpa"``)
    first offers the step to ``cache.decode``, which attends in place where the cache has a kernel (paged pools:
    one query per row on a GPU or CPU, a prompt chunk on CPU) and returns None otherwise; a
    :class:`qkv.cache.DeferredViewCache` is asked not to build the view such a kernel does not read
    (``update(..., defer_view=True)``, then ``view`` when the decode declines).

    Example:
        >>> import torch
        >>> q = k = v = torch.randn(2, 4, 6, 8)
        >>> res = cached_attention(q, k, v, window=3, head_gate=torch.tensor([1.0, 1.0, 0.0, 1.0]))
        >>> res.out.shape, bool(res.out[:, 2].eq(0).all())
        (torch.Size([2, 4, 6, 8]), True)
    """
    reading = read_only and cache is not None
    try:  # a decode step calls this once per layer: check cheaply, explain only on failure
        bad = q.dim() != 4 or (not reading and (k.dim() != 4 or v.dim() != 4))
    except AttributeError:
        bad = True
    if bad:
        for name, t in (("q", q),) + ((("k", k), ("v", v)) if not reading else ()):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                seen = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{owner}: {name} must be a (B, H, N, D) tensor, got {seen}")
    B, N = q.shape[0], q.shape[2]
    if positions is not None and (not isinstance(positions, torch.Tensor) or positions.shape != (B, N)):
        seen = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"{owner}: positions must be a (B, N) = ({B}, {N}) int64 tensor of absolute positions "
                         f"(qkv.pos.ids.batch_positions makes one from (N,)), got {seen}")
    if window is not None and (not causal or not isinstance(window, int) or window <= 0):
        raise ValueError(f"{owner}: window must be a positive int (keys per query) with causal=True, got "
                         f"window={window!r}, causal={causal}")
    if position_bias is not None and not isinstance(position_bias, PositionalBias):
        raise TypeError(f"{owner}: position_bias must be a qkv.pos.PositionalBias module, got "
                        f"{type(position_bias).__name__}; static modifiers go in score_mod")
    if rotate is not None and rope is None:
        raise ValueError(f"{owner}: rotate needs rope as well (caches that re-position keys rotate them with rope)")
    if type(queries_to_keep) is not int or queries_to_keep < 0:
        raise ValueError(f"{owner}: queries_to_keep must be an int >= 0 (0: every query), got {queries_to_keep!r}")
    if (mask_from_view is not None or value_width is not None) and cache is None:
        raise ValueError(f"{owner}: mask_from_view and value_width read a cache's view; without a cache pass the "
                         f"mask and the values themselves")
    # the last queries only: after the cache update (every key is stored), unless the cache ranks by attention
    keep = queries_to_keep if 0 < queries_to_keep < N else 0
    sliced_after = keep and cache is not None and cache.scores_attention(layer_idx)
    n_attend = keep if keep and not sliced_after else N
    caps = None
    if cache is None:
        if rope is not None:
            q, k = rotate(q, k) if rotate is not None else (rope(q, positions), rope(k, positions))
        q_pos = kv_pos = positions
    else:
        caps = _CAPABILITIES.get(type(cache)) or cache_capabilities(cache)
        if not caps.attention:
            raise TypeError(f"{owner}: cache must follow qkv.cache.AttentionCache (update, cross_kv, seq_length, "
                            f"...), e.g. qkv.cache.KVCache(specs), got {type(cache).__name__}")
        if positions is None:
            raise ValueError(f"{owner}: a cache needs positions (B, N) of the new tokens")
        if step_mask is not None:
            raise ValueError(f"{owner}: step_mask is the mask of a call without a cache; with a cache the mask "
                             f"follows the positions the cache reports")
        if score_mod is not None or position_bias is not None:
            refuse_scoring_cache(cache, layer_idx, owner=owner, modifiers=(position_bias, score_mod))
    # in place where the cache can: a plain step (one query per row whose single-query backend is the default's,
    # or a prompt chunk on the default backend)
    in_place = (caps is not None and caps.decoding and not return_lse and position_bias is None
                and mask_from_view is None and value_width is None
                and (n_attend > 1 or decode_backend in (None, "auto", "sdpa"))
                and _plain_call(attention_fn=attention_fn, backend=backend, causal=causal, mask=mask,
                                score_mod=score_mod, sinks=sinks, dropout_p=dropout_p))
    if cache is not None:
        defer = {"defer_view": True} if in_place and caps.deferred_view else {}
        if reading:  # a shared layer: its source wrote this step's keys and values; the queries alone turn
            view = cache.view(layer_idx)
            if rope is not None:
                q = rope(q, positions if cache.keeps_absolute_positions(layer_idx) else view.q_positions)
        elif keys_from_values is not None and caps.values_only and cache.values_only(layer_idx):
            if rope is not None:  # K = V stored once: the keys come rotated from keys_from_values
                q = rope(q, positions)
            view = cache.update(layer_idx, None, v, positions=positions, keys_from_values=keys_from_values)
        elif rope is None or cache.keeps_absolute_positions(layer_idx):
            if rope is not None:
                q, k = rotate(q, k) if rotate is not None else (rope(q, positions), rope(k, positions))
            view = cache.update(layer_idx, k, v, positions=positions, rope=None, **defer)
        else:  # the cache rotates keys where it keeps them and says where the queries sit
            view = cache.update(layer_idx, k, v, positions=positions, rope=rope, **defer)
            q = rope(q, view.q_positions)
        k, v, q_pos, kv_pos = view.k, view.v, view.q_positions, view.kv_positions  # (B, Hkv, S, D), ...
        if mask_from_view is not None:
            picked = mask_from_view(view)
            mask = picked if mask is None else mask & picked
        if value_width is not None:
            v = v[..., :value_width]
    q_seen = q  # what a scoring cache observes: every query
    if n_attend < N:
        q, step_mask = q[:, :, -n_attend:], None  # the step's mask covers every query: built again below
        q_pos = None if q_pos is None else q_pos[:, -n_attend:]
    out = lse = None
    if in_place:
        out = cache.decode(layer_idx, q, scale=q.shape[-1] ** -0.5 if scale is None else scale, window=window)
        if out is None and k is None:  # declined after a deferred update: build the view now
            view = cache.view(layer_idx)
            k, v = view.k, view.v
    if out is None:
        if step_mask is not None:
            built = step_mask if mask is None else step_mask & mask
        else:
            built = attention_mask(q_pos, kv_pos, causal=causal, window=window, mask=mask)
        kw = {"mask": built, "scale": scale,
              "backend": decode_backend if n_attend == 1 and decode_backend is not None else backend}
        if return_lse:
            kw["return_lse"] = True
        if dropout_p:
            kw["dropout_p"] = dropout_p
        if sinks is not None:
            kw["sinks"] = sinks
        if position_bias is not None:
            res = position_bias.attend(q, k, v, q_positions=q_pos, kv_positions=kv_pos, score_mod=score_mod,
                                       attention_fn=attention_fn, **kw)
        else:
            res = attention_fn(q, k, v, score_mod=score_mod, **kw)
        out, lse = (res.out, res.lse) if return_lse else (res, None)
    if sliced_after:
        out, lse = out[:, :, -keep:], None if lse is None else lse[:, :, -keep:]
    if head_gate is not None:
        out = apply_head_gate(out, head_gate)
    if cache is not None:
        cache.observe(layer_idx, q_seen, scale=scale)  # score-ranked eviction (H2O, SnapKV): the rotated queries
    return AttentionHeads(out, lse)
