"""Helpers for the tiled backend and attention_probs tests: inputs, the naive same-dtype baseline with
gradients, and a forward+backward error-budget check against the float64 reference."""

from __future__ import annotations

import torch

import qkv
from qkv import masks as M
from qkv._request import build_request
from qkv.backends.tiled import TiledBackend, TiledConfig
from qkv.mods import as_score_mod
from qkv.testing import assert_within_budget

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def sid(B, Hq, Hkv, Nq, Nk, D, Dv=None) -> str:
    """Readable id: ``B2-H4-KV2-N63-D64`` or ``B1-H2-Nq5-Nk9-D8-Dv4``."""
    s = f"B{B}-H{Hq}" + (f"-KV{Hkv}" if Hkv != Hq else "") + (f"-N{Nq}" if Nq == Nk else f"-Nq{Nq}-Nk{Nk}")
    return s + f"-D{D}" + (f"-Dv{Dv}" if Dv not in (None, D) else "")


def inputs(B, Hq, Hkv, Nq, Nk, D, Dv=None, *, dtype=torch.float32, seed=0):
    """(float64 master q, k, v), (the same values in ``dtype``), and an output gradient (float64).
    The master is the round trip of the low-precision values, so both sides see identical inputs."""
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    raw = [torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64),
           torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64),
           torch.randn(B, Hkv, Nk, Dv, generator=g, dtype=torch.float64)]
    master = [t.to(dtype).to(torch.float64) for t in raw]
    cast = [t.to(dtype) for t in master]
    dout = torch.randn(B, Hq, Nq, Dv, generator=g, dtype=torch.float64)
    return master, cast, dout


def tiled(block_q=32, block_k=32, chunk=2, budget=1 << 16) -> TiledBackend:
    """A tiled backend with small tiles, so small problems still have many tiles and several steps."""
    return TiledBackend(TiledConfig(block_q, block_k, chunk, budget))


def run_backend(backend, q, k, v, **kw):
    """Run a backend instance (or a registered name) on one request; returns AttentionOutput."""
    if isinstance(backend, str):
        return qkv.attention(q, k, v, backend=backend, return_lse=True, **kw)
    return backend.run(build_request(q, k, v, return_lse=True, **kw))


