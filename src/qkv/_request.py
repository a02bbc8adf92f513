"""The operator's shared types: the validated request every backend receives, and the result shape.

Shape legend: B batch, Hq query heads, Hkv key/value heads, Nq queries, Nk keys, Dqk query/key head
dim, Dv value head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .masks.base import Mask
from .mods.base import ScoreMod, as_score_mod

__all__ = ["AttentionOutput", "PagedKV", "Request", "build_request", "SUPPORTED_DTYPES", "LAYOUT_NAMES"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The layouts ``qkv.attention(..., layout=)`` reads q, k, v (and writes ``out``) in.
LAYOUT_NAMES = {"bhnd": "(B, H, N, D)", "bnhd": "(B, N, H, D)"}


class AttentionOutput(NamedTuple):
    """``out`` (B, Hq, Nq, Dv) in the input dtype; ``lse`` (B, Hq, Nq) float32 (float64 for float64 inputs),
    natural log of the sum of exp of the final scores over allowed keys (and the sink, with ``sinks=``), ``-inf``
    for a row with no allowed key. The contract, and conversions to base 2 and (B, Nq, Hq), are in :mod:`qkv.lse`."""

    out: torch.Tensor
    lse: torch.Tensor


class PagedKV(NamedTuple):
    """Keys and values held in block pools (PagedAttention, Kwon et al. 2023, arXiv:2309.06180): the operands that
    make ``qkv.attention(q, k_pool, v_pool, paged=PagedKV(...))`` read each row's keys where its blocks lie.

    ``k_pool`` (P, Hkv, T, Dqk) and ``v_pool`` (P, Hkv, T, Dv) hold P blocks of T slots. Row ``b`` reads the
    blocks ``block_tables[b]`` in order, so its slot ``j`` is slot ``j % T`` of block ``block_tables[b, j // T]``;
    a query at position ``p`` attends the slots whose position is in ``0 .. p`` (within ``window`` when given): the
    causal positions mask (``qkv.masks.positions(q_positions, kv_positions, causal=True, window=window)``) of
    the gathered view, without gathering it.

    Fields:
        block_tables: (B, NB) integer block ids in ``[0, P)``, any filler block where a row has fewer.
        kv_positions: (B, NB * T) integer position of each slot in table order, ``-1`` where empty.
        q_positions: (B, Nq) integer position of each query, ``-1`` for padding (its output is zeros).
        window: keys kept per query, the query included (HF ``sliding_window``), or None.
    """

    block_tables: torch.Tensor
    kv_positions: torch.Tensor
    q_positions: torch.Tensor
    window: int | None = None


@dataclass(slots=True)
class Request:
    """One validated call of :func:`qkv.attention`. Treat it as read-only (not ``frozen``: a frozen
    dataclass's ``__init__`` costs microseconds, and one is built per attention call)."""

    q: torch.Tensor  # (B, Hq, Nq, Dqk)
    k: torch.Tensor  # (B, Hkv, Nk, Dqk)
    v: torch.Tensor  # (B, Hkv, Nk, Dv)
    mask: Mask | None
    score_mod: ScoreMod | None
    scale: float
    return_lse: bool = False
    dropout_p: float = 0.0
    generator: torch.Generator | None = None
    sinks: torch.Tensor | None = None  # (Hq,) learnable sink logits, see qkv._sinks
    layout: str = "bhnd"  # the layout the caller's tensors had (q/k/v here are always (B, H, N, D) views)
    batch_invariant: bool = False  # each row's bits independent of the batch (qkv.backends._invariant)
    paged: PagedKV | None = None  # k and v are block pools (P, Hkv, T, D) read through these tables

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def Hq(self) -> int:
        return self.q.shape[1]

    @property
    def Hkv(self) -> int:
        return self.k.shape[1]

    @property
    def Nq(self) -> int:
        return self.q.shape[2]

    @property
    def Nk(self) -> int:
        """Keys per row: of the view (the tables' slots, ``NB * T``, for block-pool operands)."""
        return self.k.shape[2] if self.paged is None else self.paged.kv_positions.shape[1]

    @property
    def Dqk(self) -> int:
        return self.q.shape[3]

    @property
    def Dv(self) -> int:
        return self.v.shape[3]

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for MHA, Hq for MQA)."""
        return self.Hq // self.Hkv

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def requires_grad(self) -> bool:
        if not torch.is_grad_enabled():
            return False
        extra = self.score_mod.tensors() if self.score_mod is not None else ()
        sinks = (self.sinks,) if self.sinks is not None else ()
        return any(t.requires_grad for t in (self.q, self.k, self.v, *extra, *sinks))

    def describe(self) -> str:
        return (f"B={self.B} Hq={self.Hq} Hkv={self.Hkv} Nq={self.Nq} Nk={self.Nk} Dqk={self.Dqk} Dv={self.Dv} "
                f"{str(self.dtype).replace('torch.', '')} {self.device.type}, layout {LAYOUT_NAMES[self.layout]}"
                + (", sinks" if self.sinks is not None else "")
                + (", batch_invariant" if self.batch_invariant else "")
                + ("" if self.paged is None else f", paged: {self.k.shape[0]} blocks of {self.k.shape[2]} slots"
                   + ("" if self.paged.window is None else f", window {self.paged.window}")))


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def _mask_hint(mask) -> str:
    if isinstance(mask, torch.Tensor):
        if mask.dtype.is_floating_point:
            return (" (a float tensor is an additive bias: pass score_mod=qkv.mods.bias(t); a boolean one, True = "
                    "may attend, goes in mask=qkv.masks.dense(t))")
        return " (wrap a boolean tensor with qkv.masks.dense(t))"
    if isinstance(mask, type) and issubclass(mask, Mask) or (callable(mask) and getattr(mask, "__module__", "")
                                                             .startswith("qkv.masks")):
        name = getattr(mask, "__name__", "mask")
        return f" (the function qkv.masks.{name} itself: did you mean {name}()?)"
    return ""


def _check_devices(arg: str, owner, tensors, device: torch.device) -> None:
    """Every tensor a mask or modifier holds must live on q's device, or on the CPU (masks and modifiers move
    CPU data to where it is read, gradients included). A meta tensor or another accelerator is refused.
    Attribute comparisons only: no tensor work per call."""
    for t in tensors:
        if t.device != device and t.device.type != "cpu":
            raise ValueError(f"attention: {arg} {owner!r} holds a tensor on {t.device} but q is on {device}; "
                             f"build it from tensors on {device} (or move them with .to(q.device))")


def build_request(q, k, v, *, mask=None, score_mod=None, scale=None, return_lse=False, dropout_p=0.0,
                  generator=None, sinks=None, layout="bhnd", batch_invariant=False, paged=None) -> Request:
    """Validate the arguments of :func:`qkv.attention`; every misuse raises with the fix.

    Valid calls take one combined test of shapes, dtypes and devices (attribute reads only, no tensor ops:
    this runs on every decode step of every layer); only a failing call walks the checks one by one to
    say what is wrong.
    """
    if paged is not None:
        return _build_paged(q, k, v, paged, mask=mask, score_mod=score_mod, scale=scale, return_lse=return_lse,
                            dropout_p=dropout_p, sinks=sinks, layout=layout, batch_invariant=batch_invariant)
    try:
        qs, ks, vs = q.shape, k.shape, v.shape
        dt = q.dtype
        ok = (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
              and len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and dt in _SUPPORTED
              and k.dtype == dt and v.dtype == dt and q.device == k.device == v.device
              and qs[0] == ks[0] == vs[0] and ks[1] == vs[1] and ks[2] == vs[2] and qs[3] == ks[3]
              and ks[1] > 0 and qs[1] % ks[1] == 0)
    except AttributeError:
        ok = False
    if not ok:
        _raise_for_qkv(q, k, v)
    if scale is None:
        scale = qs[3] ** -0.5 if qs[3] > 0 else 1.0
    elif type(scale) is not float:
        scale = _check_scale(scale)
    elif not math.isfinite(scale):
        _check_scale(scale)
    if mask is not None:
        if not isinstance(mask, Mask):
            raise TypeError(f"attention: mask must be a qkv.masks mask, got {type(mask).__name__}{_mask_hint(mask)}")
        mask.check(qs[0], qs[1], qs[2], ks[2])
        _check_devices("mask", mask, mask.tensors(), q.device)
    mod = None
    if score_mod is not None:
        mod = as_score_mod(score_mod)
        if mod is not None:
            mod.check(qs[0], qs[1], qs[2], ks[2])
            _check_devices("score_mod", mod, mod.tensors(), q.device)
    if dropout_p != 0.0 or type(dropout_p) is not float:
        if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"attention: dropout_p must be in [0, 1), got {dropout_p!r}")
        dropout_p = float(dropout_p)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"attention: generator must be a torch.Generator, got {type(generator).__name__}")
    if sinks is not None:
        _check_sinks(sinks, q)
    if type(batch_invariant) is not bool:
        raise TypeError(f"attention: batch_invariant must be True or False, got {batch_invariant!r}")
    return Request(q, k, v, mask, mod, scale, bool(return_lse), dropout_p, generator, sinks, layout, batch_invariant)


def _check_scale(scale) -> float:
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = float(scale)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"attention: scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"attention: scale must be finite, got {scale}; the default is head_dim ** -0.5")
    return float(scale)


def _raise_for_qkv(q, k, v) -> None:
    """Walk the q/k/v checks one by one and raise the first failure with its fix."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"attention: {name} must have rank 4 with layout (B, H, N, D), got shape {_shape(t)}; "
                "for (B, N, H, D) inputs pass layout='bnhd' (or x.transpose(1, 2)), for a single head add .unsqueeze(1)"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"attention: {name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them "
                        "with .to(dtype)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"attention: batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)} (dim 0)")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"attention: k and v must have the same number of heads, got k {_shape(k)}, v {_shape(v)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"attention: k and v must have the same length, got k {_shape(k)}, v {_shape(v)} (dim 2)")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: q and k must have the same head dim, got q {_shape(q)}, k {_shape(k)} (dim 3)")
    raise ValueError(
        f"attention: query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]}) for "
        "grouped-query attention; query head h reads kv head h // (Hq // Hkv)"
    )


