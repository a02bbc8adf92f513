"""qkv as an attention implementation inside HF transformers: ``attn_implementation="qkv"``.

Importing this module registers ``"qkv"`` with transformers' ``AttentionInterface`` (the attention call
of every layer) and with ``AttentionMaskInterface`` (the mask a model builds once per forward), so::

    import qkv.integrations.transformers  # noqa: F401  (registers "qkv")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="qkv")
    model.set_attn_implementation("qkv")            # or on a loaded model
    qkv.integrations.transformers.use(model)        # the same, after checking the family reaches the interface

runs every attention call through :func:`qkv.attention` with ``backend="auto"``.

What HF hands over, and what qkv makes of it:

- The mask. HF describes a mask as a composition of index predicates (``causal_mask_function``,
  ``sliding_window_overlay(W)``, the packed-sequence and chunked overlays, ``and_masks``/``or_masks``) plus
  the 2-D ``attention_mask``. The mask function registered here reads that composition back into
  analytic qkv masks: ``causal()``, ``sliding_window(W - 1)``, ``padding`` (right padding as lengths, left
  padding as a (B, Nk) key mask), ``document`` (packed sequences found from ``position_ids``, chunked
  attention, bidirectional image blocks) and ``positions`` (when HF's query and key offsets are not the
  bottom-right alignment). The tiled and Flex backends then skip empty tiles. Reading the composition
  looks at the closures of HF's public mask factories; a composition it does not know (a model's own
  ``or_mask_function``, say) is taken as the dense boolean mask HF would build, and ``qkv.explain`` (and
  :func:`explain` here) say so. A 4-D mask the caller prepared arrives as a tensor and is taken as is:
  boolean as a dense mask; float as additive: its ``-inf`` (or ``finfo.min``) entries as a dense mask, the
  finite rest as a dense ``mods.bias`` applied after any softcap, as eager adds the mask after capping.
- ``scaling`` is the scale; ``softcap`` (Gemma 2) becomes ``mods.softcap``; T5's ``position_bias``, a
  dense (1, H, Nq, Nk) tensor computed by the model, becomes ``mods.bias`` (dense: HF hands over only
  that); ``s_aux`` (GPT-OSS's per-head sinks) becomes ``sinks=``; ``dropout`` (non-zero in training)
  becomes ``dropout_p``, drawn from torch's default generator (so the pattern differs from eager's).
  ``sliding_window`` needs nothing: the mask of a sliding layer already holds the window.
- DeepSeek-V3.2's sparse attention (DSA): the indexer reads the mask before its top-k (``attention_mask[:, 0]``),
  so the ``"qkv"`` mask indexes as the dense boolean HF would build; HF then passes each attention call the
  selected keys (``indices``, (B, Nq, K)), which become a ``masks.topk`` list shared by the heads, AND-ed with
  the mask, and (``backend="auto"``, no dropout) run on the ``gather`` backend, which reads only those keys.
- DeepSeek-V4: a compressed layer appends its compressed entries to the keys and their visibility (an entry only
  once all its tokens arrived; on CSA layers, only the indexer's selection) to the mask, but only when the mask is a
  tensor. So for ``config.model_type == "deepseek_v4"`` the ``"qkv"`` mask function returns eager's additive float
  mask (dense, (B, 1, Nq, Nk)); the layer extends it, and each call reads the extended mask's ``-inf`` entries as
  a dense mask and the per-head ``s_aux`` as sinks. Memory is eager's O(Nq (Nk + T)); ``qkv.models.from_hf``
  runs the model on :func:`qkv.sparse.compressed_attention` without a dense mask.
- ``output_attentions=True``: the probabilities are recomputed from the log-sum-exp with
  :func:`qkv.attention_probs` (exact, whatever backend ran), which HF's own fused paths cannot do. They are
  the probabilities before dropout, float in the query dtype.

Differences from eager, all on rows HF itself treats as padding: a query row with no allowed key (a left-pad
token) returns zeros where eager averages every value; its attention row is zeros where eager's is uniform.

Families checked against eager (random weights, tiny configs, ``tests/integrations/test_transformers.py``):
Llama, Mistral, Qwen2, Gemma 2, Gemma 3 (text), GPT-2, GPT-OSS, BERT and T5 (encoder, decoder and
cross-attention); DeepSeek-V3.2 in ``tests/integrations/test_transformers_dsa.py``; DeepSeek-V4 in
``tests/models/test_deepseek_v4.py``. Any family whose attention
layers call ``ALL_ATTENTION_FUNCTIONS.get_interface`` works the same way. A family whose layers do not (BLOOM
and a few others, which would silently run their own attention) is refused when it is built with
``attn_implementation="qkv"`` (``ValueError`` naming the class and model type), and :func:`use` raises for it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import masks as M
from .. import mods
from .._attention import Explanation, attention
from .._attention import explain as _explain
from .._probs import attention_probs
from ..masks.base import Mask

__all__ = ["register", "use", "explain", "hf_mask", "attention_forward", "HFMask", "LayerReport", "NAME",
           "TENSOR_MASK_MODELS"]

#: The name registered on import.
NAME = "qkv"


@dataclass(frozen=True)
class HFMask:
    """What the ``"qkv"`` mask function hands HF, which passes it unchanged to every attention call.

    Indexing it (``hf_mask[:, 0]``, as DeepSeek-V3.2's indexer does with the mask before its top-k) gives that
    slice of the dense boolean mask ``(B, 1, Nq, Nk)`` (True: allowed), the form eager hands such code.
    """

    mask: Mask | None  # None: every pair allowed
    source: str  # "analytic" or why it is dense
    shape: tuple[int, int, int, int] | None = None  # (B, 1, Nq, Nk) of HF's request; None: unknown
    device: torch.device | None = None

    def __getitem__(self, index) -> torch.Tensor:
        if self.shape is None:
            raise TypeError("HFMask: this mask does not know HF's (B, 1, Nq, Nk) shape, so it cannot be indexed; "
                            "build it with qkv.integrations.transformers.hf_mask")
        B, H, nq, nk = self.shape
        if self.mask is None:
            return torch.ones(self.shape, dtype=torch.bool, device=self.device)[index]
        return self.mask.materialize(B, H, nq, nk, device=self.device)[index]

    def _refuse(self, other) -> None:
        raise TypeError("attn_implementation='qkv': this model adds the attention mask to its scores in its own "
                        "attention code, so it does not dispatch attention through transformers' AttentionInterface "
                        "(BLOOM and a few other families) and qkv cannot run it; load it with "
                        "attn_implementation='eager' or 'sdpa', or port it to qkv (qkv.models.from_hf)")

    __add__ = __radd__ = _refuse


@dataclass(frozen=True)
class LayerReport:
    """One attention call of a forward pass under :func:`explain`."""

    module: str
    mask_source: str
    explanation: Explanation

    def __str__(self) -> str:
        return f"[{self.module}] mask: {self.mask_source}\n{self.explanation}"


_REGISTERED: set[str] = set()  # the names register() gave transformers
_recording: contextvars.ContextVar[list | None] = contextvars.ContextVar("qkv_hf_recording", default=None)


class _Unknown(Exception):
    """A part of HF's mask composition that qkv does not read analytically."""


@functools.cache
def _factories() -> dict[str, object]:
    """Code objects of HF's public mask factories' inner functions, to recognize a composition by."""
    import transformers.masking_utils as mu

    t1, t2 = torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    makers = {
        "and": lambda: mu.and_masks(mu.causal_mask_function),
        "or": lambda: mu.or_masks(mu.causal_mask_function),
        "sliding": lambda: mu.sliding_window_overlay(1),
        "sliding_bidirectional": lambda: mu.sliding_window_bidirectional_overlay(1),
        "chunked": lambda: mu.chunked_overlay(1, t1),
        "packed": lambda: mu.packed_sequence_mask_function(t2),
        "remap": lambda: mu.remap_positions_for_packed_sequence(mu.causal_mask_function, t2),
        "block": lambda: mu.blockwise_overlay(t2),
        "padding": lambda: mu.padding_mask_function(t2),
    }
    codes: dict[str, object] = {"causal": mu.causal_mask_function.__code__,
                                "bidirectional": mu.bidirectional_mask_function.__code__}
    for name, make in makers.items():
        try:
            codes[name] = make().__code__
        except (AttributeError, TypeError):  # a transformers without this factory: never matched
            pass
    return codes


def _kind(fn) -> tuple[str, dict]:
    """(factory name, closure variables) of an HF mask function."""
    code = getattr(fn, "__code__", None)
    for name, c in _factories().items():
        if code is c:
            cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in (fn.__closure__ or ()))))
            return name, cells
    raise _Unknown(getattr(fn, "__qualname__", type(fn).__name__))


