"""Eviction policies: what a full-attention layer drops to stay within a token budget.

Shape legend: B batch rows, Hkv key/value heads, Hq query heads, S held slots, K kept slots, w window.

- :class:`StreamingLLM` (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks",
  arXiv:2309.17453): keep the first ``n_sink`` tokens and the last ``window``. It turns full layers into
  :class:`qkv.cache.SinkSpec` layers, whose store keeps keys *before* RoPE and rotates them at their
  position inside the cache (sinks at ``0 .. n_sink-1``, then the window in order), which is what the
  ``rope=`` argument of ``cache.update`` exists for. Up to ``n_sink + window`` tokens this is exactly
  full attention.
- :class:`H2O` (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
  Large Language Models", arXiv:2306.14048): per KV head, keep the ``recent`` latest tokens and the
  ``heavy`` tokens with the largest attention accumulated over every query so far.
- :class:`SnapKV` (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
  arXiv:2404.14469): at the end of prefill, the last ``window`` prompt queries vote (attention summed
  over the window, then pooled along keys so neighbours of a hit survive with it); per KV head the top
  ``budget - window`` prompt tokens plus the window are kept. Decoding then appends without eviction.

The attention each key receives comes from :func:`qkv.attention_stats` (exact, from the operator's
log-sum-exp, streamed in blocks of query rows so a long prefill never forms its (Nq, S) probabilities),
reached through ``cache.observe(layer_idx, q)``, which modules call after attention.
Evictions happen on the layer's next ``update``, so a view being attended is never changed.

Per-head policies keep the same number of slots for every head of a row, but not the same tokens.
``kv_positions`` then reports, per slot, the latest position any head holds there: every kept key
precedes the queries that read it, so causal masking stays exact. For that reason these policies
apply only to full-attention layers (a sliding window would need per-head positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..pos.ids import positions_from_padding
from .specs import FullSpec, LayerSpec, SinkSpec, element_bytes
from .storage import RopeStore, Store

__all__ = ["StreamingLLM", "H2O", "SnapKV", "SinkStore", "HeadwiseStore"]


def _check_int(name: str, value, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


@dataclass(frozen=True)
class StreamingLLM:
    """Attention sinks: every full-attention layer keeps ``n_sink`` first and ``window`` last tokens."""

    n_sink: int = 4
    window: int = 1020

    def __post_init__(self) -> None:
        _check_int("StreamingLLM(n_sink)", self.n_sink, 0)
        _check_int("StreamingLLM(window)", self.window, 1)

    def apply_spec(self, spec: LayerSpec) -> LayerSpec:
        if type(spec) is FullSpec:
            return SinkSpec(self.n_sink, self.window, spec.n_kv_heads, spec.head_dim, spec.v_head_dim)
        return spec

    def store_for(self, spec: LayerSpec, *, layer: str) -> Store | None:
        return SinkStore(spec) if isinstance(spec, SinkSpec) else None

    def token_cap(self, spec: LayerSpec, new_tokens: int = 0) -> int | None:
        return self.n_sink + self.window if isinstance(spec, (FullSpec, SinkSpec)) else None


@dataclass(frozen=True)
class H2O:
    """Heavy hitters + recent tokens, per KV head; a query attends over ``heavy + recent`` keys."""

    heavy: int = 64
    recent: int = 64

    def __post_init__(self) -> None:
        _check_int("H2O(heavy)", self.heavy, 0)
        _check_int("H2O(recent)", self.recent, 1)

    def apply_spec(self, spec: LayerSpec) -> LayerSpec:
        return spec

    def store_for(self, spec: LayerSpec, *, layer: str) -> Store | None:
        return HeadwiseStore(_H2ORule(self.heavy, self.recent)) if type(spec) is FullSpec else None

    def token_cap(self, spec: LayerSpec, new_tokens: int = 0) -> int | None:
        return self.heavy + self.recent if type(spec) is FullSpec else None


@dataclass(frozen=True)
class SnapKV:
    """Prompt compression at the end of prefill to ``budget`` tokens per KV head.

    The votes come from the last multi-token step before decoding starts; with chunked prefill that is
    the last chunk, so keep chunks at least ``window`` long.

    Args:
        budget: tokens kept per head (observation window included).
        window: the last prompt tokens whose queries vote, and which are always kept.
        kernel_size: pooling width along keys (odd).
        pooling: ``"max"`` or ``"avg"``.
    """

    budget: int = 1024
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        _check_int("SnapKV(window)", self.window, 1)
        _check_int("SnapKV(budget)", self.budget, self.window + 1)
        _check_int("SnapKV(kernel_size)", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"SnapKV(kernel_size) must be odd so pooling stays centred, got {self.kernel_size}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"SnapKV(pooling) must be 'max' or 'avg', got {self.pooling!r}")

    def apply_spec(self, spec: LayerSpec) -> LayerSpec:
        return spec

    def store_for(self, spec: LayerSpec, *, layer: str) -> Store | None:
        return HeadwiseStore(_SnapRule(self)) if type(spec) is FullSpec else None

    def token_cap(self, spec: LayerSpec, new_tokens: int = 0) -> int | None:
        """The compressed prompt (``budget``) plus every token generated after it."""
        return self.budget + new_tokens if type(spec) is FullSpec else None


def _mask(q, view):
    from .. import masks

    return masks.positions(view.q_positions[:, -q.shape[2]:], view.kv_positions, causal=True)


def _column_sums(q, view, scale) -> torch.Tensor:
    """(B, Hq, S) attention each cached key receives from ``q``'s rows, streamed in O(N) memory."""
    from .._probs import attention_stats

    return attention_stats(q, view.k, view.v, mask=_mask(q, view), scale=scale).column_sums