def _check_sinks(sinks, q: torch.Tensor) -> None:
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        raise TypeError(f"attention: sinks must be a float tensor of shape (Hq,) (one learnable logit per query "
                        f"head), got {type(sinks).__name__} {getattr(sinks, 'dtype', '')}")
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"attention: sinks must have shape (Hq,) = ({q.shape[1]},), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"attention: sinks are on {sinks.device} but q is on {q.device}; move them with .to(q.device)")


_INDEX_DTYPES = frozenset((torch.int64, torch.int32))


def _build_paged(q, k_pool, v_pool, paged, *, mask, score_mod, scale, return_lse, dropout_p, sinks, layout,
                 batch_invariant) -> Request:
    """:func:`build_request` for block-pool operands (:class:`PagedKV`): one combined test of shapes, dtypes and
    devices for valid calls (attribute reads), one min/max of the tables (the only tensor work), and a walk
    through the checks, naming the argument, only when it fails."""
    if not isinstance(paged, PagedKV):
        raise TypeError(f"attention: paged must be a qkv.PagedKV(block_tables, kv_positions, q_positions, window), "
                        f"got {type(paged).__name__}")
    if mask is not None or score_mod is not None or dropout_p or batch_invariant or layout != "bhnd":
        _refuse_with_paged(mask=mask, score_mod=score_mod, dropout_p=dropout_p, batch_invariant=batch_invariant,
                           layout=layout)
    tables, kv_pos, q_pos, window = paged
    try:
        qs, ks, vs, ts = q.shape, k_pool.shape, v_pool.shape, tables.shape
        dt, dev = q.dtype, q.device
        ok = (isinstance(q, torch.Tensor) and isinstance(k_pool, torch.Tensor) and isinstance(v_pool, torch.Tensor)
              and len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and dt in _SUPPORTED
              and k_pool.dtype == dt and v_pool.dtype == dt and k_pool.device == dev and v_pool.device == dev
              and ks[:3] == vs[:3] and qs[3] == ks[3] and ks[1] > 0 and qs[1] % ks[1] == 0
              and len(ts) == 2 and ts[0] == qs[0] and tables.dtype in _INDEX_DTYPES and tables.device == dev
              and kv_pos.shape == (qs[0], ts[1] * ks[2]) and kv_pos.dtype in _INDEX_DTYPES and kv_pos.device == dev
              and q_pos.shape == (qs[0], qs[2]) and q_pos.dtype in _INDEX_DTYPES and q_pos.device == dev
              and (window is None or (type(window) is int and window >= 1)))
    except AttributeError:
        ok = False
    if not ok:
        _raise_for_paged(q, k_pool, v_pool, paged)
    _check_block_ids(tables, ks[0])
    if scale is None:
        scale = qs[3] ** -0.5 if qs[3] > 0 else 1.0
    elif type(scale) is not float or not math.isfinite(scale):
        scale = _check_scale(scale)
    if sinks is not None:
        _check_sinks(sinks, q)
    return Request(q, k_pool, v_pool, None, None, scale, bool(return_lse), 0.0, None, sinks, "bhnd", False, paged)


