"""The one small interface between attention modules and KV caches.

A module with a cache does, per layer and step::

    view = cache.update(layer_idx, k_new, v_new, positions=pos, rope=rope_fn)
    q = rope_fn(q, view.q_positions) if rope_fn else q
    mask = masks.positions(view.q_positions, view.kv_positions, causal=True, window=W)  # & any extra mask
    out = qkv.attention(q, view.k, view.v, mask=mask, ...)

(:func:`qkv.nn.cached_attention` is that sequence, written once for every module.)

- ``k_new`` (B, Hkv, Nnew, Dqk), ``v_new`` (B, Hkv, Nnew, Dv) are this step's keys/values.
- ``positions`` (B, Nnew) int64 are the absolute positions of the new tokens (``-1`` for padding tokens,
  which are stored but never attended to).
- ``rope`` is ``None`` when keys need no rotation or are already rotated; otherwise a callable
  ``rope(x, positions) -> x`` and ``k_new`` is *un-rotated*: the cache rotates keys at the positions it
  chooses (their absolute position for most storages; their in-cache position for StreamingLLM sinks)
  and reports in ``q_positions`` the positions the queries must be rotated to and masked with.
- The returned view lists every cached key (old and new) with its position in ``kv_positions``
  (B, Nk); empty or padding slots carry ``-1``. Order does not matter (ring buffers, evicted caches),
  because masking is by position.

Cross attention computes encoder K/V once: ``cache.cross_kv(layer_idx, compute)`` returns the stored
pair, calling ``compute()`` only the first time.

Besides ``update`` and ``cross_kv`` a cache declares (``qkv.cache.KVCache`` implements all of them; a cache
that subclasses :class:`AttentionCache` inherits the no-op defaults):

- ``cache.seq_length``: slots written per row so far; a model continues positions from there.
- ``cache.keeps_absolute_positions(layer_idx)``: True when the layer keeps keys at their absolute positions
  (full and sliding-window layers), so a module may rotate keys with the queries before ``update`` and
  pass ``rope=None``; False when the cache re-positions keys (StreamingLLM sinks), which then get
  un-rotated keys and ``rope``.
- ``cache.observe(layer_idx, q, scale=None)``: after attention, show the layer's (rotated) queries of
  this step, ``q`` (B, Hq, Nnew, Dqk), to an eviction policy (H2O accumulates attention, SnapKV votes
  with its observation window). It never changes the view just returned; evictions happen on the
  layer's next ``update``. Without a policy it does nothing. ``scale`` defaults to ``Dqk ** -0.5``.
- ``cache.scores_attention(layer_idx)``: True when that layer's policy ranks tokens by the attention
  ``observe`` computes from ``q`` and the stored keys (no score modifiers). Default: False.
- ``cache.prepare(input_ids, positions)``: called by ``generate`` before each forward pass with the
  step's token ids, so paged storage can allocate blocks up front and index prefixes. Default: nothing.
- ``cache.prefix_caching``: True when ``match_prefix(input_ids, positions, salt=)`` can reuse cached
  prompt prefixes (paged storage built with ``prefix_caching=True``). Default: False.

MLA layers call ``cache.update_latent(layer_idx, c_kv, k_rope, positions=pos, rope=rope_fn) -> LatentView``
(:class:`LatentCache`): ``c_kv`` (B, Nnew, kv_lora_rank) and ``k_rope`` (B, Nnew, qk_rope_head_dim,
un-rotated when ``rope`` is given; the cache calls ``rope(k_rope[:, None], positions)``) are stored once per
token for all heads; the view lists every cached latent with its position.

Capabilities beyond the base protocol are declared apart, each a runtime-checkable protocol that callers test
for (never the concrete :class:`qkv.cache.KVCache` class, which has them all):

- :class:`DecodingCache`: ``cache.decode(layer_idx, q, scale=, window=)`` attends the step just stored, in
  place (paged pools: one query per row on a GPU or CPU, a prompt chunk on CPU), or returns None
  (:func:`qkv.nn.cached_attention` then attends over the view).
- :class:`PrefixMatchingCache`: ``cache.match_prefix(input_ids, positions, salt=)`` reuses cached prompt
  prefixes (``generate`` calls it when ``cache.prefix_caching`` is True).
- :class:`CroppableCache` (``crop``), :class:`ForkableCache` (``fork``), :class:`ResettableCache` (``reset``):
  roll back, copy rows, forget everything (speculative decoding, n samples, reuse; ``verify_cache`` checks them).
- :class:`RowSlots` (``open_rows``, ``admit_row``, ``release_row``, ``step_rows``): recycle one row while the
  others keep their state, and step over some rows only (continuous batching, :class:`qkv.models.Engine`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from .specs import FullSpec, LayerSpec
from .storage import Store

__all__ = ["CacheView", "LatentView", "AttentionCache", "LatentCache", "DecodingCache", "DeferredViewCache",
           "PrefixMatchingCache",
           "CroppableCache", "ForkableCache", "ResettableCache", "DecoderModel", "HasCacheSpecs", "RopeFn",
           "KeysFromValues",
           "CachePolicy", "Quantizer", "RowSlots"]

RopeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``keys_from_values(values (B, Hkv, S, D), kv_positions (B, S)) -> keys (B, Hkv, S, D)``, rotated: how a K = V
#: layer's keys follow from the values a ``values_only`` cache layer stores (:meth:`qkv.cache.KVCache.update`).
KeysFromValues = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class CacheView(NamedTuple):
    """What one layer attends over after an update."""

    k: torch.Tensor  # (B, Hkv, Nk, Dqk), rotated if RoPE applies
    v: torch.Tensor  # (B, Hkv, Nk, Dv)
    kv_positions: torch.Tensor  # (B, Nk) int64; -1 = empty or padding slot
    q_positions: torch.Tensor  # (B, Nnew) int64, positions for the new queries (RoPE and mask)


class LatentView(NamedTuple):
    """What one MLA layer attends over after ``update_latent``."""

    c_kv: torch.Tensor  # (B, Nk, kv_lora_rank)
    k_rope: torch.Tensor  # (B, Nk, qk_rope_head_dim), rotated if RoPE applies
    kv_positions: torch.Tensor  # (B, Nk) int64; -1 = empty or padding slot
    q_positions: torch.Tensor  # (B, Nnew) int64


@runtime_checkable
class AttentionCache(Protocol):
    """What attention modules and ``generate`` need from a KV cache (see the module notes)."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, *, positions: torch.Tensor,
               rope: RopeFn | None = None) -> CacheView: ...

    def cross_kv(self, layer_idx: int, compute: Callable[[], tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @property
    def seq_length(self) -> int: ...

    def keeps_absolute_positions(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` keeps keys at their absolute positions (default: True)."""
        return True

    def observe(self, layer_idx: int, q: torch.Tensor, *, scale: float | None = None) -> None:
        """Show this step's rotated queries to an eviction policy (default: nothing)."""
        return None

    def scores_attention(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` evicts by the attention its queries pay (H2O, SnapKV), computed from
        ``q`` and the stored keys alone (default: False). A module whose scores carry modifiers (ALiBi,
        softcap, relative biases) must refuse such a layer rather than let it rank tokens by other scores."""
        return False

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Announce the next step's tokens before the forward pass (default: nothing)."""
        return None

    @property
    def prefix_caching(self) -> bool:
        """Whether ``match_prefix`` can reuse cached prompt prefixes (default: False)."""
        return False


@runtime_checkable
class LatentCache(Protocol):
    """What an MLA layer (:class:`qkv.nn.LatentAttention`) needs from a cache."""

    def update_latent(self, layer_idx: int, c_kv: torch.Tensor, k_rope: torch.Tensor, *, positions: torch.Tensor,
                      rope: RopeFn | None = None) -> LatentView: ...


@runtime_checkable
class DecodingCache(Protocol):
    """A cache that can attend a step in place, over the keys it just stored."""

    def decode(self, layer_idx: int, q: torch.Tensor, *, scale: float, window: int | None = None
               ) -> torch.Tensor | None:
        """Causal attention of ``q`` (B, Hq, n, D), the queries of the last ``n <= N`` columns of the step just
        stored, rotated like its keys, over layer ``layer_idx``'s view of that step (``window`` as in
        ``masks.positions(..., window=W)``): (B, Hq, n, Dv), or None where the cache has no kernel for that layer
        or step (a single-query kernel declines n > 1) and the caller attends over the view."""
        ...


@runtime_checkable
class DeferredViewCache(Protocol):
    """A :class:`DecodingCache` whose ``update(..., defer_view=True)`` may skip building a layer's view (returning
    ``k`` and ``v`` None) for a caller about to ``decode`` in place; ``view`` builds it when the decode declines."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, *, positions: torch.Tensor,
               rope: RopeFn | None = None, defer_view: bool = False) -> CacheView: ...

    def view(self, layer_idx: int) -> CacheView:
        """The view of layer ``layer_idx``'s last update, built now if that update deferred it."""
        ...


@runtime_checkable
class PrefixMatchingCache(Protocol):
    """A cache that can reuse cached prompt prefixes (its ``prefix_caching`` says whether it does now)."""

    def match_prefix(self, input_ids: torch.Tensor, positions: torch.Tensor, *, salt=None) -> torch.Tensor:
        """On a fresh cache: attach each row's longest reusable prompt prefix; the reused tokens per row (B,)
        int64. ``input_ids``, ``positions`` (B, N); ``salt`` (bytes or str, one or one per row) isolates tenants."""
        ...


@runtime_checkable
class CroppableCache(Protocol):
    """A cache that can roll back its last tokens (rejected speculative tokens)."""

    def crop(self, length: int) -> None:
        """Keep the first ``length`` written slots (negative: drop the last ``-length``)."""
        ...


@runtime_checkable
class ForkableCache(Protocol):
    """A cache that can copy its rows (``n`` samples of one prompt)."""

    def fork(self, n: int) -> None:
        """Give every row ``n`` copies (rows ``b*n .. b*n+n-1``)."""
        ...


@runtime_checkable
class ResettableCache(Protocol):
    """A cache that can forget every row and be used for a new request."""

    def reset(self) -> None:
        """Forget every row (paged storage keeps its pools and prefix index)."""
        ...


@runtime_checkable
class DecoderModel(Protocol):
    """What ``generate`` and ``verify_cache`` need from a decoder-only language model.

    ``forward(input_ids, positions=..., cache=...)``:
        input_ids (B, N) int64; positions (B, N) int64 absolute positions (``-1`` marks padding tokens,
        which are never attended to); cache an ``AttentionCache`` (or None for full recomputation, in
        which case the model masks with ``masks.positions(positions, positions, causal=True, window=W)``).
        Returns logits (B, N, vocab) float, or an output with ``.logits`` (:class:`qkv.nn.DecoderOutput`).
        A model whose ``forward`` takes ``logits_to_keep`` gets ``logits_to_keep=1`` for prefills.

    ``cache_specs()``: one layer spec per layer (``qkv.cache`` specs), from which caches are built.
    """

    def forward(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                cache: AttentionCache | None = None): ...

    def cache_specs(self) -> list: ...


def decoder_model_problem(model) -> str | None:
    """Why ``model`` cannot be driven as a :class:`DecoderModel` (None when it can): no ``forward``/``cache_specs``,
    or a ``forward`` that takes no ``positions`` or ``cache`` keyword (an encoder-decoder such as T5, which
    decodes through its own ``generate``). A ``forward(**kwargs)`` is taken at its word."""
    import inspect

    if not isinstance(model, DecoderModel):
        return "it has no forward(input_ids, positions=, cache=) and cache_specs()"
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a builtin or C forward: nothing to read
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    missing = [name for name in ("positions", "cache") if name not in params]
    if missing:
        return (f"its forward takes no {' or '.join(missing)} keyword (an encoder-decoder decodes with its own "
                f"model.generate(...))")
    return None


@runtime_checkable
class HasCacheSpecs(Protocol):
    """Anything that lists its layers' cache specs: a model (:class:`qkv.nn.DecoderLM`; a config's specs are
    :func:`qkv.cache.describe.cache_specs_of`)."""

    def cache_specs(self) -> list: ...


@runtime_checkable
class CachePolicy(Protocol):
    """An eviction policy of :class:`qkv.cache.KVCache` (StreamingLLM, H2O, SnapKV, or your own).

    - ``apply_spec(spec)``: the spec a layer gets under the policy (StreamingLLM turns full layers into
      sink layers); return ``spec`` itself for layers it leaves alone.
    - ``store_for(spec, layer=)``: the store that keeps such a layer's tokens (a
      :class:`qkv.cache.storage.Store` subclass, which may override ``observe`` to see attention), or None
      for the storage's own.
    - ``token_cap(spec, new_tokens)``: the most tokens per row the layer holds once ``new_tokens`` tokens
      were generated after the prompt (None: the policy does not bound it). Policies evict on a layer's
      next update, so right after the prefill (``new_tokens = 0``) every prompt token is still held;
      :func:`qkv.cache.plan_memory` applies the cap from the first generated token on.
    """

    def apply_spec(self, spec: LayerSpec) -> LayerSpec: ...

    def store_for(self, spec: LayerSpec, *, layer: str) -> Store | None: ...

    def token_cap(self, spec: LayerSpec, new_tokens: int = 0) -> int | None: ...


@runtime_checkable
class Quantizer(Protocol):
    """A KV quantizer of :class:`qkv.cache.KVCache` (KIVI, Int8, or your own), for full-attention layers.

    - ``store_for(spec, layer=)``: the store holding a layer's quantized tokens.
    - ``bytes_for(spec, tokens, dtype)``: bytes that store holds for one row of ``tokens`` tokens (codes,
      scales, zero-points and the full-precision residual in ``dtype``), as its ``used_bytes`` reports them.
    - ``allocated_for(spec, tokens, dtype)``: bytes it allocates for that row (spare capacity included).
    """

    def store_for(self, spec: FullSpec, *, layer: str) -> Store: ...

    def bytes_for(self, spec: FullSpec, tokens: int, dtype: torch.dtype | str) -> float: ...

    def allocated_for(self, spec: FullSpec, tokens: int, dtype: torch.dtype | str) -> float: ...


@runtime_checkable
class RowSlots(Protocol):
    """A cache whose rows are recycled one at a time while the others keep their state (continuous batching,
    :class:`qkv.models.Engine`). :class:`qkv.cache.KVCache` declares it and implements it over
    ``Paged(...)`` storage (block tables per row); other storages refuse, naming themselves.

    - ``open_rows(n)``: give a fresh cache ``n`` empty rows; every step then feeds ``(n, N)`` tokens, an
      empty or idle row's as padding (position ``-1``, never stored).
    - ``admit_row(b, prompt_ids=None, *, salt=None, max_new_tokens=None, chunk=None) -> int``: start a new
      sequence in empty row ``b`` at position 0. With prefix caching and ``prompt_ids`` (a list of ints) the row
      attaches the cached blocks of its longest indexed prefix and the call returns their tokens; the caller feeds
      the prompt from there on. With ``max_new_tokens`` the row is promised the blocks the whole request can hold
      until it is released (refused with :class:`qkv.cache.CacheFull` when ``can_admit`` says no).
    - ``can_admit(prompt_tokens, max_new_tokens, *, chunk=None) -> bool``: whether such a request fits next to the
      rows admitted with a promise (a scheduler asks before it admits, as vLLM's asks its KV-cache manager).
    - ``release_row(b)``: forget row ``b``: its blocks return to the pool at once and its position record is
      reset, so the row can start again at position 0.

    - ``step_rows(rows)``: until the next call, steps feed only ``rows`` (increasing indices) as
      ``(len(rows), N)`` inputs, the other rows keeping their state; None: every row. Rows in different phases
      (prompt chunks, single decode tokens) so run in forward passes of their own width, without padding rows.

    All of them are called between steps, and a refused call changes nothing.
    """

    def open_rows(self, n: int) -> None: ...

    def admit_row(self, b: int, prompt_ids=None, *, salt=None, max_new_tokens=None, chunk=None) -> int: ...

    def can_admit(self, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> bool: ...

    def release_row(self, b: int) -> None: ...

    def step_rows(self, rows) -> None: ...