@dataclass(frozen=True)
class _Geometry:
    """Sizes and absolute offsets of one mask request: query row i sits at i + q_off, key j at j + kv_off."""

    B: int
    nq: int
    nk: int
    q_off: int
    kv_off: int
    device: torch.device

    @property
    def aligned(self) -> bool:
        """HF's offsets are qkv's bottom-right alignment (row i at position i + nk - nq)."""
        return self.q_off - self.kv_off == self.nk - self.nq

    def qpos(self) -> torch.Tensor:
        return torch.arange(self.nq, device=self.device) + self.q_off

    def kpos(self) -> torch.Tensor:
        return torch.arange(self.nk, device=self.device) + self.kv_off


_ALL = None  # the mask that allows every pair


def _and(a, b):
    return b if a is _ALL else a if b is _ALL else a & b


def _or(a, b):
    return _ALL if a is _ALL or b is _ALL else a | b


def _translate(fn, g: _Geometry) -> Mask | None:
    kind, cells = _kind(fn)
    if kind == "and":
        parts = list(cells["mask_functions"])
        kinds = [_kind(p)[0] for p in parts]
        # causal & sliding overlay: the sliding window of FlashAttention's convention (left = W - 1).
        if g.aligned and "causal" in kinds and "sliding" in kinds:
            w = _kind(parts[kinds.index("sliding")])[1]["sliding_window"]
            rest = [p for p, k in zip(parts, kinds) if k not in ("causal", "sliding")]
            out = M.sliding_window(int(w) - 1)
        else:
            rest, out = parts, _ALL
        # packed sequences: HF remaps the inner predicate to position ids and ANDs the document ids. Within one
        # document position ids step by one, so a translation-invariant predicate (causal, windows) on positions
        # is the same predicate on indices.
        if "remap" in kinds and "packed" in kinds:
            inner = _kind(parts[kinds.index("remap")])[1]["mask_function"]
            if not g.aligned or not _translation_invariant(inner):
                raise _Unknown("packed sequences over a position-dependent mask")
            rest = [p for p, k in zip(parts, kinds) if k != "remap"]
            out = _and(out, _translate(inner, g))
        for p in rest:
            out = _and(out, _translate(p, g))
        return out
    if kind == "or":
        out = None
        for i, p in enumerate(cells["mask_functions"]):
            m = _translate(p, g)
            out = m if i == 0 else _or(out, m)
        return out
    if kind == "causal":
        if g.aligned:
            return M.causal()
        return M.positions(g.qpos(), g.kpos(), causal=True)
    if kind == "bidirectional":
        return _ALL
    if kind == "sliding":  # kv > q - W, no upper bound by itself
        return M.positions(g.qpos(), g.kpos(), causal=False, window=int(cells["sliding_window"]))
    if kind == "sliding_bidirectional":  # |q - kv| <= W
        if not g.aligned:
            raise _Unknown("a bidirectional window with unaligned offsets")
        w = int(cells["sliding_window"])
        return M.sliding_window(w, w)
    if kind == "chunked":  # same chunk of C positions, counted from each row's left padding
        c, lp = int(cells["chunk_size"]), cells["left_padding"].to(g.device).view(-1, 1)
        return M.document((g.kpos().view(1, -1) - lp) // c, q_ids=(g.qpos().view(1, -1) - lp) // c)
    if kind == "packed":
        return M.document(cells["packed_sequence_mask"].to(g.device))
    if kind == "padding":
        return _padding(cells["padding_mask"], g)
    if kind == "block":  # same block id, and not -1 (text), as in HF's blockwise overlay
        ids = cells["block_sequence_ids"].to(g.device)
        kv = ids[:, g.kv_off:g.kv_off + g.nk]
        q = ids[:, g.q_off:g.q_off + g.nq]
        return M.document(kv, q_ids=torch.where(q >= 0, q, torch.full_like(q, -2)))
    raise _Unknown(kind)


def _translation_invariant(fn) -> bool:
    try:
        kind, cells = _kind(fn)
    except _Unknown:
        return False
    if kind in ("and", "or"):
        return all(_translation_invariant(p) for p in cells["mask_functions"])
    return kind in ("causal", "bidirectional", "sliding", "sliding_bidirectional")


def _padding(attention_mask: torch.Tensor | None, g: _Geometry) -> Mask | None:
    """HF's 2-D attention_mask, read at the keys' absolute positions (missing positions are padding)."""
    if attention_mask is None:
        return _ALL
    valid = attention_mask.to(device=g.device, dtype=torch.bool)[:, g.kv_off:g.kv_off + g.nk]
    if valid.shape[1] < g.nk:
        valid = torch.nn.functional.pad(valid, (0, g.nk - valid.shape[1]), value=False)
    if bool(valid.all()):
        return _ALL
    lengths = valid.sum(1)
    if bool((valid == (torch.arange(g.nk, device=g.device) < lengths.view(-1, 1))).all()):
        return M.padding(lengths)  # right padding: a length per row
    return M.padding(valid)


#: Model types whose attention layers extend the mask HF built only when it is a tensor: DeepSeek-V4 appends its
#: compressor's block bias (compressed-causal visibility and the indexer's selection) to the key axis of a tensor
#: mask, and would let every query see every compressed entry through any other object. For these the ``"qkv"``
#: mask function hands HF eager's additive float mask, which the attention call then reads as a dense mask.
#: Qwen4-Exp's QSA layers likewise fold their selection into the mask tensor (their indexer reads its dtype).
TENSOR_MASK_MODELS = frozenset({"deepseek_v4", "qwen4_exp_text", "qwen4_exp"})


def hf_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
            mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
            use_vmap: bool = False, device="cpu", **kwargs) -> HFMask | torch.Tensor:
    """The mask function registered as ``"qkv"`` in ``AttentionMaskInterface``: HF's mask request as a qkv
    mask, analytic where HF's composition is known, else the dense boolean HF would build; for a model type in
    :data:`TENSOR_MASK_MODELS` (``config.model_type``), eager's additive float mask of ``dtype``."""
    import transformers.masking_utils as mu

    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    config = kwargs.get("config")
    if getattr(config, "model_type", None) in TENSOR_MASK_MODELS:
        dtype = kwargs.get("dtype") or torch.float32
        return mu.eager_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                             kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                             dtype=dtype, use_vmap=use_vmap, device=device)
    g = _Geometry(int(batch_size), int(q_length), int(kv_length), int(q_offset), int(kv_offset), torch.device(device))
    try:
        mask = _and(_translate(mask_function, g), _padding(attention_mask, g))
        return HFMask(mask, "analytic", (g.B, 1, g.nq, g.nk), g.device)
    except _Unknown as e:
        dense = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                             kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                             allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=use_vmap,
                             device=device)
        return HFMask(M.dense(dense), f"dense: HF's mask composition holds {e}, which qkv does not read "
                                      "analytically, so it takes the boolean mask HF builds", (g.B, 1, g.nq, g.nk),
                      g.device)