#: The last block table found within its pool: (the table, its version counter, the pool's blocks). Every layer of
#: a group reads the same table tensor in a decode step, so the check's reduction and sync run once per step.
_checked_tables: tuple[torch.Tensor | None, int, int] = (None, -1, -1)


def _check_block_ids(tables: torch.Tensor, blocks: int) -> None:
    """Every entry of ``tables`` lies in ``[0, blocks)`` (the kernels read only visible slots, the torch paths every
    entry: both refuse the same tables)."""
    global _checked_tables
    last, version, n = _checked_tables
    # an inference tensor keeps no version counter, so a change in place could not be seen: it is checked each time
    current = None if tables.is_inference() else tables._version
    if current is not None and last is tables and version == current and n == blocks:
        return
    if tables.numel():
        lo, hi = torch.aminmax(tables)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= blocks:
            raise ValueError(f"attention: block_tables hold block ids {lo} .. {hi} but the pools have {blocks} blocks; "
                             f"every entry must lie in [0, {blocks}) (fill a short row's table with any valid id)")
    _checked_tables = (tables, current, blocks) if current is not None else (None, -1, -1)


def _refuse_with_paged(**given) -> None:
    for name, value in given.items():
        if value is not None and value is not False and not (name == "dropout_p" and value == 0) \
                and not (name == "layout" and value == "bhnd"):
            raise ValueError(f"attention: {name}={value!r} is not taken with paged= operands, whose mask is the "
                             f"causal positions mask of PagedKV (q_positions, kv_positions, window); gather the "
                             f"rows' view and call attention on it for anything else")


