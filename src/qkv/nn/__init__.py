"""Attention modules and transformer building blocks: modules own weights, the math is :func:`qkv.attention`.

Example:
    >>> import torch
    >>> from qkv.nn import MultiHeadAttention
    >>> attn = MultiHeadAttention(32, 4, n_kv_heads=1, causal=True)
    >>> attn(torch.randn(2, 5, 32)).out.shape
    torch.Size([2, 5, 32])
"""

from .attention import AttentionModuleOutput, MultiHeadAttention
from .blocks import TransformerBlock
from .config import PRESETS, TransformerConfig, get_config
from .ffn import FeedForward
from .latent import LatentAttention, LatentAttentionOutput, LatentConfig
from .linear import LinearAttention
from .norm import RMSNorm, make_norm, rms_norm
from .performer import PerformerAttention
from .transformer import DecoderLM, EncoderDecoder, TransformerDecoder, TransformerEncoder, init_weights

__all__ = [
    "MultiHeadAttention", "AttentionModuleOutput",
    "RMSNorm", "rms_norm", "make_norm", "FeedForward", "TransformerBlock",
    "TransformerEncoder", "TransformerDecoder", "EncoderDecoder", "DecoderLM", "init_weights",
    "TransformerConfig", "PRESETS", "get_config",
    "LatentAttention", "LatentAttentionOutput", "LatentConfig", "LinearAttention", "PerformerAttention",
]