def _as_mask(attention_mask, module, is_causal, nq: int) -> tuple[Mask | None, object, str]:
    """(mask, additive bias or None, where the mask came from)."""
    if isinstance(attention_mask, HFMask):
        return attention_mask.mask, None, attention_mask.source
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        if causal and nq > 1:
            return M.causal(), None, "none from HF; the module is causal: causal() (bottom-right)"
        return None, None, "none"
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            return M.dense(attention_mask), None, "dense: a 4-D boolean mask prepared by the caller"
        # the -inf entries (or HF's finfo.min) are a mask; the finite rest is a bias, added after softcap as eager
        # does (a bias before the softcap would squash -inf to -cap and give masked keys weight)
        hidden = torch.isneginf(attention_mask) | (attention_mask <= torch.finfo(attention_mask.dtype).min)
        if not bool(hidden.any()):
            return None, mods.bias(attention_mask), "dense: a 4-D additive mask prepared by the caller, as a bias"
        finite = attention_mask.masked_fill(hidden, 0.0)
        bias = mods.bias(finite) if bool(finite.ne(0).any()) else None
        return (M.dense(~hidden), bias, "dense: a 4-D additive mask prepared by the caller: its -inf entries as a "
                "boolean mask" + (", the finite rest as a bias" if bias is not None else ""))
    raise TypeError(f"qkv attention: cannot read attention_mask of type {type(attention_mask).__name__} "
                    f"{tuple(getattr(attention_mask, 'shape', ()))}; HF builds it with the 'qkv' mask function "
                    "(registered by importing qkv.integrations.transformers) or takes a 4-D boolean or additive tensor")


