"""Cost arithmetic for attention: KV-cache bytes, attention FLOPs, score-matrix sizes, model presets.

Whole models too: parameter counts (:mod:`.params`), prefill/decode/training and generation FLOPs with
attention beside the rest (:mod:`.model_flops`), sparse-pattern and linear-attention FLOPs
(:mod:`.sparse_flops`), compressed attention (DeepSeek-V4's sliding / CSA / HCA beside DSA and dense,
:mod:`.compressed`). Pure Python: importing it does not import torch. Conventions (each documented in its module):
``128k`` = 131,072 tokens; GB = 1e9 bytes and GiB = 2**30; attention FLOPs ``4 * B * Hq * Nq * Nk * D``,
half when causal with ``Nq == Nk``; training = 3.5 x forward (FlashAttention-2's count).

Example:
    >>> from qkv.costs import PRESETS, format_bytes, kv_cache_memory, parse_context
    >>> m = kv_cache_memory(PRESETS["llama-3-70b"], context=parse_context("128k"), dtype="bf16")
    >>> format_bytes(m.total_bytes), m.fits
    ('42.95 GB', {24: False, 80: True, 141: True})
"""

from ..config.presets import AMBIGUOUS, PRESETS, ModelPreset, get_preset, preset_from_hf_config
from .compressed import (
    SchemeCost,
    compressed_pairs,
    csa_cost,
    dense_cost,
    dsa_cost,
    hca_cost,
    sliding_cost,
    sliding_pairs,
)
from .dsa import (
    DSALayerFlops,
    DSAModelFlops,
    dsa_crossover_context,
    dsa_indexer_bytes,
    dsa_indexer_flops,
    dsa_layer_flops,
    dsa_model_flops,
    topk_attention_bytes,
    topk_attention_flops,
    topk_pairs,
)
from .flops import (
    TRAINING_MULTIPLIER,
    AttentionFlops,
    attention_flops,
    mla_absorbed_flops,
    model_attention_flops,
    score_elements,
)
from .memory import (
    DEVICE_GB,
    KVMemory,
    LayerKV,
    element_bytes,
    gqa_kv_bytes_per_token,
    kv_cache_memory,
    mla_kv_bytes_per_token,
)
from .model_flops import (
    FlopBreakdown,
    GenerationFlops,
    ModelFlops,
    crossover_context,
    forward_flops,
    generation_flops,
    model_flops,
)
from .params import ParamCount, num_parameters
from .sparse_flops import (
    bigbird_pairs,
    fixed_pairs,
    linear_attention_flops,
    longformer_pairs,
    pairs_flops,
    performer_flops,
    strided_pairs,
    window_pairs,
)
from .units import DTYPE_BYTES, GB, GiB, format_bytes, format_flops, parse_context, parse_dtype

__all__ = [
    "SchemeCost",
    "compressed_pairs",
    "csa_cost",
    "dense_cost",
    "dsa_cost",
    "hca_cost",
    "sliding_cost",
    "sliding_pairs",
    "DSALayerFlops",
    "dsa_indexer_bytes",
    "dsa_indexer_flops",
    "dsa_layer_flops",
    "dsa_crossover_context",
    "dsa_model_flops",
    "DSAModelFlops",
    "topk_attention_bytes",
    "topk_attention_flops",
    "topk_pairs",
    "AMBIGUOUS",
    "DEVICE_GB",
    "DTYPE_BYTES",
    "GB",
    "PRESETS",
    "TRAINING_MULTIPLIER",
    "AttentionFlops",
    "FlopBreakdown",
    "GenerationFlops",
    "ModelFlops",
    "ParamCount",
    "GiB",
    "KVMemory",
    "LayerKV",
    "ModelPreset",
    "attention_flops",
    "bigbird_pairs",
    "crossover_context",
    "element_bytes",
    "format_bytes",
    "fixed_pairs",
    "format_flops",
    "forward_flops",
    "generation_flops",
    "get_preset",
    "gqa_kv_bytes_per_token",
    "kv_cache_memory",
    "linear_attention_flops",
    "longformer_pairs",
    "mla_absorbed_flops",
    "mla_kv_bytes_per_token",
    "model_attention_flops",
    "model_flops",
    "num_parameters",
    "pairs_flops",
    "parse_context",
    "parse_dtype",
    "performer_flops",
    "preset_from_hf_config",
    "score_elements",
    "strided_pairs",
    "window_pairs",
]
