"""``qkv.distributed.attention``: exact attention over a sequence sharded across processes, any scheme.

Shape legend: B batch, Hq/Hkv heads, n local length (every rank the same), W ranks, N = W * n global length.
"""

from __future__ import annotations

import zlib

import torch

from .._request import AttentionOutput, build_request
from ..masks.base import Mask
from ..mods.base import as_score_mod
from .allgather import AllGatherAttention
from .exchange import CommLog, Exchange, dtype_code
from .groups import UspGroups
from .plan import Plan
from .ring import RingAttention
from .sharding import SCHEMES, layout, world_and_rank
from .ulysses import ulysses_attention
from .usp import usp_attention

__all__ = ["attention", "ring_attention"]

_SCHEME_IDS = {name: i for i, name in enumerate(SCHEMES)}


def _fingerprint(obj) -> int:
    return 0 if obj is None else zlib.crc32(repr(obj).encode())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Mask | None = None, score_mod=None,
              scheme: str = "ring", group=None, scale: float | None = None, return_lse: bool = False,
              timeout: float | None = None, documents: torch.Tensor | None = None, backend: str = "auto",
              log: CommLog | None = None, all_to_all: str = "auto", check: bool = True):
    """Exact attention over a sequence sharded across the ranks of ``group``; call it on every rank.

    Each rank passes its shard (from :func:`qkv.distributed.shard` with the same ``scheme``) and gets the
    rows of single-device ``qkv.attention`` over the whole sequence that belong to its queries.

    Args:
        q: (B, Hq, n, Dqk) this rank's queries; every rank the same shape and dtype.
        k, v: (B, Hkv, n_k, Dqk), (B, Hkv, n_k, Dv) this rank's keys and values (``Dv`` may differ).
        mask: a :mod:`qkv.masks` mask of the *global* problem (Nq = W * n, Nk = W * n_k), evaluated at the
            tokens' global positions: causal (either alignment), sliding window, document ids, padding,
            prefix-LM, dense, functions. Blocks it empties are skipped.
        score_mod: :mod:`qkv.mods` modifiers by global position and head (ALiBi, softcap, biases). Learnable
            tensors they hold receive this rank's share of the gradient: sum it across ranks (all-reduce, as
            DDP does for parameters).
        scheme: ``"ring"``, ``"zigzag"``, ``"stripe"``, ``"allgather"``, ``"ulysses"`` or ``"usp"``.
        group: the process group (default: the world); for ``"usp"`` the result of :func:`usp_groups`.
        scale: default ``Dqk ** -0.5``.
        return_lse: also return the log-sum-exp (B, Hq, n), float32 (float64 for float64 inputs).
        timeout: seconds any collective may wait (default ``DEFAULT_TIMEOUT``); a dead or stalled peer raises
            :class:`CollectiveTimeout` naming the scheme and the step.
        documents: (N,) global document ids, for the zigzag layouts balanced per document (pass the same
            ids to :func:`shard`); the document mask itself is ``mask=qkv.masks.document(ids)``.
        backend: the qkv backend for each block.
        log: a :class:`CommLog` that records collectives, bytes and block work of this call (and its backward).
        all_to_all: ``"auto"``/``"native"`` (the backend's all-to-all) or ``"p2p"`` (pairwise sends).
        check: agree on shapes, dtypes, scale, the description of the mask and modifiers and the document
            ids across ranks before any data moves (two small all-gathers); a mismatch raises ``ValueError``
            naming the rank. ``False`` skips the mask, modifier, scale and document fingerprints (host-side
            hashing) but still agrees on shapes and dtypes, whose mismatch would otherwise abort a rank.

    Returns:
        ``out`` (B, Hq, n, Dv) in the input dtype, or ``AttentionOutput(out, lse)`` with ``return_lse``.
        Differentiable in q, k, v, the lse and learnable score-modifier tensors; backward accumulates in float32.

    Example:
        >>> # torchrun --nproc-per-node 2:  (q, k, v global, same on every rank)
        >>> # ql, kl, vl = (shard(t, scheme="zigzag") for t in (q, k, v))
        >>> # out = attention(ql, kl, vl, mask=qkv.masks.causal(), scheme="zigzag")
        >>> # unshard(out, scheme="zigzag") equals qkv.attention(q, k, v, mask=qkv.masks.causal())
    """
    if scheme not in SCHEMES:
        raise ValueError(f"qkv.distributed.attention: unknown scheme {scheme!r}; choose one of {list(SCHEMES)}")
    if scheme == "usp" and not isinstance(group, UspGroups):
        raise ValueError("qkv.distributed.attention: scheme='usp' needs its two process groups; pass "
                         "group=qkv.distributed.usp_groups(ulysses=U) (created once, on every rank)")
    if scheme != "usp" and isinstance(group, UspGroups):
        raise ValueError(f"qkv.distributed.attention: group is a UspGroups but scheme is {scheme!r}; pass "
                         "group.parent, or scheme='usp'")
    world, rank = world_and_rank(group)
    req = build_request(q, k, v, scale=scale, return_lse=return_lse)
    B, Hq, nq, nk = req.B, req.Hq, req.Nq, req.Nk
    NQ, NK = nq * world, nk * world
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(f"qkv.distributed.attention: mask must be a qkv.masks mask, got {type(mask).__name__}")
    mod = as_score_mod(score_mod)
    for name, obj in (("mask", mask), ("score_mod", mod)):
        if obj is None:
            continue
        try:
            obj.check(B, Hq, NQ, NK)
        except ValueError as e:
            raise ValueError(f"qkv.distributed.attention: the {name} must describe the global problem (Nq = {NQ}, "
                             f"Nk = {NK} over {world} ranks, by global position); build it for the whole sequence, "
                             f"not the local shard. {e}") from e
    if documents is not None and NQ != NK:
        raise ValueError(f"qkv.distributed.attention: documents= balances self-attention; got Nq={NQ}, Nk={NK}")
    q_lay = layout(scheme, NQ, world, documents=documents)
    k_lay = q_lay if NK == NQ else layout(scheme, NK, world, documents=documents)
    pg = group.parent if isinstance(group, UspGroups) else group
    ex = Exchange(pg, scheme, timeout, log, all_to_all=all_to_all)
    mod_tensors = mod.tensors() if mod is not None else ()
    shapes = {"scheme": (_SCHEME_IDS[scheme],), "dtype": (dtype_code(q.dtype),), "q shape": tuple(q.shape),
              "k shape": tuple(k.shape), "v shape": tuple(v.shape), "needs grad": (int(req.requires_grad),)}
    if check:
        ex.agree({**shapes, "mask": (_fingerprint(mask),), "score_mod": (_fingerprint(mod),),
                  "scale": (zlib.crc32(repr(req.scale).encode()),),
                  "documents": (0 if documents is None else zlib.crc32(documents.cpu().numpy().tobytes()),)},
                 device=q.device)
    else:  # shapes and dtypes always: a mismatch there would abort a rank inside the transport (SIGABRT on gloo)
        ex.agree(shapes, device=q.device)
    if scheme in ("ring", "zigzag", "stripe", "allgather"):
        dev = q.device
        plan = Plan(ex, rank, world, [i.to(dev) for i in q_lay.index], [i.to(dev) for i in k_lay.index],
                    [q_lay.segments(r) for r in range(world)], [k_lay.segments(r) for r in range(world)],
                    0, Hq, NQ, NK, mask, mod, req.scale, backend, log, mod_tensors)
        fn = AllGatherAttention if scheme == "allgather" else RingAttention
        out, lse = fn.apply(plan, q, k, v, *mod_tensors)
    elif scheme == "ulysses":
        out, lse = ulysses_attention(ex, q, k, v, q_lay, k_lay, mask=mask, mod=mod, scale=req.scale,
                                     backend=backend, log=log, mod_tensors=mod_tensors, return_lse=return_lse)
    else:
        ex_u = Exchange(group.ulysses, scheme, timeout, log, all_to_all=all_to_all)
        ex_r = Exchange(group.ring, scheme, timeout, log)
        out, lse = usp_attention(group, ex_u, ex_r, q, k, v, q_lay, k_lay, mask=mask, mod=mod, scale=req.scale,
                                 backend=backend, log=log, mod_tensors=mod_tensors, return_lse=return_lse)
    return AttentionOutput(out, lse) if return_lse else out


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs):
    """:func:`attention` with ``scheme="ring"`` (contiguous chunks)."""
    return attention(q, k, v, scheme="ring", **kwargs)
