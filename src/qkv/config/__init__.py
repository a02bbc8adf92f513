"""Model descriptions without torch: what a model is, as data, read once from an HF config.

- :class:`DecoderConfig` (the one decoder, :class:`qkv.nn.DecoderLM`) and :class:`TransformerConfig` (the
  encoder / encoder-decoder stacks), with their named tiny presets (:func:`get_config`);
- :class:`RopeParams` (RoPE as data; :meth:`qkv.pos.RotaryEmbedding.from_params` builds the tensors),
  :class:`LatentConfig` (MLA), :class:`IndexerConfig` (DeepSeek Sparse Attention's indexer), :class:`MoEConfig`
  (DeepSeekMoE), :class:`LinearAttentionConfig` (the recurrent layers of hybrid models);
- the layer types (:data:`FULL_ATTENTION`, :data:`SLIDING_ATTENTION`, :data:`LINEAR_ATTENTION`), and the mixer
  registry (:mod:`qkv.config.mixers`: each kind of layer's cache, parameter and FLOP counts; :func:`mixer_of`);
- the one reader of an HF config (:mod:`qkv.config.hf_config`: :func:`read_layout`, :func:`read_rope`,
  :func:`read_latent`, :func:`read_moe`, :func:`load_hf_config`), used by :mod:`qkv.models`,
  :func:`qkv.cache.plan_memory` and :mod:`qkv.costs` alike;
- :class:`ModelPreset`, a published model: its :class:`DecoderConfig` with its source and notes (:data:`PRESETS`,
  :func:`get_preset`), on which :mod:`qkv.costs` does its arithmetic.

Pure Python: importing it imports neither torch nor any module that does (a test checks it).

Example:
    >>> from qkv.config import get_config, read_layout
    >>> get_config("tiny-gemma").layer_types[:2]
    ('sliding_attention', 'full_attention')
    >>> read_layout({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}).head_dim
    16
"""

from .decoder import DECODER_POSITIONS, DecoderConfig, TransformerConfig, get_config
from .decoder import PRESETS as CONFIG_PRESETS
from .dsa import IndexerConfig
from .hf_config import (
    declared_dtype,
    description_dtype,
    load_hf_config,
    read_indexer,
    read_latent,
    read_layout,
    read_moe,
    read_rope,
)
from .latent import LatentConfig
from .layer_types import FULL_ATTENTION, LAYER_TYPES, LINEAR_ATTENTION, SLIDING_ATTENTION
from .linear import LinearAttentionConfig
from .mixers import MIXERS, CacheShape, MixerKind, get_mixer, mixer_of, register_mixer
from .moe import MoEConfig
from .presets import AMBIGUOUS, PRESETS, ModelPreset, get_preset, preset_from_hf_config
from .rope import ROPE_TYPES, RopeParams

__all__ = [
    "AMBIGUOUS", "CONFIG_PRESETS", "DECODER_POSITIONS", "FULL_ATTENTION", "LAYER_TYPES", "LINEAR_ATTENTION",
    "PRESETS", "ROPE_TYPES", "SLIDING_ATTENTION", "DecoderConfig", "IndexerConfig", "LatentConfig",
    "LinearAttentionConfig", "ModelPreset", "MoEConfig", "RopeParams", "TransformerConfig",
    "declared_dtype", "description_dtype", "get_config", "get_preset", "load_hf_config", "preset_from_hf_config",
    "read_indexer", "read_latent", "read_layout", "read_moe", "read_rope",
    "MIXERS", "CacheShape", "MixerKind", "get_mixer", "mixer_of", "register_mixer",
]
