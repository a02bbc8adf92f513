"""Qwen4-Exp on qkv: HF ``model_type`` ``"qwen4_exp_text"``, and ``"qwen4_exp"`` (the multimodal checkpoint, whose
language model is read from its ``text_config``; the vision tower is not loaded).

A hybrid decoder (Qwen Team 2026, "Qwen4-Exp" model card) on Qwen3.5's recurrent layers:

- ``linear_attention`` layers: Gated DeltaNet with Qwen3.5's split projections (:class:`qkv.nn.SplitGatedDeltaNet`);
- ``indexed_attention`` layers (HF also writes ``full_attention`` for them): QSA (:class:`qkv.nn.IndexedAttention`),
  Qwen3-Next's gated attention (output gate, per-head QK RMSNorm, partial RoPE) reading only the tokens a block
  indexer keeps (``indexer_*``);
- the residual: ``hc_count`` streams joined by gated hyper-connections (:class:`qkv.nn.GatedResidual`), which also
  normalize each block's input (no ``input_layernorm`` / ``post_attention_layernorm``), and no final norm: the
  model's last connection reads the streams out for the LM head;
- Per-Layer Embedding on ``ple_layer_ids`` (1-indexed, recurrent layers only): hashed n-gram embeddings gated into
  the streams before the layer (:class:`qkv.nn.PerLayerEmbedding`);
- feed-forward: Qwen3-Next's mixture (softmax top-k, renormalized with ``norm_topk_prob``, one shared expert
  scaled by ``sigmoid(shared_expert_gate(x))``) on every layer; every RMSNorm scales by ``1 + weight`` but the
  recurrent layers' gated norm.

The multimodal RoPE (``mrope_section``) gives a text token the same position on its three axes: plain RoPE.

Tensor names: attention and experts as :mod:`qkv.models.family_qwen3_next`; ``attn_hyper_connection`` becomes
``attn_residual``, ``mlp_hyper_connection`` ``ffn_residual``, the model's ``hyper_connection_mixer`` ``residual``;
``ple.*`` and ``self_attn.indexer.*`` keep HF's names. The n-gram tables' primes and multipliers, buffers in HF's
state dict, are recomputed from the config and must agree with the checkpoint's. MTP and vision weights are
dropped.

Example:
    >>> cfg = decoder_config({"model_type": "qwen4_exp_text", "vocab_size": 100, "hidden_size": 32,
    ...     "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    ...     "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
    ...     "indexer_compress_ratio": 2, "num_experts": 4, "num_experts_per_tok": 2, "hc_count": 2,
    ...     "hc_lowrank": 8, "ple_layer_ids": [1], "ple_embed_dim": 16, "eos_token_id": 1})
    >>> cfg.layer_types, cfg.gated_residual.streams, cfg.ple.layers, cfg.qsa.block_topk
    (('linear_attention', 'linear_attention', 'linear_attention', 'full_attention'), 2, (0,), 2)
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.gated_residual import GatedResidualConfig
from ..config.hf_config import INDEXED_ATTENTION, read_moe, read_qsa, text_config
from ..config.layer_types import FULL_ATTENTION
from ..config.ple import PLEConfig
from ..nn import DecoderConfig, DecoderLM
from ..nn.ngram_embedding import ngram_hash_tables, ngram_multipliers
from .family_qwen3_next import language_model_state, split_query_gates
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

MODEL_TYPES = ("qwen4_exp_text", "qwen4_exp")
for _t in MODEL_TYPES:
    FAMILIES[_t] = "qkv.models.family_qwen4_exp"

#: HF's defaults (``Qwen4ExpTextConfig``) for the keys a config.json may leave out.
_DEFAULTS = {"vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
             "num_key_value_heads": 2, "head_dim": 256, "hc_count": 4, "hc_lowrank": 320, "ple_conv_kernel_size": 4,
             "ngram_size": 3, "heads_per_ngram": 8, "ngram_vocab_size_base": 20_000_000,
             "make_ngram_vocab_size_divisible_by": 128, "seed": 1234, "hidden_act": "silu"}
_RENAMES = {".attn_hyper_connection.": ".attn_residual.", ".mlp_hyper_connection.": ".ffn_residual.",
            ".mlp.shared_expert.": ".mlp.shared_experts.", ".hyper_connection_mixer.": ".residual."}


def _text(cfg: dict[str, Any]) -> dict[str, Any]:
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise CheckpointError(f"family_qwen4_exp: model_type {kind!r} is not one of {MODEL_TYPES}")
    if kind == "qwen4_exp":
        if not isinstance(cfg.get("text_config"), dict):
            raise CheckpointError(f"from_hf: a qwen4_exp config needs its language model's text_config (a dict), got "
                                  f"{type(cfg.get('text_config')).__name__}")
        text = text_config(cfg)
        if "tie_word_embeddings" in cfg:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    else:
        text = dict(cfg)
    text = {**_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    if text.get("layer_types") is not None:  # HF reads "full_attention" layers as indexed ones
        text["layer_types"] = [INDEXED_ATTENTION if t == FULL_ATTENTION else t for t in text["layer_types"]]
    return text


def _ple(text: dict[str, Any]) -> PLEConfig | None:
    ids = list(text.get("ple_layer_ids") or [])
    if not ids:
        return None
    eos = text.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int):
        raise CheckpointError(f"from_hf: qwen4_exp PLE layers {ids} need eos_token_id (n-grams stop at it), got "
                              f"{text.get('eos_token_id')!r}")
    n = text["num_hidden_layers"]
    bad = [i for i in ids if not isinstance(i, int) or not 1 <= i <= n]
    if bad:
        raise CheckpointError(f"from_hf: ple_layer_ids count layers from 1 to num_hidden_layers={n}; got {bad}")
    return PLEConfig(layers=tuple(i - 1 for i in ids), embed_dim=text.get("ple_embed_dim") or text["hidden_size"],
                     eos_token_id=eos, conv_kernel_size=text["ple_conv_kernel_size"], ngram_size=text["ngram_size"],
                     heads_per_ngram=text["heads_per_ngram"], ngram_vocab_size_base=text["ngram_vocab_size_base"],
                     pad_to=text["make_ngram_vocab_size_divisible_by"], seed=text["seed"])


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF Qwen4-Exp text (or multimodal) config dict."""
    text = _text(cfg)
    gate = text.get("output_gate_type") or text["hidden_act"]
    if gate != "silu":
        raise CheckpointError(f"from_hf: qwen4_exp with output_gate_type={gate!r}: qkv's Gated DeltaNet gates its "
                              "output norm with SiLU only")
    try:
        qsa, moe = read_qsa(text), read_moe(text)
        ple = _ple(text)
        residual = GatedResidualConfig(streams=text["hc_count"], rank=text["hc_lowrank"])
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"from_hf: cannot build a qwen4_exp model from its config: {e}") from e
    if qsa is None:
        raise CheckpointError("from_hf: qwen4_exp's attention layers are QSA layers; the config lacks their indexer "
                              "(indexer_n_heads, indexer_kv_heads, indexer_head_dim, indexer_budget, "
                              "indexer_compress_ratio)")
    text["intermediate_size"] = moe.moe_intermediate_size  # no dense MLP: the field is unused
    bias = bool(text.get("attention_bias", False))
    return decoder_config_from(text, partial_rotary=True, hidden_act=text["hidden_act"], qkv_bias=bias, o_bias=bias,
                               qk_norm=True, norm_offset=1.0, attn_output_gate=True, moe=moe, qsa=qsa,
                               gated_residual=residual, ple=ple, pre_norms=False, final_norm=False)


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    c = decoder_config(config)
    src = language_model_state(state)
    gates = split_query_gates(src, c)
    for name in list(src):
        new = name
        for a, b in _RENAMES.items():
            new = new.replace(a, b)
        if new != name:
            src[new] = src.pop(name)
    out = rename_decoder(src, c, norms={})
    for name, g in gates.items():
        if name in out:
            out[name] = torch.cat([out[name], g])
    if c.ple is not None:
        _hash_buffers(out, c)
    return out


def _hash_buffers(out: dict[str, torch.Tensor], c: DecoderConfig) -> None:
    """The n-gram hash buffers of every PLE layer: recomputed from the config; a checkpoint's that differ are
    refused (its tables would hash to other rows than the config says)."""
    p = c.ple
    for i in p.layers:
        j = p.index_of(i)
        sizes, offsets = ngram_hash_tables(p.ngram_vocab_size_base, p.ngram_heads, j)
        want = {"layer_multipliers": ngram_multipliers(c.vocab_size, p.ngram_size, j, p.seed),
                "ngram_heads_vocab_sizes": sizes, "ngram_heads_offsets": offsets}
        for buf, values in want.items():
            name = f"layers.{i}.ple.ple_embedding.{buf}"
            expected = torch.tensor(values, dtype=torch.long)
            if name in out and not torch.equal(out[name].to(torch.long), expected):
                raise CheckpointError(f"from_hf: {name} = {out[name].tolist()} differs from what the config gives, "
                                      f"{values} (seed={p.seed}, ngram_vocab_size_base={p.ngram_vocab_size_base}); "
                                      "the checkpoint and its config disagree")
            out[name] = expected