def _per_kv_head(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, Hq, S) summed over the query heads that share each KV head -> (B, Hkv, S)."""
    B, hq, S = x.shape
    return x.view(B, hkv, hq // hkv, S).sum(2)


class HeadwiseStore(Store):
    """Contiguous per-head slots that a rule compacts: k (B, H, cap, Dk), positions (B, H, cap)."""

    def __init__(self, rule) -> None:
        self.rule = rule
        self.k = self.v = self.pos = self.score = None
        self.end = self.seen = 0
        self.votes: torch.Tensor | None = None  # rule-specific observations, aligned with slots

    @property
    def batch(self):
        return None if self.k is None else self.k.shape[0]

    def _reserve(self, k, v, n: int) -> None:
        if self.k is not None and self.end + n <= self.k.shape[2]:
            return
        cap = max(16, 1 << (self.end + n - 1).bit_length())
        B, H, _, Dk = k.shape
        nk, nv = k.new_empty(B, H, cap, Dk), v.new_empty(B, H, cap, v.shape[-1])
        npos = torch.full((B, H, cap), -1, dtype=torch.int64, device=k.device)
        nscore = torch.zeros(B, H, cap, dtype=torch.float32, device=k.device)
        if self.k is not None:
            e = self.end
            nk[:, :, :e], nv[:, :, :e], npos[:, :, :e], nscore[:, :, :e] = (
                self.k[:, :, :e], self.v[:, :, :e], self.pos[:, :, :e], self.score[:, :, :e])
        self.k, self.v, self.pos, self.score = nk, nv, npos, nscore

    def keep(self, idx: torch.Tensor) -> None:
        """Compact to the slots ``idx`` (B, H, K), ascending per head."""
        K = idx.shape[2]
        self.k[:, :, :K] = self.k.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, self.k.shape[-1]))
        self.v[:, :, :K] = self.v.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, self.v.shape[-1]))
        self.pos[:, :, :K] = self.pos.gather(2, idx)
        self.score[:, :, :K] = self.score.gather(2, idx)
        self.pos[:, :, K:] = -1
        self.score[:, :, K:] = 0
        self.end = K

    def write(self, k, v, pos):
        n = k.shape[2]
        if self.k is not None and self.rule is not None:
            self.rule.evict(self, n)
        self._reserve(k, v, n)
        a, b = self.end, self.end + n
        self.k[:, :, a:b], self.v[:, :, a:b] = k, v
        self.pos[:, :, a:b] = pos.unsqueeze(1)
        self.score[:, :, a:b] = 0
        self.end, self.seen = b, self.seen + n
        return self.k[:, :, :b], self.v[:, :, :b], self.pos[:, :, :b].amax(1)

    def observe(self, q, view, *, scale=None) -> None:
        self.rule.observe(self, q, view, scale)

    def cannot_drop(self, n):
        if n > self.end:
            return f"an evicting layer holds {self.end} slots, cannot drop the last {n}"
        return None

    def drop_last(self, n):
        if n > 0:
            self.pos[:, :, self.end - n:self.end] = -1
            self.end -= n
            self.seen -= n
            self.votes = None

    def reorder(self, idx):
        if self.k is not None:
            self.k, self.v, self.pos, self.score = (t.index_select(0, idx) for t in
                                                    (self.k, self.v, self.pos, self.score))
        if self.votes is not None:
            self.votes = self.votes.index_select(0, idx)

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos, self.score) if t is not None)

    def used_bytes(self):
        if self.k is None:
            return 0
        real = int((self.pos[:, :, :self.end] >= 0).sum())
        return real * (self.k.shape[-1] * self.k.element_size() + self.v.shape[-1] * self.v.element_size())

    def held(self):
        return self.end

    def planned_bytes(self, *, batch: int, peak: int, spec, dtype) -> float:
        """Keys, values, an int64 position and a float32 score per head and slot; slots grow by doubling
        from 16 to cover the most tokens held at once."""
        slots = 0 if peak == 0 else max(16, 1 << (peak - 1).bit_length())
        eb = element_bytes(dtype)
        return batch * slots * spec.n_kv_heads * ((spec.head_dim + spec.dv) * eb + 8 + 4)


def _topk_sorted(score: torch.Tensor, k: int) -> torch.Tensor:
    return score.topk(k, dim=-1).indices.sort(dim=-1).values


class _H2ORule:
    def __init__(self, heavy: int, recent: int) -> None:
        self.heavy, self.recent = heavy, recent

    def evict(self, st: HeadwiseStore, n: int) -> None:
        budget = self.heavy + self.recent
        if st.end + n <= budget:
            return
        keep = max(budget - n, 0)
        r = min(max(self.recent - n, 0), keep, st.end)
        h = min(keep - r, st.end - r)
        old = st.end - r
        B, H = st.k.shape[:2]
        recent = torch.arange(old, st.end, device=st.k.device).expand(B, H, r)
        if h > 0:
            score = st.score[:, :, :old].masked_fill(st.pos[:, :, :old] < 0, float("-inf"))
            idx = torch.cat([_topk_sorted(score, h), recent], dim=2)
        else:
            idx = recent
        st.keep(idx)

    def observe(self, st: HeadwiseStore, q, view, scale) -> None:
        cols = _column_sums(q, view, scale)  # (B, Hq, S): a long prefill never forms (Nq, S) probabilities
        S = cols.shape[-1]
        st.score[:, :, :S] += _per_kv_head(cols, st.k.shape[1])


class _SnapRule:
    def __init__(self, cfg: SnapKV) -> None:
        self.cfg = cfg

    def evict(self, st: HeadwiseStore, n: int) -> None:
        cfg = self.cfg
        if st.votes is None or n != 1:
            return
        votes, st.votes = st.votes, None
        if st.end <= cfg.budget:
            return
        w = min(cfg.window, st.end)
        prefix = st.end - w
        scores = votes[:, :, :prefix]  # (B, Hq, prefix)
        pad = cfg.kernel_size // 2
        pool = F.max_pool1d if cfg.pooling == "max" else F.avg_pool1d
        B, hq, _ = scores.shape
        pooled = pool(scores.reshape(B * hq, 1, prefix), cfg.kernel_size, stride=1, padding=pad).view(B, hq, prefix)
        H = st.k.shape[1]
        pooled = _per_kv_head(pooled, H)
        pooled = pooled.masked_fill(st.pos[:, :, :prefix] < 0, float("-inf"))
        chosen = _topk_sorted(pooled, min(cfg.budget - w, prefix))
        window = torch.arange(prefix, st.end, device=st.k.device).expand(B, H, w)
        st.keep(torch.cat([chosen, window], dim=2))

    def observe(self, st: HeadwiseStore, q, view, scale) -> None:
        if q.shape[2] < 2:
            return  # decoding: SnapKV never evicts after prefill
        w = min(self.cfg.window, q.shape[2])
        st.votes = _column_sums(q[:, :, -w:], view, scale)  # (B, Hq, S)


class SinkStore(RopeStore):
    """StreamingLLM: un-rotated keys of the first ``n_sink`` real tokens and the last ``window`` slots
    of each row, rotated at read time to their position inside the cache."""

    def __init__(self, spec: SinkSpec) -> None:
        self.n_sink, self.window = spec.n_sink, spec.window
        self.inner = HeadwiseStore(None)

    @property
    def seen(self):
        return self.inner.seen

    @property
    def batch(self):
        return self.inner.batch

    def _evict(self, n: int) -> None:
        st = self.inner
        recent = max(self.window - n, 0)
        if st.end <= self.n_sink + recent:
            return
        pos = st.pos[:, 0, :st.end]  # (B, S), the same for every head
        real = pos >= 0
        order = torch.cumsum(real.to(torch.int64), dim=1)
        slot = torch.arange(st.end, device=pos.device)
        prio = torch.where(real, torch.ones_like(pos), torch.zeros_like(pos))
        prio = torch.where(real & (order <= self.n_sink), torch.full_like(pos, 2), prio)
        prio = torch.where(slot >= st.end - recent, torch.full_like(pos, 3), prio)
        idx = _topk_sorted(prio * (st.end + 1) + slot, self.n_sink + recent)  # (B, K)
        st.keep(idx.unsqueeze(1).expand(-1, st.k.shape[1], -1).contiguous())

    def write_rope(self, k, v, pos, rope):
        n = k.shape[2]
        if self.inner.k is not None:
            self._evict(n)
        k_all, v_all, abs_pos = self.inner.write(k, v, pos)
        cache_pos = positions_from_padding(abs_pos >= 0)  # the real tokens kept, renumbered from 0
        if rope is not None:
            k_all = rope(k_all, cache_pos.clamp_min(0))
        return k_all, v_all, cache_pos, cache_pos[:, -n:]

    def write(self, k, v, pos):
        k_all, v_all, kv_pos, _ = self.write_rope(k, v, pos, None)
        return k_all, v_all, kv_pos

    def cannot_drop(self, n):
        return self.inner.cannot_drop(n)  # evicted tokens stay evicted: the window just shrinks

    def drop_last(self, n):
        self.inner.drop_last(n)

    def reorder(self, idx):
        self.inner.reorder(idx)

    def nbytes(self):
        return self.inner.nbytes()

    def used_bytes(self):
        return self.inner.used_bytes()

    def held(self):
        return self.inner.held()

    def planned_bytes(self, *, batch: int, peak: int, spec, dtype) -> float:
        return self.inner.planned_bytes(batch=batch, peak=peak, spec=spec, dtype=dtype)
