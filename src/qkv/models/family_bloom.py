"""BLOOM on qkv: HF ``model_type = "bloom"`` checkpoints (``BloomForCausalLM``, ``BloomModel``).

BigScience 2022, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model". A pre-norm causal
decoder with no position embeddings: ALiBi (Press et al. 2022) adds ``-slope[h] * (p - j)`` to each score,
with the paper's slopes for any head count (:func:`qkv.pos.alibi_slopes`). A LayerNorm follows the token
embedding (``word_embeddings_layernorm``), which :class:`BloomLM` adds to :class:`qkv.nn.DecoderLM`.

HF BLOOM adds ``slope * key_position`` (positions counted over real tokens) rather than ``-slope * (p - j)``;
the two differ by a per-row constant, which softmax ignores. Under left padding and in a KV cache the
distance comes from the tokens' positions (``qkv.pos.ALiBiBias`` reads them), so padding never shifts it.

Checkpoint layout: ``query_key_value`` fuses the projections per head, rows ordered
``[h0: q k v, h1: q k v, ...]``; ``convert`` splits them into ``q_proj``, ``k_proj``, ``v_proj``.

Example:
    >>> import torch, transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> cfg = transformers.BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4)  # doctest: +SKIP
    >>> lm = from_hf(transformers.BloomForCausalLM(cfg).eval())  # doctest: +SKIP
    >>> lm(torch.tensor([[5, 6, 7]])).shape  # doctest: +SKIP
    torch.Size([1, 3, 100])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..nn import DecoderLM, TransformerConfig
from .loading import FAMILIES, CheckpointError, Renamer

__all__ = ["BloomLM", "build", "convert"]

FAMILIES["bloom"] = "qkv.models.family_bloom"


class BloomLM(DecoderLM):
    """:class:`qkv.nn.DecoderLM` with ALiBi and BLOOM's LayerNorm on the token embeddings.

    Same ``forward(input_ids, *, positions=None, cache=None) -> logits`` and ``cache_specs()``.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.embed_norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super()._embed(ids))


def _transformer_config(cfg: dict[str, Any]) -> TransformerConfig:
    if cfg.get("apply_residual_connection_post_layernorm", False):
        raise CheckpointError("bloom: apply_residual_connection_post_layernorm=True is not supported (the residual "
                              "branch then starts from the normalized input)")
    d = cfg.get("hidden_size", cfg.get("n_embed"))
    return TransformerConfig(
        d_model=d, n_heads=cfg.get("n_head", cfg.get("num_attention_heads")),
        n_layers=cfg.get("n_layer", cfg.get("num_hidden_layers")), d_ff=4 * d, activation="gelu_tanh",
        norm="layer", norm_eps=cfg.get("layer_norm_epsilon", 1e-5), norm_first=True, position="alibi",
        vocab_size=cfg["vocab_size"], tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        dropout=cfg.get("hidden_dropout", 0.0), attention_dropout=cfg.get("attention_dropout", 0.0),
        initializer_range=cfg.get("initializer_range", 0.02), name="bloom")


def build(config: dict[str, Any]) -> nn.Module:
    """A :class:`BloomLM` shaped like the HF BLOOM config."""
    return BloomLM(_transformer_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF BLOOM names and layouts to :class:`BloomLM` names (``transformer.`` prefixes stripped, the per-head
    fused ``query_key_value`` split, a tied ``lm_head.weight`` dropped). A missing tensor raises
    :class:`CheckpointError` naming it; unknown tensors keep their names (the loader reports them as unexpected)."""
    tc = _transformer_config(config)
    d, H, D = tc.d_model, tc.n_heads, tc.head_dim
    src = {k.removeprefix("transformer."): v for k, v in state.items()}
    r = Renamer(src, "bloom")
    src, out, has, move = r.src, r.out, r.has, r.move

    move("word_embeddings.weight", "embed_tokens.weight")
    for p in ("weight", "bias"):
        move(f"word_embeddings_layernorm.{p}", f"embed_norm.{p}")
        move(f"ln_f.{p}", f"decoder.norm.{p}")
        for i in range(tc.n_layers):
            h, q = f"h.{i}.", f"decoder.layers.{i}."
            move(f"{h}input_layernorm.{p}", f"{q}attn_norm.{p}")
            move(f"{h}post_attention_layernorm.{p}", f"{q}ffn_norm.{p}")
            move(f"{h}self_attention.dense.{p}", f"{q}self_attn.o_proj.{p}")
            move(f"{h}mlp.dense_h_to_4h.{p}", f"{q}ffn.up_proj.{p}")
            move(f"{h}mlp.dense_4h_to_h.{p}", f"{q}ffn.down_proj.{p}")
            fused = f"{h}self_attention.query_key_value.{p}"
            if has(fused, f"{q}self_attn.q_proj/k_proj/v_proj.{p}"):
                t = src.pop(fused)
                want = (3 * d, d) if p == "weight" else (3 * d,)
                if tuple(t.shape) != want:
                    raise CheckpointError(f"bloom: {fused} has shape {tuple(t.shape)}, expected {want} for this config")
                t = t.view(H, 3, D, *t.shape[1:])  # rows per head: q, k, v
                for j, name in enumerate(("q", "k", "v")):
                    out[f"{q}self_attn.{name}_proj.{p}"] = t[:, j].reshape(H * D, *t.shape[3:]).contiguous()
    return r.finish(tie_word_embeddings=tc.tie_word_embeddings)