def _forward_for(backend: str) -> Callable:
    def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, dropout: float = 0.0, scaling: float | None = None,
                          softcap: float | None = None, s_aux: torch.Tensor | None = None,
                          position_bias: torch.Tensor | None = None, is_causal: bool | None = None,
                          sliding_window: int | None = None, **kwargs):
        """HF's attention-function signature: q (B, Hq, Nq, D), k, v (B, Hkv, Nk, D) -> ((B, Nq, Hq, Dv), probs)."""
        if attention_mask is None and ("cu_seq_lens_q" in kwargs or "cu_seq_lens_k" in kwargs):
            raise ValueError("qkv attention: HF passed packed-sequence lengths (cu_seq_lens_q/k) without building a "
                             "mask (continuous batching or a paged cache), which the 'qkv' implementation does not "
                             "run; pack with position_ids (HF then builds a document mask) or use "
                             "qkv.varlen_attention")
        mask, bias, source = _as_mask(attention_mask, module, is_causal, query.shape[2])
        indices, run_on = kwargs.get("indices"), backend
        blocks = kwargs.get("block_indices")
        if blocks is not None:  # MiniMax-M3: each KV group's kept key blocks (B, Hi, Nq, K), -1 for none
            mask = _blocks_selected(blocks, module, mask, query, key.shape[2])
            source += " & the indexer's key blocks"
        elif indices is not None:  # DeepSeek-V3.2: the indexer's (B, Nq, K) top-k keys, shared by the heads
            mask, source = _selected(indices, mask, query), source + " & the indexer's top-k keys"
        if (blocks is not None or indices is not None) and backend == "auto" and not dropout:
            run_on = "gather"  # read only the listed keys, as the sparse kernels HF would call do
        score_mod = [m for m in (None if position_bias is None else mods.bias(position_bias),
                                 None if not softcap else mods.softcap(float(softcap)), bias) if m is not None]
        sinks = None if s_aux is None else s_aux.to(query.device)
        kw = dict(mask=mask, score_mod=score_mod or None, scale=scaling, sinks=sinks)
        record = _recording.get()
        if record is not None:
            why = _explain(query, key, value, dropout_p=dropout, **kw)
            if run_on != backend:
                why = dataclasses.replace(why, chosen=run_on, note="HF passed the indexer's top-k keys: only those are "
                                          "read")
            record.append(LayerReport(_name_of(module), source, why))
        out = attention(query, key, value, dropout_p=float(dropout), backend=run_on, **kw)
        probs = None
        if _attentions_requested(kwargs):
            with torch.no_grad():
                probs = attention_probs(query, key, value, backend=backend, **kw).to(query.dtype)
        return out.transpose(1, 2).contiguous(), probs

    return attention_forward


