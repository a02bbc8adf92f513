"""DeepSeek-V4's attention layer: a sliding window of tokens, alone or beside compressed KV entries, in one softmax
with per-head sinks. DeepSeek-AI 2026, "DeepSeek-V4" technical report, Section 2.3.

Each layer (its kind from :class:`qkv.config.compressed.CompressedAttentionConfig`):

- queries: low rank, ``q = rms(q_b(q_a_norm(q_a(x))))`` per head (Hq heads of width D, the RMS without weight);
- one KV head shared by all query heads, keys equal to values: ``kv = kv_norm(kv_proj(x))`` (D);
- partial RoPE (Su et al. 2021) on the **last** ``R = qk_rope_head_dim`` channels of each query and key, channels
  paired ``(2f, 2f + 1)``; since values are the rotated keys, the output's last R channels are rotated back at the
  query's position (rotation by ``-p``), so each token's contribution depends on the query-key distance only;
- ``"sliding"``: attention over the last ``sliding_window`` tokens;
- ``"hca"``: plus every complete window of ``m'`` tokens pooled into one entry (:func:`qkv.sparse.compress_kv`, a
  softmax gate over the window's tokens with a learned position bias), normed and rotated at the window's first
  position; a query sees an entry once all its tokens are (:func:`qkv.sparse.compressed_attention`);
- ``"csa"``: entries of overlapping windows (``2m`` tokens, stride ``m``), of which a lightning indexer keeps the
  ``index_topk`` best per query: its own compressed keys (``Di`` wide) scored by ``sum_h w_h relu(q_h . k)`` with
  ``w = weights_proj(x)``, queries from the same low-rank query ``q_a_norm(q_a(x))``;
- sinks: a learned logit per head in the softmax's denominator (as gpt-oss);
- grouped low-rank output: the Hq·D outputs cut into ``g`` groups, each projected to ``o_lora_rank``
  (:func:`grouped_linear`), then one projection to d.

Submodules and parameters carry HF's names (``q_a_proj``, ``compressor.indexer.kv_proj``, ...), the indexer's
``scorer.weights_proj`` as ``indexer.weights_proj``. Every layer rotates with its own RoPE parameters (the model's
decoder runs with ``position="none"``). Left-padded rows are computed each alone (their compressed windows start at
their first real token). Decoding keeps each row's pools in a :class:`qkv.cache.CompressedCache` (the last
``sliding_window - 1`` keys, the compressed entries, the indexer's keys, the compressors' carries): a new token
attends to them and, when it completes a window, adds its entry.

Shape legend: B batch, N tokens, d hidden size, Hq query heads, D head dim, R rotated channels, T compressed
entries, Hi indexer heads, Di indexer head dim, K entries kept per query, g output groups.

Example:
    >>> import torch
    >>> from qkv.config import DecoderConfig
    >>> from qkv.config.compressed import CompressedAttentionConfig
    >>> cc = CompressedAttentionConfig(attention_types=("sliding", "csa", "hca"), q_lora_rank=16, o_groups=2,
    ...                                o_lora_rank=8, qk_rope_head_dim=4, index_n_heads=2, index_head_dim=8,
    ...                                index_topk=2, compress_rates={"csa": 2, "hca": 4})
    >>> c = DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
    ...                   num_key_value_heads=1, head_dim=8, intermediate_size=64, sliding_window=4,
    ...                   layer_types=("sliding_attention",) * 3, attention_sinks=True, position="none",
    ...                   compressed=cc)
    >>> layer = CompressedAttention(c, 1)
    >>> layer(torch.randn(2, 10, 32)).shape
    torch.Size([2, 10, 32])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.compressed import CompressedCache, RowState
from ..pos.rope import RotaryEmbedding, apply_rotary
from ..sparse import compress_kv, compressed_attention
from .mixer import MixerStep
from .norm import RMSNorm, rms_norm
from .protocol import apply_head_gate

if TYPE_CHECKING:
    from ..config.decoder import DecoderConfig
    from ..config.rope import RopeParams

__all__ = ["CompressedAttention", "GroupedLinear", "grouped_linear", "rotate_tail"]


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A block-diagonal product: x (..., g * I) cut into ``g`` groups of I, group ``i`` times its rows
    ``weight[i * r:(i + 1) * r]`` of ``weight`` (g * r, I) -> (..., g * r).

    Example:
        >>> import torch
        >>> x, w = torch.randn(3, 8), torch.randn(6, 4)
        >>> y = grouped_linear(x, w, 2)
        >>> torch.allclose(y[:, 3:], x[:, 4:] @ w[3:].T)
        True
    """
    g_in = x.shape[-1] // groups
    w = weight.view(groups, -1, g_in)  # (g, r, I)
    return torch.einsum("...gi,gri->...gr", x.unflatten(-1, (groups, g_in)), w).flatten(-2)


