"""Every compiled CPU operator against its torch-op twin, on the same seeded random valid and invalid inputs (#46).

The twin of a kernel is the path its Python caller takes when the kernels are off (``QKV_CPU_KERNELS=0``): the
public entry point is called twice, kernels on and off, and the two must agree: equal results (NaN at the same
places, the rest within the float32 budget) or the same exception type. The inputs are drawn from one generator
seeded per case (``seed`` in every message): NaN and inf values, -1 and out-of-range ids, zero sizes, strided
and expanded views, both float dtypes. ``paged_store`` has no Python twin of its own (the cache's indexed write
is it) and is compared with that write; the int8 screen runs on every CPU qkv's kernels build for.
``weight_linear`` (float32, bf16 and int8 weights) runs its kernel up to 16 rows and its twin beyond, so its cases stay
at up to 16 rows.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv import masks as M
from qkv.backends.paged import paged_decode_blocks, paged_prefill_blocks
from qkv.cpu import kernels, ops
from qkv.cpu.skinny import skinny_linear
from qkv.cpu.weights import quantize_int8, weight_linear
from qkv.linear import gated_delta_chunked
from qkv.nn._recurrent import delta_mix
from qkv.nn.activations import gated
from qkv.nn.moe import Experts
from qkv.nn.norm import RMSNorm
from qkv.pos.rope import apply_rotary

pytestmark = pytest.mark.xdist_group("cpu_kernels")

CASES = 24  # seeded cases per operator: the whole file runs in well under a minute on one core
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True, scope="module")
def _built():
    if kernels.unavailable_reason() is not None:
        pytest.fail(f"the compiled kernels must build here: {kernels.unavailable_reason()}")


@contextlib.contextmanager
def _kernels(on: bool):
    old = os.environ.get(kernels.ENV)
    os.environ[kernels.ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(kernels.ENV, None)
        else:
            os.environ[kernels.ENV] = old


def _call(fn, on: bool):
    with _kernels(on), torch.no_grad():
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the exception is what is compared
            return e


def _flat(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _flat(item)]
    if hasattr(x, "_fields") or hasattr(x, "__dict__"):
        return [t for item in (x if isinstance(x, tuple) else vars(x).values()) for t in _flat(item)]
    return []


def agree(what: str, fn, *, atol: float = 2e-5, rtol: float = 2e-5) -> str:
    """Run ``fn`` on the kernels and on the torch ops; raise ``AssertionError`` unless both raise the same type or
    both return tensors of one shape and dtype with NaN at the same places and the rest close. Returns "ok" or the
    exception type's name."""
    a, b = _call(fn, True), _call(fn, False)
    if isinstance(a, Exception) or isinstance(b, Exception):
        assert type(a) is type(b), (f"{what}: compiled {type(a).__name__}: {a}; torch ops "
                                    f"{type(b).__name__}: {b}")
        return type(a).__name__
    ta, tb = _flat(a), _flat(b)
    assert len(ta) == len(tb), f"{what}: {len(ta)} tensors vs {len(tb)}"
    for i, (x, y) in enumerate(zip(ta, tb, strict=True)):
        assert x.shape == y.shape and x.dtype == y.dtype, f"{what}[{i}]: {x.shape} {x.dtype} vs {y.shape} {y.dtype}"
        if not x.is_floating_point():
            assert torch.equal(x, y), f"{what}[{i}]: integer results differ"
            continue
        assert torch.equal(x.isnan(), y.isnan()), (f"{what}[{i}]: NaN at {int(x.isnan().sum())} places on the "
                                                   f"kernel, {int(y.isnan().sum())} on the torch ops")
        assert torch.equal(x.isinf(), y.isinf()) and torch.equal(x[x.isinf()], y[y.isinf()]), f"{what}[{i}]: inf"
        fin = x.isfinite()
        scale = float(y[fin].abs().max()) if fin.any() else 1.0
        torch.testing.assert_close(x[fin], y[fin], atol=atol * max(1.0, scale), rtol=rtol, msg=f"{what}[{i}]")
    return "ok"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pick(g: torch.Generator, options):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def _poison(g: torch.Generator, t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` with one entry NaN / +inf / -inf (kind), or as is ("none")."""
    if kind == "none" or t.numel() == 0:
        return t
    t = t.clone()
    flat = t.view(-1)
    flat[int(torch.randint(flat.numel(), (1,), generator=g))] = {"nan": NAN, "inf": INF, "-inf": -INF}[kind]
    return t


def _view(g: torch.Generator, t: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as a strided view (last dim of stride 1 kept, rows interleaved) or as they are."""
    if kind == "strided" and t.dim() >= 2 and t.numel():
        wide = torch.empty(*t.shape[:-2], t.shape[-2] * 2, t.shape[-1], dtype=t.dtype).normal_(generator=g)
        wide[..., ::2, :] = t
        return wide[..., ::2, :]
    return t


POISONS = ["none", "none", "nan", "inf", "-inf"]
DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("seed", range(CASES))
def test_gather_attention(seed):
    g = _gen(seed)
    dt = _pick(g, DTYPES)
    B, Hkv, G = _pick(g, [1, 2]), _pick(g, [1, 2]), _pick(g, [1, 2, 4, 8])
    Nq, Nk, D, K = _pick(g, [0, 1, 7, 70]), _pick(g, [1, 9, 80]), _pick(g, [8, 16]), _pick(g, [0, 1, 5])
    q = _view(g, torch.randn(B, Hkv * G, Nq, D, generator=g, dtype=dt), _pick(g, ["plain", "strided"]))
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=dt)
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=dt)
    k = _poison(g, k, _pick(g, POISONS))
    q = _poison(g, q, _pick(g, POISONS))
    heads = _pick(g, [1, Hkv * G])
    idx = torch.randint(-1, Nk, (1 if _pick(g, [0, 1]) else B, heads, Nq, K), generator=g)
    bad = _pick(g, ["none", "none", "none", "past_end", "below"])
    if bad != "none" and idx.numel():
        idx.view(-1)[0] = Nk + 3 if bad == "past_end" else -2
    idx = idx.expand(B, -1, -1, -1) if _pick(g, [0, 1]) else idx
    sinks = _poison(g, torch.randn(Hkv * G, generator=g, dtype=dt), _pick(g, POISONS)) if _pick(g, [0, 1]) else None
    causal = _pick(g, [False, True])

    def call():
        mask = M.topk(idx) & M.causal() if causal else M.topk(idx)
        return qkv.attention(q, k, v, mask=mask, sinks=sinks, backend="gather", return_lse=True)

    agree(f"gather seed={seed} dtype={dt} q={tuple(q.shape)} k={tuple(k.shape)} K={K} bad={bad}", call)


@pytest.mark.parametrize("seed", range(CASES))
def test_gated_delta_chunks(seed):
    g = _gen(seed)
    dt = _pick(g, DTYPES)
    B, Hk, r = _pick(g, [1, 2]), _pick(g, [1, 2]), _pick(g, [1, 2])
    N, Dk, Dv = _pick(g, [0, 1, 17, 40]), _pick(g, [0, 4, 16]), _pick(g, [0, 4, 8])
    q = torch.randn(B, Hk, N, Dk, generator=g, dtype=dt)
    k = F.normalize(torch.randn(B, Hk, N, Dk, generator=g, dtype=dt), dim=-1)
    v = torch.randn(B, Hk * r, N, Dv, generator=g, dtype=dt)
    gate = -torch.rand(*((B, Hk * r, N) if _pick(g, [0, 1]) else (B, Hk * r, N, Dk)), generator=g, dtype=dt)
    gate = _poison(g, gate, _pick(g, ["none", "nan", "-inf", "-inf"]))
    beta = torch.rand(B, Hk * r, N, generator=g, dtype=dt)
    q, v = _poison(g, q, _pick(g, POISONS)), _view(g, v, _pick(g, ["plain", "strided"]))
    state = torch.randn(B, Hk * r, Dk, Dv, generator=g, dtype=dt) if _pick(g, [0, 1]) else None
    chunk = _pick(g, [None, 1, 5, 16])

    def call():
        return gated_delta_chunked(q, k, v, gate, beta, chunk_size=chunk, initial_state=state)

    agree(f"gated_delta seed={seed} dtype={dt} v={tuple(v.shape)} Dk={Dk} chunk={chunk}", call, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(CASES))
def test_delta_decode(seed):
    g = _gen(seed)
    dt = _pick(g, DTYPES)
    B, Hk, r, Dk, Dv, Kt = _pick(g, [1, 3]), _pick(g, [1, 2]), _pick(g, [1, 2]), _pick(g, [4, 8]), 4, _pick(g, [2, 4])
    H = Hk * r
    Cc = 2 * Hk * Dk + H * Dv
    mixed = _poison(g, torch.randn(B, 1, Cc, generator=g, dtype=dt), _pick(g, POISONS))
    conv_w = torch.randn(Cc, 1, Kt, generator=g, dtype=dt)
    gate = -torch.rand(*((B, H, 1) if _pick(g, [0, 1]) else (B, H, 1, Dk)), generator=g, dtype=dt)
    gate = _poison(g, gate, _pick(g, ["none", "nan", "-inf"]))
    beta = torch.rand(B, H, 1, generator=g, dtype=dt)

    def call():
        return delta_mix(mixed, conv_w, gate, beta, None, Hk=Hk, Dk=Dk, Dv=Dv, chunk_size=None, one_token=True)

    agree(f"delta_decode seed={seed} dtype={dt} B={B} Hk={Hk} H={H}", call, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(CASES))
def test_rows_linear(seed):
    g = _gen(seed)
    dt = _pick(g, DTYPES)
    rows, K, N = _pick(g, [1, 2, 5]), _pick(g, [1, 64, 300]), _pick(g, [1, 128, 1000])
    x = _poison(g, torch.randn(rows, K, generator=g, dtype=dt), _pick(g, POISONS))
    w = torch.randn(N, K, generator=g, dtype=dt)
    b = torch.randn(N, generator=g, dtype=dt) if _pick(g, [0, 1]) else None
    agree(f"rows_linear seed={seed} dtype={dt} x={tuple(x.shape)} w={tuple(w.shape)}",
          lambda: skinny_linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(CASES))
def test_weight_linear(seed):
    g = _gen(seed)
    xdt = _pick(g, [torch.float32, torch.bfloat16])
    rows, K, N = _pick(g, [0, 1, 2, 5, 16]), _pick(g, [0, 1, 9, 64, 300]), _pick(g, [0, 1, 7, 128, 1000])
    x = _poison(g, torch.randn(rows, K, generator=g), _pick(g, POISONS)).to(xdt)
    w = torch.randn(N, K, generator=g)
    fmt = _pick(g, ["int8", "bf16", "f32"])
    q, s = quantize_int8(w) if fmt == "int8" else (w.to(torch.bfloat16) if fmt == "bf16" else w, None)
    if s is not None and _pick(g, [0, 0, 1]):  # a wrong count of scales: refused the same way on both paths
        s = s[: max(N - 1, 0)]
    b = torch.randn(N, generator=g) if _pick(g, [0, 1]) else None
    agree(f"weight_linear seed={seed} x={xdt} {tuple(x.shape)} w={q.dtype} {tuple(q.shape)}",
          lambda: weight_linear(x, q, s, b), atol=1e-5 if xdt == torch.float32 else 1e-2,
          rtol=1e-5 if xdt == torch.float32 else 1e-2)


@pytest.mark.parametrize("seed", range(CASES))
def test_silu_mul(seed):
    g = _gen(seed)
    dt = _pick(g, DTYPES)
    shape = _pick(g, [(0, 8), (3, 8), (2, 5, 32), (1, 0), (4, 7)])  # (4, 7): an odd width
    h = _view(g, _poison(g, torch.randn(*shape, generator=g, dtype=dt), _pick(g, POISONS)),
              _pick(g, ["plain", "strided"]))
    agree(f"silu_mul seed={seed} dtype={dt} h={tuple(h.shape)}", lambda: gated(h, F.silu), atol=0, rtol=0)


@pytest.mark.parametrize("seed", range(CASES))
def test_rotary(seed):
    g = _gen(seed)
    dt = _pick(g, DTYPES)
    B, H, N, D = _pick(g, [1, 2]), _pick(g, [1, 3]), _pick(g, [0, 1, 9]), _pick(g, [8, 16])
    R = _pick(g, [D, D // 2, 6, 3])  # 3: odd, refused
    x = _view(g, _poison(g, torch.randn(B, H, N, D, generator=g, dtype=dt), _pick(g, POISONS)),
              _pick(g, ["plain", "strided"]))
    ang = torch.rand(*((B, N, R) if _pick(g, [0, 1]) else (N, R)), generator=g, dtype=dt) * 6
    cos, sin = ang.cos(), ang.sin()
    interleaved = _pick(g, [False, True])
    agree(f"rotary seed={seed} dtype={dt} x={tuple(x.shape)} R={R}",
          lambda: apply_rotary(x, cos, sin, interleaved=interleaved), atol=0, rtol=0)


@pytest.mark.parametrize("seed", range(CASES))
def test_rms_norm(seed):
    g = _gen(seed)
    dt = _pick(g, [*DTYPES, torch.bfloat16])
    d = _pick(g, [1, 8, 100])
    norm = RMSNorm(d, eps=_pick(g, [1e-6, 0.0]), offset=_pick(g, [0.0, 1.0])).to(dt)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    x = _view(g, _poison(g, torch.randn(_pick(g, [0, 1, 3]), d, generator=g, dtype=dt), _pick(g, POISONS)),
              _pick(g, ["plain", "strided"]))
    low = dt == torch.bfloat16  # float32 arithmetic rounded once: the two may round a value to neighbouring bf16s
    agree(f"rms_norm seed={seed} dtype={dt} x={tuple(x.shape)} eps={norm.eps}", lambda: norm(x),
          atol=1e-2 if low else 1e-6, rtol=2.0 ** -7 if low else 1e-5)


@pytest.mark.parametrize("seed", range(CASES))
def test_moe(seed):
    """``moe_token`` (one token) and ``moe_grouped`` (a few): the experts' loop is the twin; ids outside the
    experts are refused by both alike."""
    g = _gen(seed)
    dt = _pick(g, DTYPES)
    E, d, f, k, T = _pick(g, [2, 4]), 16, 8, _pick(g, [1, 2]), _pick(g, [1, 1, 3])
    experts = Experts(E, d, f, "silu").to(dt)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.3, generator=g)
    x = _poison(g, torch.randn(T, d, generator=g, dtype=dt), _pick(g, POISONS))
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    bad = _pick(g, ["none", "none", "none", "minus_one", "past_end"])
    if bad != "none":
        idx[0, 0] = -1 if bad == "minus_one" else E
    w = torch.rand(T, k, generator=g)
    agree(f"moe seed={seed} dtype={dt} T={T} E={E} k={k} bad={bad}", lambda: experts(x, idx, w), atol=1e-5)


@pytest.mark.parametrize("seed", range(CASES))
def test_decode_attention(seed):
    """Float32/float64, and bfloat16 (the kernel in float32 rounded once, SDPA's bfloat16 path the twin: one
    rounding of the output apart)."""
    g = _gen(seed)
    dt = _pick(g, DTYPES + [torch.bfloat16])
    B, Hkv, G, S, D = _pick(g, [1, 3]), _pick(g, [1, 2]), _pick(g, [1, 4]), _pick(g, [1, 5, 40]), _pick(g, [8, 16])
    q = _poison(g, torch.randn(B, Hkv * G, 1, D, generator=g, dtype=dt), _pick(g, POISONS))
    k = _poison(g, torch.randn(B, Hkv, S, D, generator=g, dtype=dt), _pick(g, POISONS))
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=dt)
    kv_pos = torch.arange(S).expand(B, S).clone()
    kv_pos[:, int(torch.randint(S, (1,), generator=g))] = -1
    q_pos = torch.randint(-1, S + 2, (B, 1), generator=g)
    window = _pick(g, [None, 1, 4])
    sinks = torch.randn(Hkv * G, generator=g, dtype=dt) if _pick(g, [0, 1]) else None

    def call():
        mask = M.positions(q_pos, kv_pos, causal=True, window=window)
        return qkv.attention(q, k, v, mask=mask, sinks=sinks, backend="sdpa")

    tol = 1e-2 if dt == torch.bfloat16 else 1e-5
    agree(f"decode_attention seed={seed} dtype={dt} q={tuple(q.shape)} k={tuple(k.shape)} window={window}", call,
          atol=tol, rtol=max(tol, 1e-4))


def _pools(g, dt, P, Hkv, T, D):
    return torch.randn(P, Hkv, T, D, generator=g, dtype=dt), torch.randn(P, Hkv, T, D, generator=g, dtype=dt)


def _table(g, B, NB, P, T):
    tables = torch.randint(0, P, (B, NB), generator=g)
    lens = torch.randint(0, NB * T + 1, (B,), generator=g)
    kpos = torch.where(torch.arange(NB * T) < lens[:, None], torch.arange(NB * T), -1)
    bad = _pick(g, ["none", "none", "minus_one", "minus_seven", "past_end"])
    if bad != "none":
        tables[int(torch.randint(B, (1,), generator=g)), int(torch.randint(NB, (1,), generator=g))] = \
            {"minus_one": -1, "minus_seven": -7, "past_end": P}[bad]
    return tables, kpos, lens, bad


@pytest.mark.parametrize("seed", range(CASES))
def test_paged_decode(seed):
    g = _gen(seed)
    dt = _pick(g, DTYPES + [torch.bfloat16])  # bfloat16: both sides in float32, rounded once
    B, Hkv, G, T, D, NB, P = _pick(g, [1, 3]), _pick(g, [1, 2, 0]), _pick(g, [1, 3]), _pick(g, [2, 16]), 8, \
        _pick(g, [1, 3]), _pick(g, [4, 9])
    kp, vp = _pools(g, dt, P, Hkv, T, D)
    kp = _poison(g, kp, _pick(g, POISONS))
    tables, kpos, lens, bad = _table(g, B, NB, P, T)
    q = _view(g, _poison(g, torch.randn(B, max(Hkv, 1) * G, D, generator=g, dtype=dt), _pick(g, POISONS)),
              _pick(g, ["plain", "strided"]))
    qpos = (lens - 1).clamp_min(0)
    window = _pick(g, [None, 1, 5])
    tol = 1e-2 if dt == torch.bfloat16 else 1e-5
    agree(f"paged_decode seed={seed} dtype={dt} Hkv={Hkv} bad={bad}",
          lambda: paged_decode_blocks(q, kp, vp, tables, kpos, qpos, window=window), atol=tol, rtol=max(tol, 1e-4))


@pytest.mark.parametrize("seed", range(CASES))
def test_paged_prefill(seed):
    g = _gen(seed)
    dt = _pick(g, DTYPES)
    B, Hkv, G, T, D, NB, P, N = _pick(g, [1, 2]), _pick(g, [1, 2, 0]), _pick(g, [1, 3]), _pick(g, [2, 16]), 8, \
        _pick(g, [1, 3]), _pick(g, [4, 9]), _pick(g, [0, 1, 5])
    kp, vp = _pools(g, dt, P, Hkv, T, D)
    kp = _poison(g, kp, _pick(g, POISONS))  # not v: a masked slot's NaN value reaches the row on the torch ops
    tables, kpos, lens, bad = _table(g, B, NB, P, T)
    q = _poison(g, torch.randn(B, max(Hkv, 1) * G, N, D, generator=g, dtype=dt), _pick(g, POISONS))
    if _pick(g, [0, 1]):
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) memory, the layout a projection gives
    qpos = (lens[:, None] - N + torch.arange(N)).clamp_min(-1)
    sinks = torch.randn(max(Hkv, 1) * G, generator=g, dtype=dt) if _pick(g, [0, 1]) else None
    causal = _pick(g, [True, False])
    agree(f"paged_prefill seed={seed} dtype={dt} Hkv={Hkv} N={N} bad={bad}",
          lambda: paged_prefill_blocks(q, kp, vp, tables, kpos, qpos, causal=causal, sinks=sinks),
          atol=1e-5, rtol=1e-4)


def _store_twin(kp, vp, k, v, blocks, offsets, src):
    """The cache's indexed write (qkv.cache.paged.PagedStore.write without the kernels)."""
    B, H, n, D = k.shape
    kp[blocks, :, offsets] = k.transpose(1, 2).reshape(B * n, H, D)[src]
    vp[blocks, :, offsets] = v.transpose(1, 2).reshape(B * n, H, v.shape[-1])[src]


@pytest.mark.parametrize("seed", range(CASES))
def test_paged_store(seed):
    g = _gen(seed)
    dt = _pick(g, DTYPES)
    P, H, T, D, B, n = _pick(g, [3, 8]), _pick(g, [1, 2]), _pick(g, [2, 4]), 8, _pick(g, [1, 2]), _pick(g, [0, 1, 3])
    k = _poison(g, torch.randn(B, H, n, D, generator=g, dtype=dt), _pick(g, POISONS))
    v = torch.randn(B, H, n, D, generator=g, dtype=dt)
    real = torch.randperm(P * T, generator=g)[:B * n]  # distinct slots: a step never writes one twice
    src = torch.randperm(B * n, generator=g)[:int(torch.randint(B * n + 1, (1,), generator=g))]
    blocks, offsets = real[:src.numel()] // T, real[:src.numel()] % T
    bad = _pick(g, ["none", "none", "block", "offset", "src"])
    if bad != "none" and src.numel():
        {"block": blocks, "offset": offsets, "src": src}[bad][0] = -1
    base = _pools(g, dt, P, H, T, D)
    results = []
    for fn in (ops.paged_store, _store_twin):
        kp, vp = (t.clone() for t in base)
        try:
            fn(kp, vp, k, v, blocks, offsets, src)
            results.append((kp, vp))
        except (RuntimeError, IndexError) as e:
            results.append(e)
    what = f"paged_store seed={seed} dtype={dt} n={n} bad={bad}"
    if bad != "none" and src.numel():
        assert isinstance(results[0], RuntimeError), f"{what}: the kernel took an id outside its range"
        return
    assert not isinstance(results[0], Exception) and not isinstance(results[1], Exception), f"{what}: {results}"
    for x, y in zip(results[0], results[1], strict=True):
        assert torch.equal(x.nan_to_num(), y.nan_to_num()) and torch.equal(x.isnan(), y.isnan()), what


def test_screened_argmax():
    """The int8 screen's tokens equal the float32 (or bfloat16) head's argmax (first largest), NaN rows included:
    through torch's
    int8 GEMM where this CPU has one, else through qkv's own AVX2 (or portable) integer sums."""
    from qkv.cpu.greedy import HeadScreen, screen_unavailable_reason

    assert screen_unavailable_reason() is None  # an int8 GEMM (AMX, AVX512-VNNI) or AVX2's 16-bit multiply-adds
    for seed in range(CASES):
        g = _gen(seed)
        V, Kd, rows = _pick(g, [7, 300, 1000]), _pick(g, [16, 64]), _pick(g, [1, 3, 17])
        w = torch.randn(V, Kd, generator=g)
        x = _poison(g, torch.randn(rows, Kd, generator=g), _pick(g, POISONS))
        cap = _pick(g, [None, None, 0.5, 30.0])
        if _pick(g, [0, 0, 1]):  # a bfloat16 model's head: its own bf16 logits (the bf16-weight kernel) decide
            x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
        got = HeadScreen().tokens(x, w, cap)
        with torch.no_grad():
            logits = weight_linear(x, w) if w.dtype == torch.bfloat16 else F.linear(x, w)
        ref = (logits if cap is None else cap * torch.tanh(logits / cap)).argmax(-1)
        fine = ~logits.isnan().any(-1)
        assert torch.equal(got[fine], ref[fine]), f"screen seed={seed} V={V} K={Kd} rows={rows} cap={cap}"