def _raise_for_paged(q, k_pool, v_pool, paged) -> None:
    """Walk the checks of block-pool operands one by one and raise the first failure with its fix."""
    tables, kv_pos, q_pos, window = paged
    for name, t, dims in (("q", q, "(B, Hq, Nq, Dqk)"), ("k_pool", k_pool, "(P, Hkv, T, Dqk)"),
                          ("v_pool", v_pool, "(P, Hkv, T, Dv)")):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"attention: with paged=, {name} must be a {dims} tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"attention: {name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64")
    if not q.dtype == k_pool.dtype == v_pool.dtype:
        raise TypeError(f"attention: q, k_pool, v_pool must share a dtype, got {q.dtype}, {k_pool.dtype}, "
                        f"{v_pool.dtype}; cast them with .to(dtype)")
    if k_pool.shape[:3] != v_pool.shape[:3] or q.shape[3] != k_pool.shape[3] or k_pool.shape[1] == 0 \
            or q.shape[1] % k_pool.shape[1]:
        raise ValueError(f"attention: q {_shape(q)}, k_pool {_shape(k_pool)}, v_pool {_shape(v_pool)} disagree (need "
                         "k_pool (P, Hkv, T, Dqk), v_pool (P, Hkv, T, Dv), q (B, Hq, Nq, Dqk), Hq % Hkv == 0)")
    B, Nq, T = q.shape[0], q.shape[2], k_pool.shape[2]
    NB = tables.shape[1] if isinstance(tables, torch.Tensor) and tables.dim() == 2 else None
    for name, t, want in (("block_tables", tables, (B, NB if NB is not None else "NB")),
                          ("kv_positions", kv_pos, (B, NB * T if NB is not None else "NB * T")),
                          ("q_positions", q_pos, (B, Nq))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be an integer tensor {want}, got {type(t).__name__}")
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"attention: {name} must hold int64 (or int32) ids, got {t.dtype}")
        if tuple(t.shape) != want:
            raise ValueError(f"attention: {name} must be {want} for q {_shape(q)} and blocks of {T} slots, got "
                             f"{_shape(t)}")
        if t.device != q.device:
            raise ValueError(f"attention: {name} is on {t.device} but q is on {q.device}; move it with .to(q.device)")
    raise ValueError(f"attention: paged window must be an int >= 1 (keys per query, the query included) or None, "
                     f"got {window!r}")

