"""GLM-5 on qkv: HF ``model_type`` ``"glm_moe_dsa"``.

Zhipu AI / Z.ai 2026, "GLM-5" (model card ``zai-org/GLM-5``; transformers 5.25 ``GlmMoeDsaForCausalLM``).
DeepSeek-V3.2's architecture (:mod:`qkv.models.family_deepseek_v32`: MLA with q-LoRA, sigmoid ``noaux_tc`` routing,
DeepSeek Sparse Attention on every layer) with two differences in the lightning indexer: its RoPE channels rotate in
*interleaved* pairs (V3.2's indexer: half-split), and HF's ``indexer_types`` may mark a layer ``"shared"``, reusing
the previous layer's top-k instead of running its own indexer (IndexCache, arXiv:2603.12201). The selection is
:func:`qkv.sparse.select.dsa_select`'s point of the selection space (weighted ReLU heads, tokens, shared by all
heads).

qkv reads configs whose every layer runs its indexer (``indexer_types`` all ``"full"``: HF's default schedule,
``index_topk_freq = 1``, which the ``glm-5`` preset's checkpoint config uses); a config with ``"shared"`` layers is
refused with a :class:`CheckpointError` naming them, never run with a silently different selection.

Tensor names as DeepSeek-V3.2's (``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`` unchanged).

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24,
    ...     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=1,
    ...     topk_group=1, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
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

FAMILIES["glm_moe_dsa"] = "qkv.models.family_glm_moe_dsa"


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF GLM-5 config dict; ``CheckpointError`` naming what is wrong.

    Example:
        >>> decoder_config({"model_type": "glm_moe_dsa", "num_hidden_layers": 2, "hidden_size": 64,
        ...     "num_attention_heads": 4, "vocab_size": 32, "intermediate_size": 64, "kv_lora_rank": 16,
        ...     "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        ...     "index_topk": 4, "index_head_dim": 16, "index_n_heads": 2}).indexer.interleaved_rope
        True
    """
    if cfg.get("model_type") != "glm_moe_dsa":
        raise CheckpointError(f"family_glm_moe_dsa: model_type {cfg.get('model_type')!r} is not glm_moe_dsa")
    shared = [i for i, t in enumerate(cfg.get("indexer_types") or []) if t != "full"]
    if shared:
        raise CheckpointError(f"from_hf: glm_moe_dsa indexer_types marks layers {shared} "
                              f"{sorted({cfg['indexer_types'][i] for i in shared})} (reusing an earlier layer's "
                              "top-k); qkv runs every layer's own indexer only: use a config whose indexer_types "
                              "are all 'full' (index_topk_freq=1)")
    try:
        latent = LatentConfig.from_hf(cfg)
        moe = read_moe(cfg)
        indexer = read_indexer(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a glm_moe_dsa model from its config: {e}") from e
    n = cfg.get("num_hidden_layers")
    given = cfg.get("mlp_layer_types")
    if given is not None and isinstance(n, int):
        expected = ["sparse" if moe is not None and moe.is_moe(i) else "dense" for i in range(n)]
        if list(given) != expected:
            raise CheckpointError(f"from_hf: glm_moe_dsa mlp_layer_types={list(given)} is not the pattern "
                                  f"first_k_dense_replace gives ({expected}); qkv builds that pattern only")
    return decoder_config_from(cfg, head_dim=None, hidden_act=cfg.get("hidden_act", "silu"), latent=latent,
                               moe=moe, indexer=indexer, interleaved_rope=True)


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's renaming (the indexer's tensors keep their names under ``self_attn``)."""
    return family_deepseek_v3.rename(state, decoder_config(config))
