"""Positional schemes, each a function first: sinusoidal and learned absolute embeddings, RoPE with the
frequency scalings found in real configs, ALiBi slopes, T5 buckets and Shaw's clipped relative positions.

Absolute schemes are added to token embeddings; RoPE rotates queries and keys (and is the KV cache's
``rope(x, positions)`` callable); ALiBi, T5 and Shaw are score modifiers, wrapped as
:class:`PositionalBias` modules that :class:`qkv.nn.MultiHeadAttention` calls per forward.

Example:
    >>> import torch, qkv
    >>> from qkv import pos
    >>> q = k = v = torch.randn(1, 8, 16, 32)
    >>> rope = pos.RotaryEmbedding(32, theta=10000.0)
    >>> out = qkv.attention(rope.apply(q), rope.apply(k), v, mask=qkv.masks.causal())
    >>> out = qkv.attention(q, k, v, mask=qkv.masks.causal(), score_mod=qkv.mods.alibi(pos.alibi_slopes(8)))
    >>> out.shape
    torch.Size([1, 8, 16, 32])
"""

from .alibi import ALiBiBias, alibi_slopes
from .ids import batch_positions, positions_from_padding
from .learned import LearnedPositionalEmbedding, learned_positions
from .relative import (
    PositionalBias,
    RelativePositionMod,
    ShawKeyBias,
    ShawRelativePosition,
    T5RelativeBias,
    shaw_attention,
    shaw_index,
    shaw_key_bias,
    t5_bucket,
)
from .rope import (
    ROPE_TYPES,
    RotaryEmbedding,
    apply_rotary,
    default_inv_freq,
    dynamic_ntk_inv_freq,
    linear_inv_freq,
    llama3_inv_freq,
    proportional_inv_freq,
    rope,
    yarn_attention_factor,
    yarn_inv_freq,
)
from .sinusoidal import sinusoidal_encoding

__all__ = [
    "batch_positions", "positions_from_padding",
    "sinusoidal_encoding", "LearnedPositionalEmbedding", "learned_positions",
    "RotaryEmbedding", "ROPE_TYPES", "apply_rotary", "rope", "default_inv_freq", "linear_inv_freq",
    "dynamic_ntk_inv_freq", "yarn_inv_freq", "yarn_attention_factor", "llama3_inv_freq", "proportional_inv_freq",
    "alibi_slopes", "ALiBiBias",
    "PositionalBias", "RelativePositionMod", "t5_bucket", "T5RelativeBias", "shaw_index", "ShawKeyBias",
    "shaw_key_bias", "shaw_attention", "ShawRelativePosition",
]
