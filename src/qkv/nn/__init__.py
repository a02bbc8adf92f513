"""Attention modules and transformer building blocks: modules own weights, the math is :func:`qkv.attention`.

Example:
    >>> import torch
    >>> from qkv.nn import MultiHeadAttention
    >>> attn = MultiHeadAttention(32, 4, n_kv_heads=1, causal=True)
    >>> attn(torch.randn(2, 5, 32)).out.shape
    torch.Size([2, 5, 32])
"""

from ..config.decoder import PRESETS, DecoderConfig, RopeParams, TransformerConfig, get_config
from ..config.linear import LinearAttentionConfig
from ._recurrent import RecurrentState
from .activations import ACTIVATIONS
from .attention import AttentionModuleOutput, MultiHeadAttention
from .blocks import TransformerBlock
from .cached import AttentionHeads, cached_attention
from .decoder import DecoderLM, DecoderOutput
from .dsa import IndexerOutput, LightningIndexer, SparseLatentAttention
from .ffn import FeedForward, GatedMLP
from .gated_deltanet import GatedDeltaNet, GatedRMSNorm, SplitGatedDeltaNet
from .gated_residual import GatedResidual
from .kda import KimiDeltaAttention
from .latent import LatentAttention, LatentAttentionOutput, LatentConfig
from .linear import LinearAttention
from .mamba2 import Mamba2Mixer
from .mixer import DecoderMixer
from .mixers import MIXER_MODULES, build_mixer, register_mixer_module
from .moe import MoE, MoEConfig
from .msa import MSAIndexer, MSAOutput
from .ngram_embedding import NGramEmbedding
from .norm import RMSNorm, make_norm, rms_norm
from .packed import packed_documents
from .per_layer_embed import PerLayerBranch, PerLayerInputs
from .performer import PerformerAttention
from .ple import PerLayerEmbedding
from .protocol import AttentionModule, attention_modules
from .qsa import IndexedAttention, QSAIndexer
from .residual import PLAIN_RESIDUAL, PlainResidual, Residual, residual_for
from .self_attention import SelfAttention
from .transformer import EncoderDecoder, TransformerDecoder, TransformerEncoder, init_weights

__all__ = [
    "MultiHeadAttention", "AttentionModuleOutput",
    "PerLayerInputs", "PerLayerBranch",
    "RMSNorm", "rms_norm", "make_norm", "FeedForward", "GatedMLP", "MoE", "MoEConfig", "ACTIVATIONS",
    "TransformerBlock", "TransformerEncoder", "TransformerDecoder", "EncoderDecoder", "init_weights",
    "DecoderLM", "DecoderConfig", "DecoderOutput", "RopeParams", "LinearAttentionConfig",
    "TransformerConfig", "PRESETS", "get_config",
    "LatentAttention", "LatentAttentionOutput", "LatentConfig", "SparseLatentAttention", "LightningIndexer",
    "IndexerOutput", "LinearAttention", "PerformerAttention",
    "AttentionModule", "attention_modules", "packed_documents", "cached_attention", "AttentionHeads",
    "GatedDeltaNet", "SplitGatedDeltaNet", "GatedRMSNorm", "KimiDeltaAttention", "Mamba2Mixer", "RecurrentState",
    "DecoderMixer", "MIXER_MODULES", "SelfAttention", "build_mixer", "register_mixer_module",
    "IndexedAttention", "QSAIndexer", "GatedResidual", "NGramEmbedding", "PerLayerEmbedding",
    "Residual", "PlainResidual", "PLAIN_RESIDUAL", "residual_for",
    "MSAIndexer", "MSAOutput",
]