class GroupedLinear(nn.Module):
    """:func:`grouped_linear` with its ``weight`` (g * r, I): (..., g * I) -> (..., g * r)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group).normal_(std=in_per_group ** -0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, self.groups)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last R channels of ``x`` (B, H, N, D) in interleaved pairs by ``cos``/``sin`` (B, N, R) (R even,
    <= D); the first D - R channels pass through."""
    R = cos.shape[-1]
    return torch.cat([x[..., :-R], apply_rotary(x[..., -R:], cos, sin, interleaved=True)], dim=-1)


def _rope(params: RopeParams, rotary_dim: int, max_positions: int) -> RotaryEmbedding:
    return RotaryEmbedding(rotary_dim, theta=params.theta, scaling=dict(params.scaling) if params.scaling else None,
                           max_position_embeddings=max_positions, interleaved=True)


class _Indexer(nn.Module):
    """CSA's lightning indexer: compressed keys of its own (overlapping windows, Di wide) and Hi query heads."""

    def __init__(self, d: int, q_lora_rank: int, heads: int, dim: int, rate: int, eps: float) -> None:
        super().__init__()
        self.heads, self.dim, self.rate = heads, dim, rate
        self.kv_proj = nn.Linear(d, 2 * dim, bias=False)
        self.gate_proj = nn.Linear(d, 2 * dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, 2 * dim))
        self.kv_norm = RMSNorm(dim, eps=eps)
        self.q_b_proj = nn.Linear(q_lora_rank, heads * dim, bias=False)
        self.weights_proj = nn.Linear(d, heads, bias=False)


