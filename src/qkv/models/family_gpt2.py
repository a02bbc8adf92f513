"""GPT-2 on qkv: HF ``model_type = "gpt2"`` checkpoints (``GPT2LMHeadModel``, ``GPT2Model``).

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners". A pre-norm causal decoder with
learned absolute positions, LayerNorm, a tanh-GELU MLP and an LM head tied to the token embedding: exactly
:class:`qkv.nn.DecoderLM` with ``position="learned"``, ``norm="layer"`` and ``gated_mlp=False``, so it
implements the ``DecoderModel`` protocol that :func:`qkv.models.generate.generate` drives (left padding:
positions ``-1`` on padding, ``0, 1, ...`` from each row's first real token, as HF ``generate`` numbers them).

Checkpoint layout: HF stores projections as ``Conv1D`` (weight ``(in, out)``, the transpose of
``nn.Linear``) and fuses the query, key and value projections into ``c_attn`` ``(d, 3d)``, which ``convert``
transposes into the decoder's fused ``qkv_proj``. ``scale_attn_by_inverse_layer_idx`` (scores divided by
``layer + 1``) and
``scale_attn_weights=False`` (no ``1/sqrt(D)``) set each layer's score scale.

Example:
    >>> import torch, transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf, generate  # doctest: +SKIP
    >>> cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4)  # doctest: +SKIP
    >>> hf = transformers.GPT2LMHeadModel(cfg).eval()  # doctest: +SKIP
    >>> generate(from_hf(hf), torch.tensor([[464, 3290]]), max_new_tokens=5).new_tokens.shape  # doctest: +SKIP
    torch.Size([1, 5])
"""

from __future__ import annotations

from typing import Any

import torch

from ..nn import DecoderConfig, DecoderLM
from .loading import FAMILIES, CheckpointError, Renamer

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["gpt2"] = "qkv.models.family_gpt2"

_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "silu", "swish")  # HF activation_function


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`qkv.nn.DecoderConfig` of an HF GPT-2 config dict."""
    if cfg.get("add_cross_attention"):
        raise CheckpointError("gpt2: add_cross_attention=True (GPT-2 as a seq2seq decoder) is not supported")
    act = cfg.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"gpt2: activation_function={act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    d = cfg.get("n_embd", cfg.get("hidden_size"))
    try:
        return DecoderConfig(
            vocab_size=cfg["vocab_size"], hidden_size=d,
            num_hidden_layers=cfg.get("n_layer", cfg.get("num_hidden_layers")),
            num_attention_heads=cfg.get("n_head", cfg.get("num_attention_heads")),
            intermediate_size=cfg.get("n_inner") or 4 * d, hidden_act=act, gated_mlp=False, norm="layer",
            layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-5), position="learned",
            max_position_embeddings=cfg.get("n_positions", cfg.get("max_position_embeddings", 1024)),
            qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            name="gpt2")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a gpt2 model from its config: {e}") from e


def build(config: dict[str, Any]) -> DecoderLM:
    """A :class:`qkv.nn.DecoderLM` shaped like the HF GPT-2 config, with GPT-2's per-layer score scales."""
    c = decoder_config(config)
    model = DecoderLM(c)
    for i, layer in enumerate(model.layers):
        scale = c.head_dim ** -0.5 if config.get("scale_attn_weights", True) else 1.0
        if config.get("scale_attn_by_inverse_layer_idx", False):
            scale /= i + 1
        layer.self_attn.scale = scale
    return model


def _conv1d(state: dict[str, torch.Tensor], name: str, shape: tuple[int, int]) -> torch.Tensor:
    """An HF Conv1D weight ``(in, out)`` as an ``nn.Linear`` weight ``(out, in)``, shape-checked by HF name."""
    w = state.pop(name)
    if tuple(w.shape) != shape:
        raise CheckpointError(f"gpt2: {name} has shape {tuple(w.shape)}, expected {shape} for this config")
    return w.t().contiguous()


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF GPT-2 names and layouts to :class:`qkv.nn.DecoderLM` names. ``transformer.`` prefixes are stripped,
    the causal-mask buffers old checkpoints carry (``attn.bias``, ``attn.masked_bias``) dropped, and a tied
    ``lm_head.weight`` (a copy of ``wte``) dropped. A missing tensor raises :class:`CheckpointError` naming it;
    unknown tensors keep their names, so the loader reports them as unexpected."""
    c = decoder_config(config)
    d, f = c.hidden_size, c.intermediate_size
    src = {k.removeprefix("transformer."): v for k, v in state.items()}
    src = {k: v for k, v in src.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    r = Renamer(src, "gpt2")
    src, out, has, move = r.src, r.out, r.has, r.move

    move("wte.weight", "embed_tokens.weight")
    move("wpe.weight", "pos_embed.weight")
    for p in ("weight", "bias"):
        move(f"ln_f.{p}", f"norm.{p}")
    for i in range(c.num_hidden_layers):
        h, q = f"h.{i}.", f"layers.{i}."
        for p in ("weight", "bias"):
            move(f"{h}ln_1.{p}", f"{q}attn_norm.{p}")
            move(f"{h}ln_2.{p}", f"{q}ffn_norm.{p}")
        if has(f"{h}attn.c_attn.weight", f"{q}self_attn.qkv_proj.weight"):  # rows q, k, v: the fused layout
            out[f"{q}self_attn.qkv_proj.weight"] = _conv1d(src, f"{h}attn.c_attn.weight", (d, 3 * d))
        if has(f"{h}attn.c_attn.bias", f"{q}self_attn.qkv_proj.bias"):
            b = src.pop(f"{h}attn.c_attn.bias")
            if tuple(b.shape) != (3 * d,):
                raise CheckpointError(f"gpt2: {h}attn.c_attn.bias has shape {tuple(b.shape)}, expected ({3 * d},)")
            out[f"{q}self_attn.qkv_proj.bias"] = b
        for hf, qkv, shape in ((f"{h}attn.c_proj", f"{q}self_attn.o_proj", (d, d)),
                               (f"{h}mlp.c_fc", f"{q}mlp.up_proj", (d, f)),
                               (f"{h}mlp.c_proj", f"{q}mlp.down_proj", (f, d))):
            if has(f"{hf}.weight", f"{qkv}.weight"):
                out[f"{qkv}.weight"] = _conv1d(src, f"{hf}.weight", shape)
            move(f"{hf}.bias", f"{qkv}.bias")
    return r.finish(tie_word_embeddings=c.tie_word_embeddings)
