"""DeepSeek-V3.2 on qkv: HF ``model_type`` ``"deepseek_v32"``.

DeepSeek-AI 2025, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek Sparse Attention". The
DeepSeek-V3 model (:mod:`qkv.models.family_deepseek_v3`: MLA with q-LoRA, sigmoid ``noaux_tc`` routing, YaRN
mscale) whose every attention layer is DeepSeek Sparse Attention (:class:`qkv.nn.SparseLatentAttention`): a
lightning indexer (``index_n_heads`` heads of ``index_head_dim``, reading MLA's query latent) picks the
``index_topk`` cached latents each query attends to. HF's ``layer_types`` say ``"indexed_attention"`` for those
layers; the cache keeps each token's indexer key beside its latent (:class:`qkv.cache.IndexedLatentSpec`), so
``model.cache_specs()``, ``plan_memory`` and ``qkv memory`` count it.

As HF's ``DeepseekV32Attention``: MLA's RoPE pairs are always interleaved (``rope_interleave`` is not read), the
indexer's are half-split; ``mlp_layer_types`` must be the dense-then-MoE pattern ``first_k_dense_replace`` gives.
Tensor names as DeepSeek-V3's, plus ``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`` unchanged.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24,
    ...     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=4,
    ...     topk_group=2, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
    ...     index_n_heads=4, index_head_dim=16, index_topk=8))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.hf_config import read_indexer, read_moe
from ..nn import DecoderConfig, DecoderLM, LatentConfig
from . import family_deepseek_v3
from .hf import decoder_config as decoder_config_from
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["deepseek_v32"] = "qkv.models.family_deepseek_v32"


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF DeepSeek-V3.2 config dict; ``CheckpointError`` naming what is wrong."""
    if cfg.get("model_type") != "deepseek_v32":
        raise CheckpointError(f"family_deepseek_v32: model_type {cfg.get('model_type')!r} is not deepseek_v32")
    try:
        latent = LatentConfig.from_hf(cfg)
        moe = read_moe(cfg)
        indexer = read_indexer(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a deepseek_v32 model from its config: {e}") from e
    n = cfg.get("num_hidden_layers")
    given = cfg.get("mlp_layer_types")
    if given is not None and isinstance(n, int) and moe is not None:
        expected = ["sparse" if moe.is_moe(i) else "dense" for i in range(n)]
        if list(given) != expected:
            raise CheckpointError(f"from_hf: deepseek_v32 mlp_layer_types={list(given)} is not the pattern "
                                  f"first_k_dense_replace={moe.first_k_dense_replace} gives ({expected}); qkv builds "
                                  "that pattern only")
    return decoder_config_from(cfg, head_dim=None, hidden_act=cfg.get("hidden_act", "silu"), latent=latent,
                               moe=moe, indexer=indexer, interleaved_rope=True)


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's renaming (the indexer's tensors keep their names under ``self_attn``)."""
    return family_deepseek_v3.rename(state, decoder_config(config))