def _selected(indices, mask: Mask | None, query: torch.Tensor) -> Mask:
    """``mask & topk(indices)`` for HF's top-k key indices (B, Nq, K) (or (B, 1, Nq, K)), checked."""
    B, Nq = query.shape[0], query.shape[2]
    if not isinstance(indices, torch.Tensor) or indices.dim() not in (3, 4) or indices.shape[0] != B or \
            indices.shape[-2] != Nq:
        seen = tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"qkv attention: indices (the top-k keys of each query, DeepSeek-V3.2's indexer) must be "
                         f"(B, Nq, K) = ({B}, {Nq}, K), got {seen}")
    lists = M.topk(indices if indices.dim() == 4 else indices.unsqueeze(1))
    return lists if mask is None else mask & lists


def _blocks_selected(blocks, module, mask: Mask | None, query: torch.Tensor, n_keys: int) -> Mask:
    """``mask & topk(slots)`` for HF's block-sparse selection (MiniMax-M3's ``block_indices`` (B, Hi, Nq, K): block
    ids of ``block_size`` key slots from slot 0, one list per KV group, ``-1`` for none), each group's slots read
    by its ``Hq / Hi`` query heads; checked."""
    B, Hq, Nq = query.shape[0], query.shape[1], query.shape[2]
    indexer = getattr(module, "indexer", None)
    size = getattr(indexer, "block_size", None) or getattr(getattr(module, "config", None), "index_block_size", None)
    if (not isinstance(blocks, torch.Tensor) or blocks.dim() != 4 or blocks.shape[0] != B or blocks.shape[2] != Nq
            or Hq % blocks.shape[1]):
        seen = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise ValueError(f"qkv attention: block_indices (each KV group's kept key blocks) must be (B, Hi, Nq, K) = "
                         f"({B}, Hi dividing {Hq}, {Nq}, K), got {seen}")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"qkv attention: block_indices came without a block size: the module "
                         f"{type(module).__name__} has no indexer.block_size nor config.index_block_size")
    offsets = torch.arange(size, device=blocks.device)
    slots = (blocks.unsqueeze(-1) * size + offsets).flatten(-2)  # (B, Hi, Nq, K * size)
    slots = slots.masked_fill(blocks.repeat_interleave(size, dim=-1) < 0, -1).masked_fill(slots >= n_keys, -1)
    lists = M.topk(slots.repeat_interleave(Hq // blocks.shape[1], dim=1))
    return lists if mask is None else mask & lists


#: The attention function registered as ``"qkv"`` (``backend="auto"``).
attention_forward = _forward_for("auto")


def _attentions_requested(kwargs: dict) -> bool:
    """``output_attentions`` reaches the attention call as a keyword in most families; some (GPT-2) drop it
    on the way, and then only transformers' output collector knows (read defensively: an unknown
    transformers layout there means "not requested", so probabilities are never computed by mistake)."""
    if "output_attentions" in kwargs:
        return bool(kwargs["output_attentions"])
    try:
        from transformers.utils.output_capturing import _active_collector

        collected = _active_collector.get()
    except (ImportError, AttributeError, LookupError):
        return False
    return isinstance(collected, dict) and any(k.endswith("attentions") for k in collected)


def _name_of(module: torch.nn.Module) -> str:
    idx = getattr(module, "layer_idx", None)
    return type(module).__name__ + (f"[{idx}]" if idx is not None else "")


def register(name: str = NAME, *, backend: str = "auto") -> None:
    """Register ``name`` with transformers' attention and mask interfaces, running ``backend``.

    Importing this module calls ``register()``; ``register("qkv_tiled", backend="tiled")`` adds a variant
    that pins a backend (it raises where that backend cannot honour a call, never falls back).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .. import backends

    if not isinstance(name, str) or not name:
        raise ValueError(f"register: name must be a non-empty string, got {name!r}")
    if backend != "auto" and backend not in backends.names():
        raise ValueError(f"register: unknown backend {backend!r}; valid: {', '.join(['auto', *backends.names()])}")
    AttentionInterface.register(name, attention_forward if backend == "auto" else _forward_for(backend))
    _REGISTERED.add(name)
    AttentionMaskInterface.register(name, hf_mask)
    _check_at_load()


def _runs_own_attention(cls: type) -> bool:
    """Whether a model class's modeling file is known to hold attention layers that never reach
    ``AttentionInterface`` (the test transformers applies before it lets a model switch implementations). A
    file without attention layers (a multimodal wrapper's) passes, and so does one whose source cannot be read
    (a class defined in a notebook): only what is known to bypass qkv is refused."""
    module = sys.modules.get(cls.__module__)
    try:
        src = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return False
    if not re.search(r"^class \w*Attention\w*\(nn\.Module\):", src, re.MULTILINE):
        return False
    return not _uses_interface(cls)


def _check_at_load() -> None:
    """Make a model refuse one of qkv's names when it is built (``from_config``, ``from_pretrained``,
    ``set_attn_implementation``) if its layers compute attention in their own code: transformers would accept
    the name and run the model's own attention, qkv never called. Installed once, on
    ``PreTrainedModel._check_and_adjust_attn_implementation``, the check every build and switch goes through."""
    from transformers import PreTrainedModel

    original = PreTrainedModel._check_and_adjust_attn_implementation
    if getattr(original, "_qkv_checked", False):
        return

    @functools.wraps(original)
    def checked(self, attn_implementation, *args, **kwargs):
        if isinstance(attn_implementation, str) and attn_implementation in _REGISTERED \
                and _runs_own_attention(type(self)):
            family = getattr(getattr(self, "config", None), "model_type", None) or "?"
            raise ValueError(
                f"attn_implementation={attn_implementation!r}: {type(self).__name__} (model type {family!r}) "
                f"computes attention in its own code, not through transformers' AttentionInterface, so qkv would "
                f"never be called and the model would run its own attention; build it with "
                f"attn_implementation='eager' or 'sdpa', or load the checkpoint into qkv (qkv.models.from_hf) "
                f"if qkv supports the family")
        return original(self, attn_implementation, *args, **kwargs)

    checked._qkv_checked = True
    PreTrainedModel._check_and_adjust_attn_implementation = checked


def _uses_interface(cls: type) -> bool:
    """Whether a model class's modeling file dispatches attention through ``AttentionInterface`` (the
    heuristic transformers itself applies before switching implementations)."""
    module = sys.modules.get(cls.__module__)
    try:
        src = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS.get_interface(" in src or "ALL_ATTENTION_FUNCTIONS[" in src


def use(model, name: str = NAME):
    """Switch ``model`` (an HF ``PreTrainedModel``) to qkv attention, after checking that every one of its
    (sub)models dispatches attention through the interface; ``TypeError`` naming the class otherwise."""
    from transformers import PreTrainedModel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"use: expected a transformers PreTrainedModel, got {type(model).__name__}")
    if name not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        raise ValueError(f"use: {name!r} is not registered; call qkv.integrations.transformers.register({name!r})")
    bad = sorted({type(m).__name__ for m in model.modules()
                  if isinstance(m, PreTrainedModel) and not _uses_interface(type(m))})
    if bad:
        raise TypeError(f"use: {', '.join(bad)} do not dispatch attention through transformers' AttentionInterface, "
                        "so attn_implementation='qkv' would silently run their own attention; port the model to "
                        "qkv (qkv.models.from_hf) or use a family that does (Llama, Mistral, Qwen2, Gemma 2/3, GPT-2, "
                        "BERT, T5, ...)")
    model.set_attn_implementation(name)
    return model


def explain(model, *args, **kwargs) -> list[LayerReport]:
    """Run ``model(*args, **kwargs)`` once without gradients and report, for every attention call, where its
    mask came from (analytic or dense, and why) and :func:`qkv.explain`'s backend choice.

    Raises ``ValueError`` saying why when no attention call of the forward went through qkv: the model's config
    names another implementation (for instance because several models were built from one shared config
    object, which holds one ``attn_implementation`` for all of them), or its layers do not dispatch through
    transformers' ``AttentionInterface`` (BLOOM and other families with their own attention code).
    """
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel) and (why := _own_attention(model)) is not None:
        raise ValueError(f"explain: no attention call of this model goes through qkv; {why}")
    reports: list[LayerReport] = []
    token = _recording.set(reports)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        _recording.reset(token)
    if not reports:
        raise ValueError(f"explain: no attention call of this forward went through qkv; {_why_not_qkv(model)}")
    return reports


def _own_attention(model) -> str | None:
    """Why ``model`` (a PreTrainedModel) cannot run qkv attention, or None when every (sub)model can."""
    from transformers import PreTrainedModel

    bad = sorted({type(m).__name__ for m in model.modules()
                  if isinstance(m, PreTrainedModel) and not _uses_interface(type(m))})
    if not bad:
        return None
    return (f"{', '.join(bad)} run their own attention code, not transformers' AttentionInterface, whatever "
            f"attn_implementation says; port the model to qkv (qkv.models.from_hf) or use a family that "
            f"dispatches through the interface")


def _why_not_qkv(model) -> str:
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        if (why := _own_attention(model)) is not None:
            return why
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in _REGISTERED:
            return (f"the model's config says attn_implementation={impl!r}, not one of qkv's "
                    f"({', '.join(sorted(_REGISTERED))}). Models built from one shared config object share that "
                    f"setting (the last from_config/_from_config call decides for all of them); build each from its "
                    f"own copy.deepcopy(config)")
        return "its attention layers made no call (a model without attention, or inputs that skip it)"
    return (f"{type(model).__name__} is not a transformers PreTrainedModel switched to attn_implementation='qkv' "
            f"(qkv.integrations.transformers.use(model))")


register()
