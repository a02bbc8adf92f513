"""T5 on qkv: HF ``model_type = "t5"`` checkpoints (``T5ForConditionalGeneration``, ``T5Model``,
``T5EncoderModel``; T5 v1.0 and v1.1 / Flan-T5 layouts).

Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer".
An encoder-decoder of pre-norm blocks with RMS norms (no bias, no centering), no position embeddings:
each stack's first layer owns a learned bias per (relative-distance bucket, head) that every layer of the
stack adds to its self-attention scores (:class:`qkv.pos.T5RelativeBias`: bidirectional buckets in the
encoder, causal ones in the decoder). Scores are not scaled by ``1/sqrt(D)``. Cross attention has no
position bias. The stacks are :class:`qkv.nn.TransformerEncoder` / :class:`qkv.nn.TransformerDecoder`;
the glue here is the feed-forward (v1.1's gated GELU is the tanh approximation, ``gelu_new``), the shared
embedding, separate encoder/decoder depths, and the LM head: tied to the embedding with the decoder output
scaled by ``d_model ** -0.5`` (v1.0), or a separate unscaled matrix (v1.1, ``tie_word_embeddings=False``).

Decoding (:meth:`T5.generate`): the encoder runs once; each decoder layer's cross-attention keys and values
are computed on the first step and kept in the cache (``cache.cross_kv``); self-attention keys/values grow
one token per step, and the relative bias reads the cached tokens' positions.

Shape legend: B batch, S source tokens, T target tokens, d model width, V vocabulary.

Example:
    >>> import torch, transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=64, d_model=32, d_kv=8,
    ...     d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)).eval()  # doctest: +SKIP
    >>> out = from_hf(hf).generate(torch.tensor([[5, 6, 7, 1]]), max_new_tokens=4, eos_token_id=None)  # doctest: +SKIP
    >>> out.sequences.shape  # doctest: +SKIP
    torch.Size([1, 5])
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import masks
from ..nn import FeedForward, TransformerConfig, TransformerDecoder, TransformerEncoder
from .loading import FAMILIES, CheckpointError

__all__ = ["T5", "T5Encoder", "Seq2SeqOutput", "build", "convert"]

FAMILIES["t5"] = "qkv.models.family_t5"

# HF ``dense_act_fn`` -> the function (T5 v1.1's "gated-gelu" means gelu_new, the tanh approximation).
_ACT_FN = {"relu": F.relu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
           "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "swish": F.silu}


class Seq2SeqOutput(NamedTuple):
    """What :meth:`T5.generate` returns.

    sequences: (B, 1 + T) the decoder start token, then the generated tokens (HF ``generate``'s layout).
    new_tokens: (B, T) the generated tokens (``pad_token_id`` after a row emitted ``eos_token_id``).
    finished: (B,) bool, rows that emitted ``eos_token_id``.
    """

    sequences: torch.Tensor
    new_tokens: torch.Tensor
    finished: torch.Tensor


class _T5FeedForward(FeedForward):
    """:class:`qkv.nn.FeedForward` with T5's activation by HF name: ``wo(act(wi(x)))`` or, gated,
    ``wo(act(wi_0(x)) * wi_1(x))`` (``gate_proj`` = ``wi_0``, ``up_proj`` = ``wi_1``)."""

    def __init__(self, d_model: int, d_ff: int, *, act: str, gated: bool, dropout: float = 0.0) -> None:
        super().__init__(d_model, d_ff, activation="geglu" if gated else "relu", bias=False, dropout=dropout)
        self.act_name = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = _ACT_FN[self.act_name]
        h = act(self.gate_proj(x)) * self.up_proj(x) if self.gate_proj is not None else act(self.up_proj(x))
        return self.down_proj(self.dropout(h))

    def extra_repr(self) -> str:
        return f"act={self.act_name!r}, gated={self.gate_proj is not None}"


def _key_mask(attention_mask: torch.Tensor | None, nq: int) -> masks.Mask | None:
    """An HF key mask (B, S) of 1/0 as a qkv mask for ``nq`` queries: ``padding(lengths)`` when right-padded,
    else a key mask by position (T5 accepts padding on either side)."""
    if attention_mask is None:
        return None
    am = attention_mask.to(torch.bool)
    if am.dim() != 2:
        raise ValueError(f"T5: attention_mask must be (B, S) of 0/1, got shape {tuple(am.shape)}")
    if not bool((~am[:, :-1] & am[:, 1:]).any()):
        return masks.padding(am.sum(1))
    cols = torch.arange(am.shape[1], device=am.device).expand_as(am)
    q = torch.zeros(am.shape[0], nq, dtype=torch.int64, device=am.device)
    return masks.positions(q, torch.where(am, cols, -1), causal=False)


class _T5Base(nn.Module):
    def __init__(self, enc: TransformerConfig, *, act: str, gated: bool) -> None:
        super().__init__()
        self.config = enc
        self.embed_tokens = nn.Embedding(enc.vocab_size, enc.d_model)
        self.encoder = TransformerEncoder(enc)
        self._use_t5_ffn(self.encoder, enc, act, gated)

    @staticmethod
    def _use_t5_ffn(stack: nn.Module, cfg: TransformerConfig, act: str, gated: bool) -> None:
        for layer in stack.layers:
            layer.ffn = _T5FeedForward(cfg.d_model, cfg.d_ff, act=act, gated=gated, dropout=cfg.dropout)

    def encode(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder states (B, S, d) of ``input_ids`` (B, S); ``attention_mask`` (B, S) 1 real / 0 padding."""
        if input_ids.dim() != 2:
            raise ValueError(f"T5: input_ids must be (B, S), got shape {tuple(input_ids.shape)}")
        return self.encoder(self.embed_tokens(input_ids), mask=_key_mask(attention_mask, input_ids.shape[1]))


class T5Encoder(_T5Base):
    """The T5 encoder alone (HF ``T5EncoderModel``). ``forward(input_ids, *, attention_mask=None)`` -> (B, S, d)."""

    def forward(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.encode(input_ids, attention_mask=attention_mask)


class T5(_T5Base):
    """T5 encoder-decoder with its LM head (HF ``T5ForConditionalGeneration``).

    Args:
        enc, dec: :class:`qkv.nn.TransformerConfig` of the encoder and decoder stacks.
        act, gated: the feed-forward activation (HF ``dense_act_fn``) and whether it is gated.
        tied: the LM head is the token embedding; ``scale_output``: multiply decoder states by
            ``d_model ** -0.5`` before it (T5 v1.0).
        pad_token_id, eos_token_id, decoder_start_token_id: special tokens for :meth:`generate`.

    ``forward(input_ids, decoder_input_ids, *, attention_mask=None)``: input_ids (B, S), decoder_input_ids
    (B, T) int64 (teacher forcing), attention_mask (B, S) 1/0. Returns logits (B, T, V).
    """

    def __init__(self, enc: TransformerConfig, dec: TransformerConfig, *, act: str, gated: bool, tied: bool,
                 scale_output: bool, pad_token_id: int = 0, eos_token_id: int | None = 1,
                 decoder_start_token_id: int | None = None) -> None:
        super().__init__(enc, act=act, gated=gated)
        self.decoder = TransformerDecoder(dec, cross_attention=True)
        self._use_t5_ffn(self.decoder, dec, act, gated)
        self.lm_head = None if tied else nn.Linear(dec.d_model, dec.vocab_size, bias=False)
        self.scale_output = scale_output
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.decoder_start_token_id = pad_token_id if decoder_start_token_id is None else decoder_start_token_id

    def decode(self, decoder_input_ids: torch.Tensor, encoder_states: torch.Tensor | None, *,
               attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
               cache=None) -> torch.Tensor:
        """Logits (B, T, V) for decoder tokens (B, T) over encoder states (B, S, d).

        ``attention_mask`` is the encoder's (B, S); ``positions`` (B, T) the tokens' absolute positions
        (required with a ``qkv.cache`` cache, which keeps self-attention keys/values and, computed once, the
        cross-attention ones: ``encoder_states`` may then be None after the first step)."""
        nq = decoder_input_ids.shape[1]
        h = self.decoder(self.embed_tokens(decoder_input_ids), encoder_states, positions=positions, cache=cache,
                         context_mask=_key_mask(attention_mask, nq))
        if self.scale_output:
            h = h * self.config.d_model ** -0.5
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor, *,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        memory = self.encode(input_ids, attention_mask=attention_mask)
        return self.decode(decoder_input_ids, memory, attention_mask=attention_mask)

    def cache_specs(self) -> list:
        """One :class:`qkv.cache.FullSpec` per decoder layer (cross-attention keys/values ride along)."""
        from ..cache import FullSpec

        c = self.decoder.config
        return [FullSpec(c.n_kv_heads, c.head_dim) for _ in range(c.n_layers)]

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 20, eos_token_id: int | None = -1, cache=None) -> Seq2SeqOutput:
        """Greedy decoding with a KV cache.

        Args:
            input_ids: (B, S) source tokens; attention_mask: (B, S) 1 real / 0 padding.
            max_new_tokens: tokens to generate (fewer when every row emitted ``eos_token_id``).
            eos_token_id: stop token (default: the checkpoint's; None never stops early).
            cache: a fresh :class:`qkv.cache.KVCache` (default: one built from :meth:`cache_specs`).

        Returns:
            :class:`Seq2SeqOutput`.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"T5.generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        eos = self.eos_token_id if eos_token_id == -1 else eos_token_id
        if cache is None:
            from ..cache import KVCache

            cache = KVCache(self.cache_specs())
        B, device = input_ids.shape[0], input_ids.device
        memory = self.encode(input_ids, attention_mask=attention_mask)
        tok = torch.full((B, 1), self.decoder_start_token_id, dtype=torch.int64, device=device)
        start = tok
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        new: list[torch.Tensor] = []
        for t in range(max_new_tokens):
            pos = torch.full((B, 1), t, dtype=torch.int64, device=device)
            logits = self.decode(tok, memory, attention_mask=attention_mask, positions=pos, cache=cache)[:, -1]
            nxt = torch.where(finished, torch.full_like(finished, self.pad_token_id, dtype=torch.int64),
                              logits.argmax(-1))
            new.append(nxt)
            if eos is not None:
                finished = finished | (nxt == eos)
                if bool(finished.all()):
                    break
            tok = nxt.view(B, 1)
        gen = torch.stack(new, dim=1) if new else start.new_zeros(B, 0)
        return Seq2SeqOutput(torch.cat([start, gen], dim=1), gen, finished)


def _ffn_kind(cfg: dict[str, Any]) -> tuple[str, bool]:
    proj = cfg.get("feed_forward_proj", "relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise CheckpointError(f"t5: feed_forward_proj={proj!r} is not 'ACT' or 'gated-ACT'")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    if act not in _ACT_FN:
        raise CheckpointError(f"t5: activation {act!r} is not supported; supported: {sorted(_ACT_FN)}")
    return act, len(parts) == 2


def _configs(cfg: dict[str, Any]) -> tuple[TransformerConfig, TransformerConfig]:
    common = dict(
        d_model=cfg["d_model"], n_heads=cfg["num_heads"], head_dim=cfg.get("d_kv", 64), d_ff=cfg["d_ff"],
        activation="relu", norm="rms", norm_eps=cfg.get("layer_norm_epsilon", 1e-6), norm_first=True,
        attention_bias=False, mlp_bias=False, position="t5",
        relative_attention_num_buckets=cfg.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=cfg.get("relative_attention_max_distance", 128),
        attention_scale=1.0, vocab_size=cfg["vocab_size"], dropout=cfg.get("dropout_rate", 0.0),
        attention_dropout=cfg.get("dropout_rate", 0.0), name="t5")
    n_enc = cfg["num_layers"]
    n_dec = cfg.get("num_decoder_layers") or n_enc
    return TransformerConfig(n_layers=n_enc, **common), TransformerConfig(n_layers=n_dec, **common)


def _tied(cfg: dict[str, Any]) -> tuple[bool, bool]:
    """(LM head tied to the embedding, decoder output scaled by d_model ** -0.5).

    Configs written by transformers >= 5 carry ``scale_decoder_outputs`` and always tie; older ones say
    ``tie_word_embeddings=False`` for T5 v1.1 (separate head, no scaling)."""
    tied = cfg.get("tie_word_embeddings", True) is not False
    return tied, cfg.get("scale_decoder_outputs", tied)


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or ["T5ForConditionalGeneration"]
    known = ("T5ForConditionalGeneration", "T5Model", "T5EncoderModel")
    for a in archs:
        if a in known:
            return a
    raise CheckpointError(f"t5: architectures {archs} are not supported; qkv builds {list(known)}")


def build(config: dict[str, Any]) -> nn.Module:
    """:class:`T5` for ``T5ForConditionalGeneration`` / ``T5Model`` configs, :class:`T5Encoder` for
    ``T5EncoderModel``."""
    enc, dec = _configs(config)
    act, gated = _ffn_kind(config)
    if _architecture(config) == "T5EncoderModel":
        return T5Encoder(enc, act=act, gated=gated)
    tied, scale = _tied(config)
    return T5(enc, dec, act=act, gated=gated, tied=tied, scale_output=scale,
              pad_token_id=config.get("pad_token_id", 0) or 0, eos_token_id=config.get("eos_token_id", 1),
              decoder_start_token_id=config.get("decoder_start_token_id"))


def _stack_names(side: str, n_layers: int, gated: bool) -> dict[str, str]:
    """HF T5 names -> qkv names for one stack (``side`` is "encoder" or "decoder")."""
    names = {f"{side}.final_layer_norm.weight": f"{side}.norm.weight"}
    for i in range(n_layers):
        hf, q = f"{side}.block.{i}.layer.", f"{side}.layers.{i}."
        for p in ("q", "k", "v", "o"):
            names[f"{hf}0.SelfAttention.{p}.weight"] = f"{q}self_attn.{p}_proj.weight"
        names[f"{hf}0.layer_norm.weight"] = f"{q}attn_norm.weight"
        ff = 1
        if side == "decoder":
            for p in ("q", "k", "v", "o"):
                names[f"{hf}1.EncDecAttention.{p}.weight"] = f"{q}cross_attn.{p}_proj.weight"
            names[f"{hf}1.layer_norm.weight"] = f"{q}cross_norm.weight"
            ff = 2
        mlp = {"wi_0": "gate_proj", "wi_1": "up_proj"} if gated else {"wi": "up_proj"}
        for hf_p, q_p in {**mlp, "wo": "down_proj"}.items():
            names[f"{hf}{ff}.DenseReluDense.{hf_p}.weight"] = f"{q}ffn.{q_p}.weight"
        names[f"{hf}{ff}.layer_norm.weight"] = f"{q}ffn_norm.weight"
    return names


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF T5 names to qkv names. The shared relative-bias table of each stack's first layer is given to every
    layer (the qkv stacks share one module); the copies HF keeps of the shared embedding
    (``encoder.embed_tokens``, ``decoder.embed_tokens``, a tied ``lm_head``) are dropped when equal to it.
    A missing tensor raises :class:`CheckpointError` naming it; unknown tensors keep their names, so the loader
    reports them as unexpected."""
    enc, dec = _configs(config)
    _, gated = _ffn_kind(config)
    arch = _architecture(config)
    tied, _ = _tied(config)
    src = dict(state)
    shared = src.get("shared.weight")
    copies = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"] + (["lm_head.weight"] if tied else [])
    for name in copies:
        if name in src and shared is not None and src[name].shape == shared.shape and torch.equal(src[name], shared):
            del src[name]
    # HF ignores this table (cross attention has no position bias); old checkpoints carry it.
    src.pop("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight", None)
    names = {"shared.weight": "embed_tokens.weight", **_stack_names("encoder", enc.n_layers, gated)}
    sides = [("encoder", enc)]
    if arch != "T5EncoderModel":
        names.update(_stack_names("decoder", dec.n_layers, gated))
        if not tied:
            names["lm_head.weight"] = "lm_head.weight"
        sides.append(("decoder", dec))
    for side, _ in sides:
        names[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = f"{side}.position_bias.weight"
    missing = [f"{hf} (qkv {q})" for hf, q in names.items() if hf not in src]
    if missing:
        more = " ..." if len(missing) > 8 else ""
        extra = sorted(set(src) - set(names))
        raise CheckpointError(f"from_hf: t5 checkpoint ({arch}) is missing tensors {missing[:8]}{more}"
                              + (f"; unexpected tensors {extra[:8]}" if extra else ""))
    out = {names.get(k, k): v for k, v in src.items()}
    for side, cfg in sides:
        table = out[f"{side}.position_bias.weight"]
        for i in range(cfg.n_layers):
            out[f"{side}.layers.{i}.self_attn.position_bias.weight"] = table
    return out
