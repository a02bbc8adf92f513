"""``KVCache``: the model-level cache. It builds one store per layer from the model's layer specs, a
storage choice, an optional quantizer and an optional eviction policy, and implements the protocols
of :mod:`qkv.cache.protocol`: the base one (``update``, ``cross_kv``, ``observe``, ...), latents
(``update_latent``) and every capability (``decode``, ``match_prefix``, ``crop``, ``fork``, ``reset``).

Shape legend: B batch rows, Hkv key/value heads, Hq query heads, N new tokens, S cached slots.

Everything a layer keeps follows from its spec (:mod:`qkv.cache.specs`), so hybrid models such as
Gemma 3 (five sliding-window layers per global layer) get bounded local layers without a per-model
cache class. Speculative decoding rolls back with ``crop``; beam search and n-sample decoding reorder
or fork rows with ``reorder``/``fork`` (copy-on-write blocks under paged storage).

Example:
    >>> import torch
    >>> from qkv.cache import KVCache, FullSpec, SlidingWindowSpec
    >>> cache = KVCache([FullSpec(2, 16), SlidingWindowSpec(4, 2, 16)])
    >>> k = v = torch.randn(1, 2, 6, 16)
    >>> pos = torch.arange(6).view(1, 6)
    >>> view = cache.update(1, k, v, positions=pos)
    >>> view.k.shape[2], cache.layer_tokens(1)   # the step sees all 6; the layer keeps its window
    (6, 4)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ..pos.ids import batch_positions
from .order import PositionOrder
from .paged import BlockManager, Paged, PagedStore, PoolStats
from .protocol import CachePolicy, CacheView, HasCacheSpecs, KeysFromValues, LatentView, Quantizer, RopeFn
from .recurrent import RecurrentStore
from .rows import DenseRows, RowManager
from .specs import CrossSpec, FullSpec, LatentSpec, LayerSpec, RecurrentSpec, SharedSpec, SinkSpec, SlidingWindowSpec
from .storage import Dynamic, DynamicStore, RingStore, RopeStore, Static, StaticStore, Store

__all__ = ["KVCache", "CacheMemory", "LayerMemory"]


class LayerMemory(NamedTuple):
    layer: int
    kind: str
    tokens: int  # slots held per row
    allocated_bytes: int
    used_bytes: int  # bytes holding real tokens


class CacheMemory(NamedTuple):
    """What the cache holds now. ``allocated_bytes`` counts every tensor the cache owns (for paged
    storage: the blocks in use, not the whole pool, see ``pool_bytes``)."""

    allocated_bytes: int
    used_bytes: int
    pool_bytes: int
    layers: tuple[LayerMemory, ...]

    @property
    def wasted_fraction(self) -> float:
        return 1.0 - self.used_bytes / self.allocated_bytes if self.allocated_bytes else 0.0


class _Layer:
    __slots__ = ("spec", "store", "name", "last_view")

    def __init__(self, spec: LayerSpec, store: Store | None, name: str) -> None:
        self.spec, self.store, self.name = spec, store, name
        self.last_view: CacheView | None = None


class _SelectedRowsOrder:
    """The position record of every row of a paged cache whose steps feed selected rows (``step_rows``): a step's
    positions are widened to every row (-1 for the others) before the record sees them."""

    def __init__(self, inner: PositionOrder, manager: RowManager) -> None:
        self.inner, self.manager = inner, manager
        self._last: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def _wide(self, pos: torch.Tensor) -> torch.Tensor:
        if self.manager.selected is None:
            return pos
        if self._last[0] is not pos:  # every layer of a step passes the same positions: widen them once
            self._last = (pos, self.manager.widen(pos, None)[0])
        return self._last[1]

    def check(self, given, pos: torch.Tensor, **kw) -> None:
        wide = self._wide(pos)
        self.inner.check(given if wide is pos else wide, wide, **kw)

    def commit(self, given, pos: torch.Tensor, **kw) -> None:
        wide = self._wide(pos)
        self.inner.commit(given if wide is pos else wide, wide, **kw)

    def forget(self) -> None:
        self._last = (None, None)
        self.inner.forget()

    def forget_rows(self, rows: list[int]) -> None:
        self.inner.forget_rows(rows)


def _as_specs(specs) -> list[LayerSpec]:
    if isinstance(specs, HasCacheSpecs):
        specs = specs.cache_specs()
    if not isinstance(specs, Sequence) or isinstance(specs, (str, bytes)):
        raise TypeError(f"KVCache(specs): expected a list of layer specs or a model with cache_specs(), got "
                        f"{type(specs).__name__}")
    specs = list(specs)
    for i, s in enumerate(specs):
        if not isinstance(s, LayerSpec):
            raise TypeError(f"KVCache(specs): entry {i} is {type(s).__name__}, not a qkv.cache layer spec "
                            f"(FullSpec, SlidingWindowSpec, SinkSpec, LatentSpec, CrossSpec, RecurrentSpec, "
                            f"SharedSpec)")
    for i, s in enumerate(specs):
        if isinstance(s, SharedSpec):
            _check_shared(specs, i, s)
    return specs


def _check_shared(specs: list[LayerSpec], i: int, spec: SharedSpec) -> None:
    """A shared layer reads an earlier layer that stores keys and values of the shape it reads."""
    src = spec.source
    if src >= i:
        raise ValueError(f"KVCache(specs): layer {i} is a SharedSpec reading layer {src}, which is not an earlier "
                         f"layer; a shared layer reads the cache of a layer before it (source < {i})")
    if not spec.matches(specs[src]):
        raise ValueError(f"KVCache(specs): layer {i} (SharedSpec: window={spec.window}, n_kv_heads="
                         f"{spec.n_kv_heads}, head_dim={spec.head_dim}) reads layer {src}, a {specs[src]!r}; the "
                         f"source must be a full or sliding layer with the same window, KV heads and head width "
                         f"(a layer of the same type)")


class KVCache:
    """A KV cache for a whole model, built from its layer specs.

    Args:
        specs: one spec per layer, or a model with ``cache_specs()``.
        storage: ``Dynamic()`` (default), ``Static(max_len)`` or ``Paged(block_size, num_blocks, ...)``.
        quant: ``KIVI(...)`` or ``Int8()`` to store full-attention layers quantized (dynamic storage).
        policy: ``StreamingLLM``, ``H2O`` or ``SnapKV`` to evict tokens from full-attention layers.
        rollback: extra tokens bounded (sliding-window) layers keep so ``crop`` can undo that many
            tokens (speculative decoding); 0 by default.
        dtype: storage dtype for keys and values; default: the dtype of the first write.

    The batch, device and dtype are fixed by the first write. Protocol methods (``update`` etc.) are
    described in :mod:`qkv.cache.protocol`.
    """

    def __init__(self, specs, *, storage=None, quant=None, policy=None, rollback: int = 0,
                 dtype: torch.dtype | None = None) -> None:
        specs = _as_specs(specs)
        if not isinstance(rollback, int) or rollback < 0:
            raise ValueError(f"KVCache(rollback): expected an int >= 0, got {rollback!r}")
        storage = Dynamic() if storage is None else storage
        if not isinstance(storage, (Dynamic, Static, Paged)):
            raise TypeError(f"KVCache(storage): expected Dynamic(), Static(max_len) or Paged(...), got {storage!r}")
        if quant is not None and policy is not None:
            raise ValueError(f"KVCache: quant={quant!r} and policy={policy!r} together are not supported; a layer is "
                             f"either quantized or evicting. Pass one of them")
        if policy is not None and not isinstance(policy, CachePolicy):
            raise TypeError(f"KVCache(policy): {type(policy).__name__} does not follow qkv.cache.CachePolicy (it needs "
                            f"apply_spec, store_for and token_cap); got {policy!r}")
        if quant is not None and not isinstance(quant, Quantizer):
            raise TypeError(f"KVCache(quant): {type(quant).__name__} does not follow qkv.cache.Quantizer (it needs "
                            f"store_for, bytes_for and allocated_for); got {quant!r}")
        if (quant is not None or policy is not None) and not isinstance(storage, Dynamic):
            raise ValueError(f"KVCache: quant={quant!r} / policy={policy!r} need storage=Dynamic(), got "
                             f"{storage.describe()}; quantized and evicting layers manage their own buffers")
        if policy is not None and any(isinstance(s, SharedSpec) for s in specs):
            raise ValueError(f"KVCache: policy={policy!r} with cross-layer KV sharing (SharedSpec layers) is not "
                             f"supported: an eviction policy would rank the source's tokens by its own queries "
                             f"only. Build the cache without a policy")
        indexed = [i for i, s in enumerate(specs) if getattr(s, "index_tail", 0)]  # IndexedSpec layers
        if indexed and (policy is not None or quant is not None):
            raise ValueError(f"KVCache: layers {indexed} keep an indexer key in their value rows (IndexedSpec, "
                             f"MiniMax-M3's MSA), which {'policy' if policy is not None else 'quant'}="
                             f"{policy or quant!r} would drop or quantize with the values; build the cache without it")
        values_only = [i for i, s in enumerate(specs) if getattr(s, "values_only", False)]
        if values_only and (policy is not None or quant is not None):
            raise ValueError(f"KVCache: layers {values_only} store their values only (K = V, keys derived from them), "
                             f"which {'policy' if policy is not None else 'quant'}={policy or quant!r} does not "
                             f"support (it keeps keys of its own); build the specs with keys stored: "
                             f"model.cache_specs(values_only=False)")
        if policy is not None:
            specs = [policy.apply_spec(s) for s in specs]
        self.specs: list[LayerSpec] = specs
        self.storage, self.quant, self.policy, self.rollback, self.dtype = storage, quant, policy, rollback, dtype
        self._manager: RowManager = DenseRows(storage.describe())
        self._device: torch.device | None = None
        self._row_slots = False  # open_rows: recurrent states kept per row slot
        self._build()

    # construction
    def _build(self) -> None:
        if isinstance(self.storage, Paged):
            windows = [_window(s) for s in self.specs if isinstance(s, (FullSpec, SlidingWindowSpec, LatentSpec))]
            self._manager = BlockManager(self.storage, windows, rollback=self.rollback)
        else:
            self._manager = DenseRows(self.storage.describe())
        self._layers = [_Layer(s, self._make_store(i, s), f"layer {i} ({type(s).__name__})")
                        for i, s in enumerate(self.specs)]
        self._cross: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._order = PositionOrder()

    def _make_store(self, i: int, spec: LayerSpec) -> Store | None:
        name = f"layer {i}"
        if isinstance(spec, (CrossSpec, SharedSpec)):  # cross: computed once; shared: reads its source's store
            return None
        if isinstance(spec, RecurrentSpec):
            return RecurrentStore(spec, layer=f"layer {i} (RecurrentSpec)")
        if spec.kind == "compressed":
            raise ValueError(f"KVCache: {name} is a CompressedSpec (DeepSeek-V4 CSA/HCA), whose window, entry, "
                             "indexer-key and carry pools KVCache does not keep (nor page, nor share between "
                             "prompts, so qkv.models.Engine cannot serve the model); decode with "
                             "qkv.cache.CompressedCache(model.cache_specs()), e.g. qkv.models.generate(model, ids, "
                             "cache=CompressedCache(model.cache_specs()))")
        if self.policy is not None:
            store = self.policy.store_for(spec, layer=name)
            if store is not None:
                return store
        if isinstance(spec, SinkSpec):
            raise ValueError(f"KVCache: {name} is a SinkSpec; build the cache with the policy that keeps it "
                             f"(policy=StreamingLLM(...)) and storage=Dynamic()")
        if self.quant is not None and type(spec) is FullSpec:
            return self.quant.store_for(spec, layer=name)
        window = _window(spec)
        keep = None if window is None else window + self.rollback
        if isinstance(self.storage, Paged):
            return PagedStore(self._manager, window, layer=name)
        if isinstance(self.storage, Static):
            if keep is not None and keep <= self.storage.max_len:
                return RingStore(keep, window=window, layer=name)
            return StaticStore(self.storage.max_len, layer=name)
        return DynamicStore(keep=keep, window=window)

    # protocol
    def update(self, layer_idx: int, k: torch.Tensor | None, v: torch.Tensor, *, positions: torch.Tensor,
               rope: RopeFn | None = None, defer_view: bool = False,
               keys_from_values: KeysFromValues | None = None) -> CacheView:
        """Store this step's keys/values for a layer and return what its queries attend over.

        Args:
            layer_idx: the layer, ``0 <= layer_idx < len(specs)``.
            k: (B, Hkv, N, Dqk) new keys, un-rotated when ``rope`` is given.
            v: (B, Hkv, N, Dv) new values.
            positions: (B, N) int64 absolute positions, ``-1`` for padding tokens.
            rope: ``rope(x, positions) -> x`` (x: (B, H, N, D), positions: (B, N)) or ``None``.
            defer_view: a caller about to :meth:`decode` in place: layers whose store reads its own tensors there
                (paged pools) skip gathering their view (the returned ``k`` and ``v`` are None; :meth:`view`
                gathers it if the decode declines). Other layers return their view as always.
            keys_from_values: on a ``values_only`` layer (K = V), ``f(values (B, Hkv, S, D), kv_positions (B, S))
                -> keys (B, Hkv, S, D)``, rotated: only ``v`` is stored (``k`` is ignored and may be None) and the
                view's keys are ``f`` of the stored values. Required there, ignored elsewhere.

        Returns:
            :class:`CacheView` ``(k, v, kv_positions, q_positions)``.
        """
        layer = self._layer(layer_idx, (FullSpec, SlidingWindowSpec, SinkSpec), "update")
        spec = layer.spec
        if spec.values_only:
            return self._update_values(layer, layer_idx, v, positions, keys_from_values)
        pos = self._check_step(layer, k, v, positions, spec.n_kv_heads, spec.head_dim, spec.dv)
        self._order.check(positions, pos, layer=layer_idx)
        k, v = self._cast(k, v)
        if isinstance(layer.store, RopeStore):
            k_all, v_all, kv_pos, q_pos = layer.store.write_rope(k, v, pos, rope)
        else:
            if rope is not None:
                k = rope(k, pos.clamp_min(0))
            store = layer.store
            k_all, v_all, kv_pos = store.write_deferred(k, v, pos) if defer_view else store.write(k, v, pos)
            q_pos = pos
        self._order.commit(positions, pos, layer=layer_idx)
        view = CacheView(k_all, v_all, kv_pos, q_pos)
        layer.last_view = view
        return view

    def _update_values(self, layer: _Layer, layer_idx: int, v, positions, keys_from_values) -> CacheView:
        """:meth:`update` of a ``values_only`` layer: the values stored (beside a zero-width tensor in the keys'
        place, so every store keeps them as it keeps keys), the keys derived from all of them."""
        if not callable(keys_from_values):
            raise ValueError(f"update: {layer.name} stores values only (K = V); pass keys_from_values=f, f(values, "
                             f"kv_positions) -> rotated keys, got {keys_from_values!r}")
        spec = layer.spec
        pos = self._check_step(layer, v, v, positions, spec.n_kv_heads, spec.dv, spec.dv)
        self._order.check(positions, pos, layer=layer_idx)
        self._check_derived(keys_from_values, v[:, :, :0], pos[:, :0])  # before anything is written
        v, _ = self._cast(v, v)
        v_all, _, kv_pos = layer.store.write(v, v[..., :0], pos)
        k_all = self._check_derived(keys_from_values, v_all, kv_pos)
        self._order.commit(positions, pos, layer=layer_idx)
        view = layer.last_view = CacheView(k_all, v_all, kv_pos, pos)
        return view

    @staticmethod
    def _check_derived(keys_from_values, v: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        k = keys_from_values(v, kv_pos)
        if not isinstance(k, torch.Tensor) or k.shape != v.shape:
            raise ValueError(f"update: keys_from_values must return keys shaped like the values {tuple(v.shape)}, "
                             f"got {tuple(getattr(k, 'shape', ())) or type(k).__name__}")
        return k

    def values_only(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` (or the layer a shared one reads) stores values only (K = V): its
        :meth:`update` needs ``keys_from_values``."""
        return bool(getattr(self._layer(self._source(layer_idx, "values_only"), None, "values_only").spec,
                            "values_only", False))

    def view(self, layer_idx: int) -> CacheView:
        """The view of layer ``layer_idx``'s last :meth:`update`, gathered now if that update deferred it (a
        :class:`~qkv.cache.SharedSpec` layer: its source's view)."""
        layer_idx = self._source(layer_idx, "view")
        layer = self._layer(layer_idx, None, "view")
        view = layer.last_view
        if view is None:
            raise ValueError(f"view: layer {layer_idx} has not been updated since the cache was built or changed; "
                             f"call update first")
        if view.k is None:
            view = layer.last_view = view._replace(**dict(zip(("k", "v"), layer.store.gather())))
        return view

    def decode(self, layer_idx: int, q: torch.Tensor, *, scale: float, window: int | None = None
               ) -> torch.Tensor | None:
        """Causal attention of the step just stored for ``layer_idx`` over what its store holds, read in place where
        the store can (paged pools: :func:`qkv.attention` on block-pool operands, served by the ``paged`` backend,
        whose choice ``qkv.explain`` names). None otherwise: the caller attends over the view ``update`` returned
        (or :meth:`view`, after a deferred update).

        Args:
            q: (B, Hq, n, D) queries, rotated like the stored keys: those of the step's last ``n <= N`` columns
                (a decoder's last layer keeps only the queries whose outputs it needs).
            window: as in ``masks.positions(..., window=W)``.
        """
        layer = self._layer(self._source(layer_idx, "decode"), None, "decode")
        if (not isinstance(layer.spec, (FullSpec, SlidingWindowSpec)) or layer.last_view is None
                or layer.spec.values_only or getattr(layer.spec, "index_tail", 0)):
            return None  # latent layers attend over their view, values-only ones over the keys derived there, indexed
            # ones over the values without the indexer key's tail
        q_positions = layer.last_view.q_positions  # (B, N)
        n = q.shape[2] if q.dim() == 4 else -1
        if not 1 <= n <= q_positions.shape[1] or q.shape[0] != q_positions.shape[0]:
            raise ValueError(f"decode: q must be (B, Hq, n, D) with B = {q_positions.shape[0]} and 1 <= n <= "
                             f"{q_positions.shape[1]} (the queries of the step's last n columns), got "
                             f"{tuple(q.shape)}")
        return layer.store.decode(q, q_positions[:, q_positions.shape[1] - n:], scale=scale, window=window)

    def update_latent(self, layer_idx: int, c_kv: torch.Tensor, k_rope: torch.Tensor, *,
                      positions: torch.Tensor, rope: RopeFn | None = None) -> LatentView:
        """Store an MLA layer's latent and RoPE key for this step (see :class:`qkv.cache.LatentSpec`).

        Args:
            c_kv: (B, N, kv_lora_rank) compressed latent.
            k_rope: (B, N, qk_rope_head_dim) decoupled RoPE key shared by all heads, un-rotated when
                ``rope`` is given (it is called as ``rope(k_rope[:, None], positions)``).
            positions: (B, N) int64, ``-1`` for padding tokens.

        Returns:
            :class:`LatentView` ``(c_kv (B, S, r), k_rope (B, S, dr), kv_positions, q_positions)``.
        """
        layer = self._layer(layer_idx, (LatentSpec,), "update_latent")
        spec = layer.spec
        for name, t, width in (("c_kv", c_kv, spec.kv_lora_rank), ("k_rope", k_rope, spec.tail_width)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[-1] != width:
                raise ValueError(f"update_latent: {name} must be (B, N, {width}) for {layer.name}, got "
                                 f"{tuple(getattr(t, 'shape', ()))}")
        if c_kv.shape[:2] != k_rope.shape[:2]:
            raise ValueError(f"update_latent: c_kv {tuple(c_kv.shape)} and k_rope {tuple(k_rope.shape)} disagree "
                             f"on (B, N)")
        k, v = c_kv.unsqueeze(1), k_rope.unsqueeze(1)
        pos = self._check_step(layer, k, v, positions, 1, spec.kv_lora_rank, spec.tail_width)
        self._order.check(positions, pos, layer=layer_idx, owner="update_latent")
        k, v = self._cast(k, v)
        if rope is not None:
            v = rope(v, pos.clamp_min(0))
        c_all, r_all, kv_pos = layer.store.write(k, v, pos)
        self._order.commit(positions, pos, layer=layer_idx)
        return LatentView(c_all[:, 0], r_all[:, 0], kv_pos, pos)

    def recurrent_state(self, layer_idx: int):
        """The state a recurrent layer (:class:`qkv.cache.RecurrentSpec`) left after its last step, as it was
        given to ``update_recurrent`` (e.g. a :class:`qkv.nn.RecurrentState`), or None before the first."""
        store = self._layer(layer_idx, (RecurrentSpec,), "recurrent_state").store
        if self._row_slots:  # continuous batching: the state of the rows this step feeds
            return store.get_rows(self._manager.selected, self._manager.rows)
        return store.get()

    def update_recurrent(self, layer_idx: int, state, *, tokens: int) -> None:
        """Keep a recurrent layer's state after a step that consumed ``tokens`` tokens per row.

        Args:
            state: ``(conv (B, conv_dim, conv_kernel - 1), recurrent (B, num_heads, head_k_dim, head_v_dim))``,
                e.g. the :class:`qkv.nn.RecurrentState` a mixer returned, then the spec's ``side`` parts where it
                has them; kept as given.
            tokens: the step's tokens per row (padding included), which ``seq_length`` counts.
        """
        layer = self._layer(layer_idx, (RecurrentSpec,), "update_recurrent")
        if self._device is None:
            self._device = state[1].device if isinstance(state, tuple) and len(state) >= 2 else None
        if self._row_slots:
            layer.store.put_rows(self._manager.selected, self._manager.rows, state, tokens)
        else:
            layer.store.put(state, tokens)

    def cross_kv(self, layer_idx: int, compute: Callable[[], tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder keys/values of a cross-attention layer, computed by ``compute()`` on first use only."""
        if layer_idx not in self._cross:
            k, v = compute()
            if self._batch() is not None and k.shape[0] != self._batch():
                raise ValueError(f"cross_kv: compute() returned batch {k.shape[0]} but the cache holds "
                                 f"{self._batch()} rows")
            self._cross[layer_idx] = (k, v)
        return self._cross[layer_idx]

    def observe(self, layer_idx: int, q: torch.Tensor, *, scale: float | None = None) -> None:
        """Show the layer's queries of this step (rotated, (B, Hq, N, Dqk)) to an eviction policy.

        Modules call it right after attention when the cache has it; without a policy it does nothing.
        """
        layer = self._layer(self._source(layer_idx, "observe"), None, "observe")
        if layer.store is not None and layer.last_view is not None:
            layer.store.observe(q, layer.last_view, scale=scale)

    def scores_attention(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx``'s store ranks tokens by observed attention (its ``observe`` is not the
        no-op of :class:`qkv.cache.storage.Store`: H2O, SnapKV or a policy of the same kind)."""
        store = self._layer(self._source(layer_idx, "scores_attention"), None, "scores_attention").store
        return store is not None and type(store).observe is not Store.observe

    def keeps_absolute_positions(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` keeps keys at their absolute positions (full, sliding-window, latent
        and cross layers), so modules may hand it keys already rotated; False when it re-positions them
        (StreamingLLM's sinks), so it needs un-rotated keys and ``rope``."""
        layer_idx = self._source(layer_idx, "keeps_absolute_positions")
        return not isinstance(self._layer(layer_idx, None, "keeps_absolute_positions").store, RopeStore)

    @property
    def prefix_caching(self) -> bool:
        """True when ``match_prefix`` can reuse cached prompt prefixes (``Paged(prefix_caching=True)``)."""
        return isinstance(self.storage, Paged) and self.storage.prefix_caching

    # cache operations
    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Announce the next step's tokens (B, N) before the forward pass. Paged storage allocates the
        step's blocks here (raising :class:`qkv.cache.CacheFull` before anything is written) and learns
        the token ids it needs for prefix caching; other storages ignore it."""
        self._manager.prepare(input_ids, positions)

    def match_prefix(self, input_ids: torch.Tensor, positions: torch.Tensor, *, salt=None) -> torch.Tensor:
        """Attach to each row the blocks of its longest reusable prompt prefix (paged storage with
        ``prefix_caching=True``, on a fresh cache): full blocks indexed by earlier requests, or full blocks a
        longer row of this batch (ties: the earlier row) is about to write, so rows with a common prefix share
        one copy. Returns the reused tokens per row (B,) int64; the caller feeds only the remaining tokens, at
        positions from there on, right-aligned (left padding) so a shared block is written no later than the
        step that first reads it (a step that would read an unwritten block is refused). ``salt`` (bytes or
        str, one or one per row) isolates tenants: blocks are shared only between equal salts."""
        if (why := self._manager.refusal("match_prefix")) is not None:
            raise ValueError(why)
        recurrent = [lay.name for lay in self._layers if isinstance(lay.spec, RecurrentSpec)]
        if recurrent:
            raise ValueError(f"match_prefix: {', '.join(recurrent)} keep a recurrent state, not tokens, so a cached "
                             f"prompt prefix cannot be shared with them (the state at the prefix's end is not kept); "
                             f"prefill the whole prompt, or build the cache with prefix_caching=False")
        pos = batch_positions(positions, input_ids.shape[0], input_ids.shape[1], owner="match_prefix")
        hits = self._manager.match_prefix(input_ids, pos, salt=salt)
        return hits

    def crop(self, length: int) -> None:
        """Keep the first ``length`` written slots (negative: drop the last ``-length``), as for rejected
        speculative tokens. Raises (changing nothing) when a bounded layer no longer holds what the
        next query needs; build the cache with ``rollback=`` to keep spare tokens."""
        seen = self.seq_length
        if not isinstance(length, int) or isinstance(length, bool):
            raise TypeError(f"crop(length): expected an int, got {type(length).__name__}")
        n = -length if length < 0 else seen - length
        if n < 0 or n > seen:
            raise ValueError(f"crop({length}): the cache holds {seen} slots; use 0 <= length <= {seen} or "
                             f"-{seen} <= length < 0")
        if n == 0:
            return
        problems = [f"{lay.name}: {why}" for lay in self._layers if lay.store is not None
                    and (why := lay.store.cannot_drop(n)) is not None]
        if (why := self._manager.cannot_drop(n)) is not None:
            problems.append(why)
        if problems:
            raise ValueError(f"crop({length}): cannot drop {n} slots; nothing was changed. " + "; ".join(problems))
        self._manager.drop_last(n)
        self._order.forget()
        for lay in self._layers:
            if lay.store is not None:
                lay.store.drop_last(n)
            lay.last_view = None

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]`` for every layer (beam search). ``beam_idx`` may
        repeat rows and change the batch size; paged storage shares blocks and copies on write."""
        B = self._batch()
        idx = torch.as_tensor(beam_idx)
        if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise TypeError(f"reorder(beam_idx): expected a 1-D integer tensor, got {idx.dtype} {tuple(idx.shape)}")
        if B is not None and idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= B):
            raise ValueError(f"reorder(beam_idx): indices must lie in [0, {B}), got {idx.tolist()}")
        idx = idx.to(torch.int64)
        self._manager.reorder(idx.tolist())
        self._order.forget()
        dev_idx = idx.to(self._device) if self._device is not None else idx
        for lay in self._layers:
            if lay.store is not None:
                lay.store.reorder(dev_idx)
            lay.last_view = None
        for key, (k, v) in self._cross.items():
            self._cross[key] = (k.index_select(0, idx.to(k.device)), v.index_select(0, idx.to(v.device)))

    def fork(self, n: int) -> None:
        """Give every row ``n`` copies (rows ``b*n .. b*n+n-1``), for ``n`` samples of one prompt (``n >= 1``)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"fork(n): expected an int >= 1 (copies of every row), got {n!r}; to drop rows use "
                             f"cache.reorder(idx), to empty the cache cache.reset()")
        B = self._batch() or 1
        self.reorder(torch.arange(B).repeat_interleave(n))

    def reset(self) -> None:
        """Forget every row. Paged storage keeps its pools and its prefix index for the next request."""
        self._row_slots = False
        self._manager.reset()
        for i, lay in enumerate(self._layers):
            kept = None if lay.store is None else lay.store.emptied()
            lay.store = kept if kept is not None else self._make_store(i, lay.spec)
            lay.last_view = None
        self._cross = {}
        self._order = PositionOrder()

    # row slots (qkv.cache.RowSlots: continuous batching)
    def open_rows(self, n: int) -> None:
        """Give a fresh cache ``n`` empty rows (paged storage): every step then feeds ``(n, N)`` tokens, an
        empty row's as padding (position -1). Rows are recycled with :meth:`release_row`/:meth:`admit_row`."""
        manager = self._row_manager("open_rows")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"open_rows(n): expected an int >= 1 (rows), got {n!r}")
        if self.seq_length or manager.rows:
            raise ValueError(f"open_rows({n}): the cache already holds {manager.rows} rows; call it on a fresh "
                             f"cache (cache.reset() keeps the prefix index)")
        manager.open_rows(n)
        self._order.forget()
        self._row_slots = True

    def admit_row(self, b: int, prompt_ids: Sequence[int] | None = None, *, salt=None,
                  max_new_tokens: int | None = None, chunk: int | None = None) -> int:
        """Start a new sequence in empty row ``b`` at position 0 (paged storage). With prefix caching and
        ``prompt_ids`` (its prompt, a list of ints), the row attaches the cached blocks of its longest indexed
        prefix; returns the prompt tokens reused (0 without), and the caller feeds the prompt from there on, at
        positions from there on. The other rows keep their state. A refused call changes nothing.

        With ``max_new_tokens`` (and ``prompt_ids``), the row is promised the blocks its whole request can hold
        (prompt chunks of at most ``chunk`` tokens, default the whole prompt) until :meth:`release_row`, so it
        never runs out of blocks; :class:`qkv.cache.CacheFull` when :meth:`can_admit` says no."""
        manager = self._row_manager("admit_row")
        self._check_row(b, "admit_row")
        reserve = None
        if max_new_tokens is not None:
            if prompt_ids is None:
                raise ValueError("admit_row(max_new_tokens): a reservation needs the request's prompt_ids too")
            reserve = (len(prompt_ids), self._check_admission("admit_row", 1, max_new_tokens, chunk)[1], chunk)
        ids = None
        if prompt_ids is not None:
            if isinstance(prompt_ids, torch.Tensor) and prompt_ids.dim() == 1 and not prompt_ids.is_floating_point():
                prompt_ids = prompt_ids.tolist()
            if (not isinstance(prompt_ids, Sequence) or isinstance(prompt_ids, (str, bytes)) or not prompt_ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt_ids)):
                raise ValueError(f"admit_row(prompt_ids): expected a non-empty list of token ids (ints >= 0), got "
                                 f"{str(prompt_ids)[:80]}")
            ids = list(prompt_ids)
        hits = manager.admit_row(b, ids, salt, reserve=reserve)
        self._order.forget_rows([b])
        self._clear_recurrent_row(b)
        return hits

    def can_admit(self, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> bool:
        """Whether a request of ``prompt_tokens`` and up to ``max_new_tokens`` (prompt chunks of at most ``chunk``
        tokens, default the whole prompt) fits next to the rows admitted with ``max_new_tokens`` (paged storage):
        in every group of layers sharing block tables, the blocks promised plus the most blocks the request can hold
        (its prompt and every new token fed back; a window's worth for sliding-window layers) are at most the pool.

        Example:
            >>> from qkv.cache import FullSpec, KVCache, Paged
            >>> cache = KVCache([FullSpec(1, 4)], storage=Paged(block_size=4, num_blocks=2))
            >>> cache.open_rows(2)
            >>> cache.can_admit(5, 4), cache.can_admit(5, 5)   # 8 tokens are stored in 2 blocks, 9 are not
            (True, False)
        """
        prompt_tokens, max_new_tokens, chunk = self._check_admission("can_admit", prompt_tokens, max_new_tokens,
                                                                     chunk)
        if (why := self._manager.refusal("can_admit")) is not None:
            raise ValueError(why)
        return self._manager.can_admit(prompt_tokens, max_new_tokens, chunk=chunk)

    def never_fits(self, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> str | None:
        """Why no pool of this cache's size could hold such a request even alone (paged storage), or None."""
        prompt_tokens, max_new_tokens, chunk = self._check_admission("never_fits", prompt_tokens, max_new_tokens,
                                                                     chunk)
        if (why := self._manager.refusal("never_fits")) is not None:
            raise ValueError(why)
        return self._manager.never_fits(prompt_tokens, max_new_tokens, chunk=chunk)

    def reserve_row(self, b: int, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> None:
        """Promise empty row ``b`` the blocks of a request of ``prompt_tokens`` and up to ``max_new_tokens`` before
        :meth:`admit_row` attaches its prompt (paged storage): a scheduler that holds a row while the prompt blocks
        it will share are still being written keeps its place in the pool. :class:`qkv.cache.CacheFull`, changing
        nothing, when :meth:`can_admit` says no; :meth:`admit_row` with ``max_new_tokens`` or :meth:`release_row`
        replaces the promise."""
        manager = self._row_manager("reserve_row")
        self._check_row(b, "reserve_row")
        prompt_tokens, max_new_tokens, chunk = self._check_admission("reserve_row", prompt_tokens, max_new_tokens,
                                                                     chunk)
        manager.reserve(b, prompt_tokens, max_new_tokens, chunk=chunk)

    @staticmethod
    def _check_admission(what: str, prompt_tokens, max_new_tokens, chunk) -> tuple[int, int, int | None]:
        for name, value in (("prompt_tokens", prompt_tokens), ("max_new_tokens", max_new_tokens),
                            ("chunk", 1 if chunk is None else chunk)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{what}({name}): expected an int >= 1, got {value!r}")
        return prompt_tokens, max_new_tokens, chunk

    def release_row(self, b: int) -> None:
        """Forget row ``b`` (paged storage): its blocks return to the pool at once (indexed prompt blocks stay
        cached for reuse) and its position record is reset, while the other rows keep their state. Between
        steps only; a refused call changes nothing."""
        manager = self._row_manager("release_row")
        self._check_row(b, "release_row")
        manager.release_row(b)
        self._order.forget_rows([b])
        self._clear_recurrent_row(b)
        for lay in self._layers:
            lay.last_view = None

    def _clear_recurrent_row(self, b: int) -> None:
        for lay in self._layers:
            if isinstance(lay.store, RecurrentStore):
                lay.store.clear_row(b)

    def step_rows(self, rows: Sequence[int] | None) -> None:
        """Until the next call, steps feed only ``rows`` (paged storage; increasing row indices) as
        ``(len(rows), N)`` inputs, so rows in different phases (prefill chunks, single decode tokens) run in
        separate forward passes of their own width; the other rows keep their state. None: every row again."""
        manager = self._row_manager("step_rows")
        if rows is not None:
            rows = list(rows) if isinstance(rows, (list, tuple, range)) else rows
            if (not isinstance(rows, list) or not rows
                    or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
                    or any(a >= b for a, b in zip(rows, rows[1:])) or rows[0] < 0 or rows[-1] >= manager.rows):
                raise ValueError(f"step_rows(rows): expected increasing row indices in [0, {manager.rows}) or None, "
                                 f"got {rows!r}")
        manager.select(rows)
        if not isinstance(self._order, _SelectedRowsOrder):
            self._order = _SelectedRowsOrder(self._order, manager)
        for lay in self._layers:
            lay.last_view = None

    def rollback_step(self, start: int) -> str | None:
        """After a forward pass raised (paged storage): undo its step, which every layer, some or none had written,
        back to ``start`` written slots (``seq_length`` before the pass). The blocks the step took return to the
        pool and none of them enters the prefix index. Returns None when undone; otherwise why it cannot be (a
        sliding-window layer released blocks the earlier slots need): then the step counts as written by every
        layer (its slots hold stale values where a layer did not write) and the caller releases the step's rows,
        as nothing may read them."""
        manager = self._row_manager("rollback_step", during_step=True)
        n = manager.seen - start
        if n < 0 or any(s.seen not in (start, manager.seen) for s in manager.stores):
            raise ValueError(f"rollback_step({start}): the layers hold {sorted({s.seen for s in manager.stores})} "
                             f"slots, not the {start} before one step and the {manager.seen} after it")
        manager.pending = []  # a failed step's blocks are never indexed for reuse
        for store in manager.stores:  # the layers that had not written it count it written, so all drop it alike
            store.seen = manager.seen
        self._order.forget()  # which layers stored the failed step's positions no longer matters
        for lay in self._layers:
            lay.last_view = None
        if any(isinstance(lay.store, RecurrentStore) for lay in self._layers):
            return ("a recurrent layer's state (RecurrentSpec) may already hold the pass's tokens, and a state "
                    "keeps no history to undo")
        if n == 0:
            return None
        why = manager.cannot_drop(n)
        if why is not None:
            return why
        self.crop(-n)
        return None

    def _row_manager(self, what: str, *, during_step: bool = False) -> RowManager:
        if (why := self._manager.refusal(what)) is not None:
            raise ValueError(why)
        if during_step:
            return self._manager
        if self._manager.step_in_progress():
            raise ValueError(f"{what}: a step is in progress (some layers have not written it yet); recycle rows "
                             f"between steps. Nothing was changed")
        return self._manager

    def _check_row(self, b, what: str) -> None:
        rows = self._manager.rows
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < rows:
            raise ValueError(f"{what}(b): row {b!r} is not a row of this cache, which holds {rows} rows"
                             + ("" if rows else "; call cache.open_rows(n) first"))

    # introspection
    @property
    def seq_length(self) -> int:
        """Slots written per row (padding included), the length ``crop`` counts in."""
        for lay in self._layers:
            if lay.store is not None:
                return lay.store.seen
        return 0

    def __len__(self) -> int:
        return len(self._layers)

    @property
    def batch(self) -> int | None:
        return self._batch()

    def layer_tokens(self, layer_idx: int) -> int:
        """Slots layer ``layer_idx`` holds per row now."""
        store = self._layer(self._source(layer_idx, "layer_tokens"), None, "layer_tokens").store
        return 0 if store is None else store.held()

    def memory(self) -> CacheMemory:
        """Bytes allocated and bytes holding real tokens, per layer and in total."""
        rows, alloc, used, pool = [], 0, 0, 0
        for i, lay in enumerate(self._layers):
            if lay.store is None:
                a = sum(t.numel() * t.element_size() for t in self._cross.get(i, ()))
                u = a
            else:
                a, u = lay.store.allocated_bytes(), lay.store.used_bytes()
                pool += lay.store.nbytes()
            rows.append(LayerMemory(i, lay.spec.kind, self.layer_tokens(i), a, u))
            alloc, used = alloc + a, used + u
        return CacheMemory(alloc, used, pool, tuple(rows))

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the cache owns (whole pools for paged storage)."""
        return self.memory().pool_bytes + sum(t.numel() * t.element_size() for kv in self._cross.values()
                                              for t in kv)

    def pool_stats(self) -> dict[str, PoolStats]:
        """Paged storage only: block occupancy and prefix-cache hits per group of layers that share block tables,
        keyed ``"full_attention"`` (full and latent layers) and ``"sliding_window_<W>"`` (one per window ``W``).
        The fields are explained in :class:`qkv.cache.PoolStats`.

        Example:
            >>> import torch
            >>> from qkv.cache import KVCache, FullSpec, Paged
            >>> cache = KVCache([FullSpec(1, 4)], storage=Paged(block_size=4, num_blocks=8))
            >>> _ = cache.update(0, torch.zeros(1, 1, 6, 4), torch.zeros(1, 1, 6, 4), positions=torch.arange(6)[None])
            >>> s = cache.pool_stats()["full_attention"]
            >>> s.blocks_total, s.blocks_in_use, s.blocks_free
            (8, 2, 6)
        """
        if (why := self._manager.refusal("pool_stats")) is not None:
            raise ValueError(why)
        return self._manager.stats()

    def quant_error(self):
        """Quantized caches: the largest reconstruction errors measured so far and their bounds."""
        from .quant import QuantError, merge_errors
        errs = [e for lay in self._layers if lay.store is not None and (e := lay.store.error()) is not None]
        return merge_errors(errs) if errs else QuantError(0.0, 0.0, 0.0, 0.0)

    def __repr__(self) -> str:
        kinds: dict[str, int] = {}
        for s in self.specs:
            kinds[s.kind] = kinds.get(s.kind, 0) + 1
        extra = "".join(f", {n}={x!r}" for n, x in (("quant", self.quant), ("policy", self.policy)) if x is not None)
        return (f"KVCache({len(self.specs)} layers {kinds}, {self.storage.describe()}{extra}, "
                f"length={self.seq_length}, batch={self._batch()})")

    # helpers
    def _source(self, i: int, what: str) -> int:
        """The layer whose store layer ``i`` reads: its own, or a :class:`~qkv.cache.SharedSpec`'s source."""
        spec = self._layer(i, None, what).spec
        return spec.source if isinstance(spec, SharedSpec) else i

    def _layer(self, i: int, kinds, what: str) -> _Layer:
        if not isinstance(i, int) or not 0 <= i < len(self._layers):
            raise ValueError(f"{what}: layer_idx {i!r} out of range for a cache of {len(self._layers)} layers; a "
                             f"model with more layers than the cache was built for? Build the cache from the model: "
                             f"KVCache(model) or KVCache(model.cache_specs())")
        layer = self._layers[i]
        if kinds is not None and not isinstance(layer.spec, kinds):
            hint = {"update": "MLA layers call update_latent, recurrent layers update_recurrent, a SharedSpec layer "
                              "stores nothing (it reads its source's view(source))",
                    "update_latent": "use update() for this layer",
                    "recurrent_state": "only RecurrentSpec layers keep a recurrent state",
                    "update_recurrent": "only RecurrentSpec layers keep a recurrent state"}
            raise ValueError(f"{what}: {layer.name} cannot take {what}(); {hint.get(what, '')}")
        return layer

    def _batch(self) -> int | None:
        if self._manager.rows:
            return self._manager.rows
        for lay in self._layers:
            if lay.store is not None and lay.store.batch is not None:
                return lay.store.batch
        for k, _ in self._cross.values():
            return k.shape[0]
        return None

    def _cast(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dtype is None:
            self.dtype = k.dtype
        if self._device is None:
            self._device = k.device
        dtype = self.dtype
        return (k if k.dtype == dtype else k.to(dtype)), (v if v.dtype == dtype else v.to(dtype))

    def _check_step(self, layer: _Layer, k, v, positions, H: int, Dk: int, Dv: int) -> torch.Tensor:
        for name, t, width in (("k", k, Dk), ("v", v, Dv)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[1] != H or t.shape[3] != width:
                raise ValueError(f"update: {name} must be (B, {H}, N, {width}) for {layer.name}, got "
                                 f"{tuple(getattr(t, 'shape', ()))}")
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"update: k {tuple(k.shape)} and v {tuple(v.shape)} disagree on (B, H, N)")
        B, n = k.shape[0], k.shape[2]
        have = self._batch()
        if self._manager.selected is not None and B != len(self._manager.selected):
            raise ValueError(f"update: {layer.name} got batch {B} but steps feed the {len(self._manager.selected)} "
                             f"rows selected by cache.step_rows({self._manager.selected}); feed those, or "
                             f"step_rows(None) for every row")
        if have is not None and B != have and self._manager.selected is None:
            raise ValueError(f"update: {layer.name} got batch {B} but the cache holds {have} rows; use "
                             f"cache.reorder(idx) or cache.fork(n) to change rows, or a new cache")
        return batch_positions(positions, B, n, owner="update", device=k.device)


def _window(spec: LayerSpec) -> int | None:
    return spec.window if isinstance(spec, SlidingWindowSpec) else None


