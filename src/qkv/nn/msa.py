"""MiniMax-M3's sparse-attention indexer (MSA): MiniMax 2026, MiniMax-M3 model report; HF transformers'
``MiniMaxM3VLIndexer`` (``model_type`` ``minimax_m3_vl_text``, layers of type ``"minimax_m3_sparse"``).

A small dot-product branch scores every visible key for each query and keeps whole key blocks::

    q_I = q_norm(q_proj(x))      (B, N, Hi, Di)   Hi = index_n_heads = the model's KV heads: one selection per
    k_I = k_norm(k_proj(x))      (B, N, Di)       one key per token                          GQA group
    RoPE (half-split, the model's rotary channels R <= Di) on both, at the tokens' positions
    s[h, i, j] = q_I[h, i] . k_I[j]              over the keys j at or before query i
    block score = max of s over the block's tokens (blocks of ``index_block_size`` positions)
    keep the ``index_local_blocks`` latest blocks, fill ``index_topk_blocks`` with the best others

This is :func:`qkv.sparse.select.msa_select`'s point of the selection space (one key head, max-pooled blocks, per
KV group, local blocks forced). The norms are Gemma-style (``1 + weight``); HF scores in float32 and so does this
module (float64 inputs score in float64). Blocks are anchored to positions, not cache slots, so a left-padded row
picks what it picks alone (HF's own indexer anchors to slots and documents that it differs under left padding).

Parameter names are HF's (``q_proj``, ``k_proj``, ``q_norm``, ``k_norm``), so ``load_state_dict`` takes a
checkpoint's ``self_attn.indexer`` unchanged.

Shape legend: B batch, N new tokens, S visible key slots, Hi indexer heads, Di indexer head dim, K blocks kept,
bs block size.

Example:
    >>> import torch
    >>> idx = MSAIndexer(32, index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2,
    ...                  index_local_blocks=1, rotary_dim=4)
    >>> x, pos = torch.randn(1, 10, 32), torch.arange(10).view(1, 10)
    >>> out = idx(x, idx.keys(x, pos), q_positions=pos, kv_positions=pos)
    >>> out.blocks.shape, out.slots.shape
    (torch.Size([1, 2, 10, 2]), torch.Size([1, 2, 10, 8]))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from .. import masks
from ..config.decoder import DecoderConfig
from ..pos.rope import RotaryEmbedding
from ..sparse.select import expand_heads, msa_select
from .norm import RMSNorm
from .selecting import SelectingAttention

if TYPE_CHECKING:
    from .decoder import RopeTable
    from .mixer import MixerStep

__all__ = ["BlockSparseAttention", "MSAIndexer", "MSAOutput"]


class MSAOutput(NamedTuple):
    """``blocks`` (B, Hi, N, K) int64 block ids and ``slots`` (B, Hi, N, K * bs) int64 key slots at or before each
    query (a :func:`qkv.masks.topk` list per KV group; :func:`qkv.sparse.select.expand_heads` repeats it per query
    head), ``-1`` for none."""

    blocks: torch.Tensor
    slots: torch.Tensor


class MSAIndexer(nn.Module):
    """MiniMax-M3's indexer (see the module).

    Args:
        hidden_size: model width ``d``.
        index_n_heads: ``Hi``, equal to the model's ``num_key_value_heads``. index_head_dim: ``Di``.
        index_block_size, index_topk_blocks, index_local_blocks: HF config names (``local <= topk``).
        rotary_dim: RoPE channels ``R`` (the model's ``head_dim * partial_rotary_factor``), even and ``<= Di``.
        rope: ``rope(x, positions)`` for those channels; default a half-split :class:`qkv.pos.RotaryEmbedding`.
        eps: the norms' epsilon. device, dtype: of the parameters.
    """

    def __init__(self, hidden_size: int, *, index_n_heads: int, index_head_dim: int, index_block_size: int,
                 index_topk_blocks: int, index_local_blocks: int, rotary_dim: int, rope=None, eps: float = 1e-6,
                 device=None, dtype=None) -> None:
        super().__init__()
        for name, value, low in (("hidden_size", hidden_size, 1), ("index_n_heads", index_n_heads, 1),
                                 ("index_head_dim", index_head_dim, 1), ("index_block_size", index_block_size, 1),
                                 ("index_topk_blocks", index_topk_blocks, 1),
                                 ("index_local_blocks", index_local_blocks, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"MSAIndexer: {name} must be an int >= {low}, got {value!r}")
        if index_local_blocks > index_topk_blocks:
            raise ValueError(f"MSAIndexer: index_local_blocks={index_local_blocks} forced blocks do not fit "
                             f"index_topk_blocks={index_topk_blocks}; lower the first or raise the second")
        if not isinstance(rotary_dim, int) or not 0 < rotary_dim <= index_head_dim or rotary_dim % 2:
            raise ValueError(f"MSAIndexer: rotary_dim must be even and in (0, index_head_dim={index_head_dim}], got "
                             f"{rotary_dim!r}")
        kw = {"device": device, "dtype": dtype}
        self.n_heads, self.head_dim, self.rotary_dim = index_n_heads, index_head_dim, rotary_dim
        self.block_size, self.topk_blocks, self.local_blocks = index_block_size, index_topk_blocks, index_local_blocks
        self.q_proj = nn.Linear(hidden_size, index_n_heads * index_head_dim, bias=False, **kw)
        self.k_proj = nn.Linear(hidden_size, index_head_dim, bias=False, **kw)
        self.q_norm = RMSNorm(index_head_dim, eps=eps, offset=1.0).to(**kw)
        self.k_norm = RMSNorm(index_head_dim, eps=eps, offset=1.0).to(**kw)
        self.rope = rope if rope is not None else RotaryEmbedding(rotary_dim)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``R`` channels of x (B, H, N, Di)."""
        R = self.rotary_dim
        return torch.cat((self.rope(x[..., :R], positions.clamp_min(0)), x[..., R:]), dim=-1)

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The indexer keys of the new tokens ``x`` (B, N, d), rotated at ``positions`` (B, N): (B, N, Di), what a
        cache holds beside the layer's keys and values."""
        k = self.k_norm(self.k_proj(x))  # (B, N, Di)
        return self._rotate(k.unsqueeze(1), positions).squeeze(1)

    def forward(self, x: torch.Tensor, keys: torch.Tensor, *, q_positions: torch.Tensor,
                kv_positions: torch.Tensor) -> MSAOutput:
        """Score and select, without gradients.

        Args:
            x: (B, N, d) the new tokens. keys: (B, S, Di) the indexer keys of every visible slot (:meth:`keys`).
            q_positions: (B, N) int64 positions of the queries; kv_positions: (B, S) of the slots (``-1``: padding
                or empty, never picked). Slots hold contiguous positions per row.

        Returns:
            :class:`MSAOutput`.
        """
        B, N, _ = x.shape
        if not isinstance(keys, torch.Tensor) or keys.dim() != 3 or keys.shape[0] != B or \
                keys.shape[-1] != self.head_dim:
            raise ValueError(f"MSAIndexer: keys must be (B={B}, S, index_head_dim={self.head_dim}) from "
                             f"MSAIndexer.keys, got {tuple(keys.shape) if isinstance(keys, torch.Tensor) else keys!r}")
        with torch.no_grad():
            q = self.q_norm(self.q_proj(x).view(B, N, self.n_heads, self.head_dim)).transpose(1, 2)  # (B, Hi, N, Di)
            q = self._rotate(q, q_positions)
            acc = torch.promote_types(q.dtype, torch.float32)
            blocks, slots = msa_select(q.to(acc), keys.to(acc).unsqueeze(1), block=self.block_size,
                                       topk_blocks=self.topk_blocks, local_blocks=self.local_blocks,
                                       q_positions=q_positions, kv_positions=kv_positions)
        return MSAOutput(blocks, slots)

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, head_dim={self.head_dim}, block={self.block_size}, "
                f"topk_blocks={self.topk_blocks}, local_blocks={self.local_blocks}, rotary_dim={self.rotary_dim}")


