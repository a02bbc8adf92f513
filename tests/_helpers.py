"""Shared test helpers: random inputs, the same-dtype eager baseline, readable ids, mask catalogue."""

from __future__ import annotations

import torch

import qkv
from qkv import masks as M
from qkv import mods

LOW = (torch.float16, torch.bfloat16)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def shape_id(B, Hq, Hkv, Nq, Nk, D, Dv=None, dtype=None) -> str:
    s = f"B{B}-H{Hq}" + (f"-KV{Hkv}" if Hkv != Hq else "") + (f"-N{Nq}" if Nq == Nk else f"-Nq{Nq}-Nk{Nk}")
    s += f"-D{D}" + (f"-Dv{Dv}" if Dv not in (None, D) else "")
    return s + (f"-{str(dtype).replace('torch.', '')}" if dtype is not None else "")


def make_qkv(B, Hq, Hkv, Nq, Nk, D, Dv=None, *, dtype=torch.float32, seed=0, requires_grad=False):
    """Fresh float64 master inputs and their cast to ``dtype`` (leaf tensors)."""
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q64 = torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64)
    k64 = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64)
    v64 = torch.randn(B, Hkv, Nk, Dv, generator=g, dtype=torch.float64)
    # Round-trip through the low dtype so reference and candidate see identical values.
    q64, k64, v64 = (t.to(dtype).to(torch.float64) for t in (q64, k64, v64))
    cast = [t.to(dtype).detach().clone().requires_grad_(requires_grad) for t in (q64, k64, v64)]
    master = [t.detach().clone().requires_grad_(requires_grad) for t in (q64, k64, v64)]
    return master, cast


def eager_same_dtype(q, k, v, *, mask=None, score_mod=None, scale=None):
    """A plain eager attention computed entirely in the inputs' dtype: the error-budget baseline."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    g = Hq // Hkv
    k = k.repeat_interleave(g, 1)
    v = v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    b = torch.arange(B).view(-1, 1, 1, 1)
    h = torch.arange(Hq).view(1, -1, 1, 1)
    qi = torch.arange(Nq).view(1, 1, -1, 1)
    kj = torch.arange(Nk).view(1, 1, 1, -1)
    if score_mod is not None:
        s = mods.as_score_mod(score_mod).apply(s, b, h, qi, kj, Nq, Nk).to(q.dtype)
    if mask is not None:
        s = s.masked_fill(~mask.allowed(b, h, qi, kj, Nq, Nk), float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)
    return p @ v


def mask_catalogue(B: int, Nq: int, Nk: int, seed: int = 0) -> dict[str, M.Mask]:
    """One instance of every mask kind that fits a (B, Nq, Nk) problem."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, Nk + 1, (B,), generator=g)
    ids = torch.sort(torch.randint(0, 3, (B, Nk), generator=g), dim=1).values
    adj = torch.rand(Nk, Nk, generator=g) < 0.2
    dense = torch.rand(B, 1, Nq, Nk, generator=g) < 0.5
    pos_k = torch.arange(Nk).expand(B, Nk).clone()
    pos_k[:, 0] = -1
    return {
        "none": None,
        "causal": M.causal(),
        "causal_top_left": M.causal(align="top_left"),
        "window": M.sliding_window(5),
        "window_lr": M.sliding_window(3, 2),
        "padding": M.padding(lengths),
        "document": M.document(ids),
        "prefix_lm": M.prefix_lm(torch.randint(0, Nk + 1, (B,), generator=g)),
        "longformer": M.sliding_window(4, 4) | M.global_tokens([0, Nk // 2]),
        "strided": M.strided(4),
        "fixed": M.fixed(8, 2),
        "bigbird": M.bigbird(4, 3, 1, 1, seed=seed),
        "graph": M.graph(adj),
        "dense": M.dense(dense),
        "from_fn": M.from_fn(lambda b, h, q, k: (q + k + h) % 3 != 0),
        "positions": M.positions(torch.arange(Nk - Nq, Nk).expand(B, Nq), pos_k, window=7),
        "causal&padding": M.causal() & M.padding(lengths),
        "not_window": ~M.sliding_window(2) & M.causal(),
    }


def reference64(master, **kw):
    """The specification: the reference backend on float64 inputs."""
    return qkv.attention(*master, backend="reference", **kw)
