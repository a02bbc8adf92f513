"""Attention modules and transformer building blocks: modules own weights, the math is :func:`qkv.attention`.

Example:
    >>> import torch
    >>> from qkv.nn import MultiHeadAttention
    >>> attn = MultiHeadAttention(32, 4, n_kv_heads=1, causal=True)
    >>> attn(torch.randn(2, 5, 32)).out.shape
    torch.Size([2, 5, 32])
"""

from ..spec.config import PRESETS, DecoderConfig, RopeParams, TransformerConfig, get_config
from .activations import ACTIVATIONS
from .attention import AttentionModuleOutput, MultiHeadAttention
from .blocks import TransformerBlock
from .decoder import DecoderLM, DecoderOutput
from .dsa import IndexerOutput, LightningIndexer, SparseLatentAttention
from .ffn import FeedForward, GatedMLP
from .latent import LatentAttention, LatentAttentionOutput, LatentConfig
from .linear import LinearAttention
from .moe import MoE, MoEConfig
from .norm import RMSNorm, make_norm, rms_norm
from .performer import PerformerAttention
from .transformer import EncoderDecoder, TransformerDecoder, TransformerEncoder, init_weights

__all__ = [
    "MultiHeadAttention", "AttentionModuleOutput",
    "RMSNorm", "rms_norm", "make_norm", "FeedForward", "GatedMLP", "MoE", "MoEConfig", "ACTIVATIONS",
    "TransformerBlock", "TransformerEncoder", "TransformerDecoder", "EncoderDecoder", "init_weights",
    "DecoderLM", "DecoderConfig", "DecoderOutput", "RopeParams",
    "TransformerConfig", "PRESETS", "get_config",
    "LatentAttention", "LatentAttentionOutput", "LatentConfig", "SparseLatentAttention", "LightningIndexer",
    "IndexerOutput", "LinearAttention", "PerformerAttention",
]