class BlockSparseAttention(SelectingAttention):
    """MiniMax-M3's MSA layer: :class:`qkv.nn.SelfAttention` (Gemma-style per-head QK norm, partial RoPE, GQA) in
    which each query head reads only the key blocks its KV group's :class:`MSAIndexer` keeps (the ``"msa"`` mixer
    kind, :class:`qkv.config.msa.MSAConfig`), on the ``gather`` backend when the config's is ``"auto"``. The
    indexer rotates with the attention's RoPE table. A cache keeps each token's indexer key beside its keys and values
    (:class:`qkv.nn.selecting.SelectingAttention`, :class:`qkv.cache.IndexedSpec`).
    """

    def __init__(self, c: DecoderConfig, layer_idx: int, rope: RopeTable | None) -> None:
        super().__init__(c, layer_idx, rope)
        msa = c.msa
        if rope is None:
            raise ValueError(f"BlockSparseAttention: layer {layer_idx} has no RoPE; MSA's indexer rotates its "
                             "queries and keys with the attention's (set position='rope')")
        rotary = int(self.head_dim * c.rope_for("full_attention").partial_rotary_factor)
        if rotary > msa.index_head_dim:
            raise ValueError(f"BlockSparseAttention: the attention's rotary dim {rotary} must fit the indexer head "
                             f"(index_head_dim={msa.index_head_dim}); the indexer rotates its first channels")
        self.indexer = MSAIndexer(c.hidden_size, index_n_heads=msa.index_n_heads, index_head_dim=msa.index_head_dim,
                                  index_block_size=msa.block, index_topk_blocks=msa.topk_blocks,
                                  index_local_blocks=msa.local_blocks, rotary_dim=rotary, rope=rope,
                                  eps=c.rms_norm_eps)
        if c.backend == "auto":
            self.backend = self.decode_backend = "gather"

    @classmethod
    def for_decoder(cls, config: DecoderConfig, layer_idx: int,
                    rope: RopeTable | None = None) -> BlockSparseAttention:
        """The MSA mixer of layer ``layer_idx`` of ``config`` (:mod:`qkv.nn.mixer`)."""
        return cls(config, layer_idx, rope)

    kind_name = "MSA"

    def index_step(self, x: torch.Tensor, step: MixerStep, positions: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The indexer keys of the new tokens, normed and rotated at their positions (what a cache keeps)."""
        return self.indexer.keys(x, positions), None

    def selection(self, x: torch.Tensor, context, keys: torch.Tensor, *, q_positions: torch.Tensor,
                  kv_positions: torch.Tensor) -> masks.Mask:
        """Each KV group's kept blocks, as a token list per query head."""
        picked = self.indexer(x, keys, q_positions=q_positions, kv_positions=kv_positions)
        return masks.topk(expand_heads(picked.slots, self.n_heads))