class _Compressor(nn.Module):
    """A CSA or HCA layer's compressor: per-token values and gates (2D wide with CSA's overlap), a position bias."""

    def __init__(self, d: int, head_dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.rate, self.overlap = rate, overlap
        self.kv_proj = nn.Linear(d, width, bias=False)
        self.gate_proj = nn.Linear(d, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(head_dim, eps=eps)
        self.indexer: _Indexer | None = None


class CompressedAttention(nn.Module):
    """One DeepSeek-V4 attention layer (module notes), a :class:`qkv.nn.mixer.DecoderMixer`.

    Args:
        config: the model's :class:`qkv.config.DecoderConfig` (with ``compressed``).
        layer_idx: the layer; its kind is ``config.compressed.attention_types[layer_idx]``.
    """

    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        c, cc = config, config.compressed
        self.layer_idx, self.kind = layer_idx, cc.attention_types[layer_idx]
        d, H, D, eps = c.hidden_size, c.num_attention_heads, c.head_dim, c.rms_norm_eps
        self.n_heads, self.head_dim, self.window, self.eps = H, D, c.sliding_window, eps
        self.n_kv_heads = 1  # one KV head, K = V (qkv.nn.protocol.AttentionModule)
        self.head_gate: torch.Tensor | None = None  # (H,) multiplier of each head's output; None: 1
        self.rate, self.topk, self.o_groups = cc.rate_of(layer_idx), cc.index_topk, cc.o_groups
        self.q_a_proj = nn.Linear(d, cc.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cc.q_lora_rank, eps=eps)
        self.q_b_proj = nn.Linear(cc.q_lora_rank, H * D, bias=False)
        self.kv_proj = nn.Linear(d, D, bias=False)
        self.kv_norm = RMSNorm(D, eps=eps)
        self.o_a_proj = GroupedLinear(H * D // cc.o_groups, cc.o_groups * cc.o_lora_rank, cc.o_groups)
        self.o_b_proj = nn.Linear(cc.o_groups * cc.o_lora_rank, d, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H))
        self.rope = _rope(cc.rope_of(layer_idx), cc.qk_rope_head_dim, c.max_position_embeddings)
        self.compressor = None
        if self.kind != "sliding":
            self.compressor = _Compressor(d, D, self.rate, self.kind == "csa", eps)
            if self.kind == "csa":
                self.compressor.indexer = _Indexer(d, cc.q_lora_rank, cc.index_n_heads, cc.index_head_dim, self.rate,
                                                   eps)

    @property
    def attention_fn(self) -> None:
        """None: the layer calls :func:`qkv.sparse.compressed_attention`, not :func:`qkv.attention`, so tools that
        replace that operator refuse it (:class:`qkv.nn.protocol.AttentionModule`)."""
        return None

    @classmethod
    def for_decoder(cls, config: DecoderConfig, layer_idx: int, rope=None) -> CompressedAttention:
        """The attention of layer ``layer_idx`` of ``config`` (:mod:`qkv.nn.mixer`); it rotates with its own RoPE."""
        return cls(config, layer_idx)

    def score_modifiers(self) -> tuple:
        """None beyond ``q.k`` (the sinks add to the denominator only)."""
        return ()

    def mix(self, x: torch.Tensor, step: MixerStep, keep: int = 0) -> torch.Tensor:
        """The decoder's call: (B, N, d) -> (B, N, d) (every column; the decoder keeps the last ``keep``). With a
        :class:`qkv.cache.CompressedCache` each row continues its pools; a row's real tokens (position >= 0) must
        follow its padding and continue its positions (0, 1, 2, ... from what its cache has seen)."""
        cache, pos = step.cache, step.positions
        if cache is not None and not isinstance(cache, CompressedCache):
            raise ValueError(f"CompressedAttention: layer {self.layer_idx} (DeepSeek-V4) keeps its pools in a "
                             f"qkv.cache.CompressedCache(model.cache_specs()), got {type(cache).__name__}")
        B, N, _ = x.shape
        if pos is None and cache is None:
            return self._run(x, None)
        pos = torch.arange(N, device=x.device).expand(B, N) if pos is None else pos.expand(B, N)
        rows = cache.rows(self.layer_idx, batch=B) if cache is not None else [None] * B
        out = x.new_zeros(B, N, x.shape[-1])
        for b, state in enumerate(rows):
            real = pos[b] >= 0
            n = int(real.sum())
            seen = 0 if state is None else state.seen
            want = torch.arange(seen, seen + n, device=pos.device)
            if not torch.equal(pos[b, real], want) or not bool(real[N - n:].all()):
                raise ValueError(f"CompressedAttention: row {b} has positions {pos[b].tolist()}; its real tokens must "
                                 f"follow its padding (-1) and continue its positions from {seen} (0, 1, 2, ... "
                                 "without a cache)")
            if n:
                out[b, N - n:] = self._run(x[b:b + 1, N - n:], state)[0]
        if cache is not None:
            cache.advance(self.layer_idx, N)
        return out

    def _compress(self, comp: nn.Module, x: torch.Tensor, overlap: bool, carry, first: int):
        """New compressed, normed and rotated entries (B, 1, T, width) of x (B, N, d) continuing ``carry``, entry t
        at position (first + t) * rate; and the carry after them."""
        out = compress_kv(comp.kv_proj(x), comp.gate_proj(x), comp.position_bias.to(x.dtype), rate=self.rate,
                          overlap=overlap, carry=carry)
        e = comp.kv_norm(out.entries).unsqueeze(1)  # (B, 1, T, width)
        T = e.shape[2]
        if T:
            cos, sin = self._cos_sin((first + torch.arange(T, device=x.device)) * self.rate, x.dtype)
            e = rotate_tail(e, cos, sin)
        return e, out.carry

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        work = torch.float64 if dtype == torch.float64 else torch.float32
        return self.rope.cos_sin(positions, dtype=work)

    def _select(self, x: torch.Tensor, q_low: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                pos: torch.Tensor) -> torch.Tensor:
        """The indexer's choice (B, 1, N, K) among ``keys`` (B, T, Di) for queries at ``pos`` (N,): entry ids, -1
        where fewer than K entries are complete."""
        ix = self.compressor.indexer
        B, N, _ = x.shape
        T = keys.shape[1]
        q = rotate_tail(ix.q_b_proj(q_low).view(B, N, ix.heads, ix.dim).transpose(1, 2), cos, sin)  # (B, Hi, N, Di)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        scores = F.relu(torch.einsum("bhnk,btk->bhnt", q.to(work), keys.to(work))) * ix.dim ** -0.5
        w = ix.weights_proj(x).to(work) * ix.heads ** -0.5  # (B, N, Hi)
        scores = torch.einsum("bhnt,bnh->bnt", scores, w)  # (B, N, T)
        complete = ((pos + 1) // self.rate)[:, None]  # (N, 1): entries whose every token has arrived
        scores = scores.masked_fill(torch.arange(T, device=x.device) >= complete, float("-inf"))
        top = scores.topk(min(self.topk, T), dim=-1).indices  # (B, N, K)
        return torch.where(top < complete, top, -1).unsqueeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One sequence per row at positions 0 .. N-1, no cache: (B, N, d) -> (B, N, d)."""
        return self._run(x, None)

    def _run(self, x: torch.Tensor, state: RowState | None) -> torch.Tensor:
        """(B, N, d) at positions ``seen .. seen + N - 1`` (``seen``: the tokens ``state`` holds, 0 without) ->
        (B, N, d); ``state`` (one row, B = 1) is advanced past these tokens."""
        B, N, _ = x.shape
        H, D = self.n_heads, self.head_dim
        seen = 0 if state is None else state.seen
        pos = torch.arange(seen, seen + N, device=x.device)
        cos, sin = self._cos_sin(pos, x.dtype)
        q_low = self.q_a_norm(self.q_a_proj(x))  # (B, N, q_lora_rank)
        q = rms_norm(self.q_b_proj(q_low).view(B, N, H, D), eps=self.eps).transpose(1, 2)  # (B, H, N, D)
        q = rotate_tail(q, cos, sin)
        kv = rotate_tail(self.kv_norm(self.kv_proj(x)).unsqueeze(1), cos, sin)  # (B, 1, N, D)
        keys = kv if state is None or state.window is None else torch.cat([state.window, kv], 2)
        selected, entries, rate = None, keys[:, :, :0], 1
        if self.compressor is not None:
            rate, csa = self.rate, self.kind == "csa"
            old = None if state is None else state.entries
            new, carry = self._compress(self.compressor, x, csa, None if state is None else state.carry,
                                        0 if old is None else old.shape[2])
            entries = new if old is None else torch.cat([old, new], 2)
            if csa:
                old_keys = None if state is None else state.index_keys
                new_keys, index_carry = self._compress(self.compressor.indexer, x, True,
                                                       None if state is None else state.index_carry,
                                                       0 if old_keys is None else old_keys.shape[1])
                index_keys = new_keys[:, 0] if old_keys is None else torch.cat([old_keys, new_keys[:, 0]], 1)
                if index_keys.shape[1]:
                    selected = self._select(x, q_low, cos, sin, index_keys, pos)
        o = compressed_attention(q, keys, keys, entries, entries, rate=rate, window=self.window, selected=selected,
                                 sinks=self.sinks.to(x.dtype), scale=D ** -0.5, q_start=seen,
                                 k_start=seen + N - keys.shape[2])
        o = apply_head_gate(rotate_tail(o, cos, -sin), self.head_gate)  # undo the values' rotation at the query
        if state is not None:
            state.seen += N
            state.window = keys[:, :, keys.shape[2] - min(keys.shape[2], self.window - 1):]
            if self.compressor is not None:
                state.entries, state.carry = entries, carry
                if self.kind == "csa":
                    state.index_keys, state.index_carry = index_keys, index_carry
        return self.o_b_proj(self.o_a_proj(o.transpose(1, 2).reshape(B, N, H * D)))
