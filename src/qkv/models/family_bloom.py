"""BLOOM on qkv: HF ``model_type = "bloom"`` checkpoints (``BloomForCausalLM``, ``BloomModel``).

BigScience 2022, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model". A pre-norm causal
decoder with no position embeddings: ALiBi (Press et al. 2022) adds ``-slope[h] * (p - j)`` to each score,
with the paper's slopes for any head count (:func:`qkv.pos.alibi_slopes`). A LayerNorm follows the token
embedding (``word_embeddings_layernorm``): :class:`qkv.nn.DecoderLM` with ``position="alibi"``,
``embed_norm=True``, ``norm="layer"`` and ``gated_mlp=False``.

HF BLOOM adds ``slope * key_position`` (positions counted over real tokens) rather than ``-slope * (p - j)``;
the two differ by a per-row constant, which softmax ignores. Under left padding and in a KV cache the
distance comes from the tokens' positions (``qkv.pos.ALiBiBias`` reads them), so padding never shifts it.

Checkpoint layout: ``query_key_value`` fuses the projections per head, rows ordered
``[h0: q k v, h1: q k v, ...]``; ``convert`` reorders the rows into the decoder's fused ``qkv_proj``
(all queries, then all keys, then all values).

Example:
    >>> import torch, transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> cfg = transformers.BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4)  # doctest: +SKIP
    >>> lm = from_hf(transformers.BloomForCausalLM(cfg).eval())  # doctest: +SKIP
    >>> lm(torch.tensor([[5, 6, 7]])).logits.shape  # doctest: +SKIP
    torch.Size([1, 3, 100])
"""

from __future__ import annotations

from typing import Any

import torch

from ..nn import DecoderConfig, DecoderLM
from .loading import FAMILIES, CheckpointError, Renamer

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["bloom"] = "qkv.models.family_bloom"


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`qkv.nn.DecoderConfig` of an HF BLOOM config dict."""
    if cfg.get("apply_residual_connection_post_layernorm", False):
        raise CheckpointError("bloom: apply_residual_connection_post_layernorm=True is not supported (the residual "
                              "branch then starts from the normalized input)")
    d = cfg.get("hidden_size", cfg.get("n_embed"))
    try:
        return DecoderConfig(
            vocab_size=cfg["vocab_size"], hidden_size=d,
            num_hidden_layers=cfg.get("n_layer", cfg.get("num_hidden_layers")),
            num_attention_heads=cfg.get("n_head", cfg.get("num_attention_heads")), intermediate_size=4 * d,
            hidden_act="gelu_tanh", gated_mlp=False, norm="layer", layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            position="alibi", embed_norm=True, qkv_bias=True, o_bias=True, mlp_bias=True,
            tie_word_embeddings=cfg.get("tie_word_embeddings", True), name="bloom")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a bloom model from its config: {e}") from e


def build(config: dict[str, Any]) -> DecoderLM:
    """A :class:`qkv.nn.DecoderLM` shaped like the HF BLOOM config."""
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF BLOOM names and layouts to :class:`qkv.nn.DecoderLM` names (``transformer.`` prefixes stripped, the per-head
    fused ``query_key_value`` split, a tied ``lm_head.weight`` dropped). A missing tensor raises
    :class:`CheckpointError` naming it; unknown tensors keep their names (the loader reports them as unexpected)."""
    c = decoder_config(config)
    d, H, D = c.hidden_size, c.num_attention_heads, c.head_dim
    src = {k.removeprefix("transformer."): v for k, v in state.items()}
    r = Renamer(src, "bloom")
    src, out, has, move = r.src, r.out, r.has, r.move

    move("word_embeddings.weight", "embed_tokens.weight")
    for p in ("weight", "bias"):
        move(f"word_embeddings_layernorm.{p}", f"embed_norm.{p}")
        move(f"ln_f.{p}", f"norm.{p}")
        for i in range(c.num_hidden_layers):
            h, q = f"h.{i}.", f"layers.{i}."
            move(f"{h}input_layernorm.{p}", f"{q}attn_norm.{p}")
            move(f"{h}post_attention_layernorm.{p}", f"{q}ffn_norm.{p}")
            move(f"{h}self_attention.dense.{p}", f"{q}self_attn.o_proj.{p}")
            move(f"{h}mlp.dense_h_to_4h.{p}", f"{q}mlp.up_proj.{p}")
            move(f"{h}mlp.dense_4h_to_h.{p}", f"{q}mlp.down_proj.{p}")
            fused = f"{h}self_attention.query_key_value.{p}"
            if has(fused, f"{q}self_attn.qkv_proj.{p}"):
                t = src.pop(fused)
                want = (3 * d, d) if p == "weight" else (3 * d,)
                if tuple(t.shape) != want:
                    raise CheckpointError(f"bloom: {fused} has shape {tuple(t.shape)}, expected {want} for this config")
                t = t.view(H, 3, D, *t.shape[1:]).transpose(0, 1)  # rows per head (q, k, v) -> (q, k, v) per head
                out[f"{q}self_attn.qkv_proj.{p}"] = t.reshape(3 * H * D, *t.shape[3:]).contiguous()
    return r.finish(tie_word_embeddings=c.tie_word_embeddings)
