"""One transformer layer: self attention, optional cross attention, feed-forward, each a residual branch.

Post-norm (Vaswani et al. 2017, BERT): ``x = norm(x + dropout(f(x)))``. Pre-norm (Xiong et al. 2020, "On
Layer Normalization in the Transformer Architecture"; GPT-2 onwards): ``x = x + dropout(f(norm(x)))``,
with one more norm after the last layer (the stacks in :mod:`qkv.nn.transformer` own it).

Shape legend: B batch, N tokens, M context tokens, d model width.

Example:
    >>> import torch
    >>> from qkv.nn import TransformerBlock, TransformerConfig
    >>> cfg = TransformerConfig(d_model=32, n_heads=4, n_layers=1, norm="rms", activation="swiglu")
    >>> block = TransformerBlock(cfg, causal=True, cross_attention=True)
    >>> block(torch.randn(2, 5, 32), torch.randn(2, 7, 32)).shape
    torch.Size([2, 5, 32])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config.decoder import TransformerConfig
from ..pos.relative import PositionalBias
from .attention import MultiHeadAttention
from .ffn import FeedForward
from .norm import make_norm

__all__ = ["TransformerBlock"]


class TransformerBlock(nn.Module):
    """A layer built from a :class:`TransformerConfig`.

    Args:
        config: the stack's config.
        layer_idx: index of this layer (its KV-cache slot and its entry of ``config.layer_types``).
        causal: causal self attention (decoders); a sliding layer then uses ``config.sliding_window``.
        cross_attention: add a cross-attention branch over ``context`` (encoder-decoder decoders).
        rope: a :class:`qkv.pos.RotaryEmbedding` for self attention, or None.
        position_bias: a :class:`qkv.pos.PositionalBias` for self attention (may be shared by layers), or None.

    ``forward(x, context=None, *, mask=None, context_mask=None, positions=None, cache=None)``:
        x (B, N, d); context (B, M, d) for cross attention; mask / context_mask :mod:`qkv.masks` masks for
        self / cross attention; positions (N,) or (B, N) int64; cache a ``qkv.cache`` cache. Returns (B, N, d).
    """

    def __init__(self, config: TransformerConfig, *, layer_idx: int = 0, causal: bool = False,
                 cross_attention: bool = False, rope: Callable | None = None,
                 position_bias: PositionalBias | None = None) -> None:
        super().__init__()
        c = config
        window = c.window_for(layer_idx)
        if window is not None and not causal:
            raise ValueError(f"TransformerBlock: layer {layer_idx} is a sliding_attention layer but the block is not "
                             "causal; bidirectional local attention goes through a mask "
                             "(qkv.masks.sliding_window(left, right))")
        common = dict(n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, bias=c.attention_bias, qk_norm=c.qk_norm,
                      qk_norm_eps=c.norm_eps, scale=c.attention_scale, dropout=c.attention_dropout,
                      backend=c.backend, layer_idx=layer_idx)
        self.norm_first = c.norm_first
        self.self_attn = MultiHeadAttention(c.d_model, c.n_heads, rope=rope, position_bias=position_bias,
                                            causal=causal, window=window, **common)
        self.attn_norm = make_norm(c.norm, c.d_model, eps=c.norm_eps)
        self.cross_attn = MultiHeadAttention(c.d_model, c.n_heads, cross=True, **common) if cross_attention else None
        self.cross_norm = make_norm(c.norm, c.d_model, eps=c.norm_eps) if cross_attention else None
        self.ffn = FeedForward(c.d_model, c.d_ff, activation=c.activation, bias=c.mlp_bias)
        self.ffn_norm = make_norm(c.norm, c.d_model, eps=c.norm_eps)
        self.dropout = nn.Dropout(c.dropout)

    def _residual(self, x: torch.Tensor, norm: nn.Module, f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.norm_first:
            return x + self.dropout(f(norm(x)))
        return norm(x + self.dropout(f(x)))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, mask=None, context_mask=None,
                positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        x = self._residual(x, self.attn_norm,
                           lambda h: self.self_attn(h, mask=mask, positions=positions, cache=cache).out)
        if self.cross_attn is not None:
            if context is None and cache is None:
                raise ValueError("TransformerBlock: this block has cross attention; pass the encoder output as context")
            x = self._residual(x, self.cross_norm,
                               lambda h: self.cross_attn(h, context, mask=context_mask, cache=cache).out)
        elif context is not None:
            raise ValueError("TransformerBlock: context given but the block has no cross attention "
                             "(build it with cross_attention=True)")
        return self._residual(x, self.ffn_norm, self.ffn)