def naive(q, k, v, *, mask=None, score_mod=None, scale=None):
    """Plain eager attention entirely in the inputs' dtype (the budget baseline); differentiable, and
    rows with no allowed key give zeros (and zero gradients) instead of NaN."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k = k.repeat_interleave(Hq // Hkv, 1)
    v = v.repeat_interleave(Hq // Hkv, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    b, h = torch.arange(B).view(-1, 1, 1, 1), torch.arange(Hq).view(1, -1, 1, 1)
    qi, kj = torch.arange(Nq).view(1, 1, -1, 1), torch.arange(Nk).view(1, 1, 1, -1)
    mod = as_score_mod(score_mod)
    if mod is not None:
        s = mod.apply(s, b, h, qi, kj, Nq, Nk).to(q.dtype)
    if mask is None:
        return torch.softmax(s, -1) @ v
    allowed = torch.broadcast_to(mask.allowed(b, h, qi, kj, Nq, Nk), s.shape)
    some = allowed.any(-1, keepdim=True)
    s = s.masked_fill(~allowed, float("-inf")).masked_fill(~some, 0.0)
    return (torch.softmax(s, -1) * some) @ v


def _grads(fn, tensors, dout):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out = out.out if isinstance(out, tuple) else out
    gs = torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True)
    return out.detach(), [g if g is not None else torch.zeros_like(t) for g, t in zip(gs, leaves)]


def check_against_reference(backend, B, Hq, Hkv, Nq, Nk, D, Dv=None, *, dtype=torch.float32, mask=None,
                            mods_fn=None, mod_tensors=(), backward=True, seed=0, what=""):
    """Forward (out, lse) and, if asked, gradients of q, k, v and of ``mod_tensors`` within budget.

    ``mods_fn(*tensors)`` builds the score modifier from the (differentiable) ``mod_tensors``.
    """
    master, cast, dout = inputs(B, Hq, Hkv, Nq, Nk, D, Dv, dtype=dtype, seed=seed)
    mt64 = [t.detach().to(torch.float64) for t in mod_tensors]
    mtc = [t.detach().to(torch.float64) if dtype == torch.float64 else t.detach() for t in mod_tensors]

    def bind(run):
        return lambda q, k, v, *mt: run(q, k, v, mods_fn(*mt) if mods_fn is not None else None)

    ref = bind(lambda q, k, v, sm: run_backend("reference", q, k, v, mask=mask, score_mod=sm))
    cand = bind(lambda q, k, v, sm: run_backend(backend, q, k, v, mask=mask, score_mod=sm))
    base = bind(lambda q, k, v, sm: naive(q, k, v, mask=mask, score_mod=sm))

    r = run_backend("reference", *master, mask=mask, score_mod=mods_fn(*mt64) if mods_fn else None)
    c = run_backend(backend, *cast, mask=mask, score_mod=mods_fn(*mtc) if mods_fn else None)
    n = naive(*cast, mask=mask, score_mod=mods_fn(*mtc) if mods_fn else None)
    assert c.out.dtype == dtype and c.out.shape == r.out.shape, (c.out.dtype, c.out.shape)
    want_lse = torch.float64 if dtype == torch.float64 else torch.float32
    assert c.lse.dtype == want_lse and c.lse.shape == r.lse.shape, (c.lse.dtype, c.lse.shape)
    assert not torch.isnan(c.out).any(), f"{what}: NaN in output"
    assert_within_budget(c.out, r.out, n, what=f"{what} out")
    lse_base = run_backend("reference", *cast, mask=mask, score_mod=mods_fn(*mtc) if mods_fn else None).lse
    assert torch.equal(torch.isneginf(c.lse), torch.isneginf(r.lse)), f"{what}: lse -inf rows differ"
    # lse is float32 by the contract (float64 for float64 inputs); the 1e-5 floor covers float32 rounding.
    assert_within_budget(c.lse, r.lse.double(), lse_base, what=f"{what} lse", floor=1e-5)
    if not backward:
        return
    _, g_ref = _grads(ref, [*master, *mt64], dout)
    _, g_cand = _grads(cand, [*cast, *mtc], dout)
    _, g_base = _grads(base, [*cast, *mtc], dout)
    names = ["dq", "dk", "dv"] + [f"dmod{i}" for i in range(len(mod_tensors))]
    # Gradients sum over many terms: measure them relative to the problem's gradient scale (the
    # largest q/k/v gradient), so the floor scales alike; an exactly-zero gradient is then held to
    # that scale's rounding too (FlashAttention-2's D = rowsum(dO * O) rounds differently from dP).
    scale = max(1.0, *(float(g.abs().max()) for g in g_ref[:3] if g.numel()))
    for name, gc, gr, gb in zip(names, g_cand, g_ref, g_base):
        assert not torch.isnan(gc).any(), f"{what}: NaN in {name}"
        assert_within_budget(gc / scale, gr / scale, gb / scale, what=f"{what} {name}")


def sparse_masks(N: int, B: int = 2, seed: int = 0) -> dict[str, M.Mask]:
    """Every mask kind (and some combinations) for an (N, N) problem with batch ``B``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, N + 1, (B,), generator=g)
    lengths[0] = max(1, N // 3)
    ids = torch.sort(torch.randint(0, 4, (B, N), generator=g), dim=1).values
    adj = torch.rand(N, N, generator=g) < 0.05
    dense = torch.rand(B, 1, N, N, generator=g) < 0.3
    dense[:, :, : N // 2, : N // 2] = True  # some FULL tiles too
    pos = torch.arange(N).expand(B, N).clone()
    pos[:, :3] = -1
    return {
        "causal": M.causal(),
        "causal_tl": M.causal(align="top_left"),
        "window": M.sliding_window(20),
        "window_lr": M.sliding_window(7, 9),
        "padding": M.padding(lengths),
        "document": M.document(ids),
        "prefix_lm": M.prefix_lm(torch.randint(0, N + 1, (B,), generator=g)),
        "global": M.global_tokens([0, N // 2]),
        "longformer": M.sliding_window(8, 8) | M.global_tokens([0, N // 2]),
        "strided": M.strided(8),
        "fixed": M.fixed(16, 3),
        "bigbird": M.bigbird(16, 3, 1, 1, seed=seed),
        "graph": M.graph(adj),
        "dense": M.dense(dense),
        "from_fn": M.from_fn(lambda b, h, q, k: (q + 2 * k + h) % 5 != 0),
        "positions": M.positions(pos, pos, window=24),
        "causal&padding": M.causal() & M.padding(lengths),
        "window|global": M.sliding_window(4) | M.global_tokens([1]),
        "not_window&causal": ~M.sliding_window(10) & M.causal(),
    }
