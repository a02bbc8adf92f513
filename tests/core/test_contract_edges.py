"""Nothing silently wrong, round three (issue 29): the operator, masks and backends.

One test per finding, each named after what it checks. Every numerical check compares against a float64
computation written out here (not qkv's reference backend) with an error budget (qkv.testing).
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.masks.base import EMPTY
from qkv.testing import assert_within_budget


def _by_definition(q, k, v, allowed, dtype):
    """softmax(scale q k^T, masked) v in ``dtype``; ``allowed`` (Nq, Nk) or broadcastable to (B, H, Nq, Nk)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def _dilated(b, h, q, k):
    """A user mask on positions: causal, every other key (the dilated window of the finding)."""
    return (k <= q) & ((q - k) % 2 == 0)


def _positions_mask(nq, nk):
    qp = torch.arange(nq).view(-1, 1) + nk - nq
    kp = torch.arange(nk).view(1, -1)
    return (kp <= qp) & ((qp - kp) % 2 == 0)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("nq", [1, 5], ids=["decode", "chunk"])
def test_user_mask_sees_positions_so_decode_matches_the_full_pass(backend, nq):
    """from_fn's predicate gets query positions (bottom-right): the last rows decoded alone or in a chunk
    equal the same rows of the full pass, alone and composed with causal()."""
    torch.manual_seed(0)
    N = 13
    q, k, v = (torch.randn(2, 2, N, 16) for _ in range(3))
    want64 = _by_definition(q.double(), k.double(), v.double(), _positions_mask(N, N), torch.float64)[:, :, -nq:]
    base = _by_definition(q, k, v, _positions_mask(N, N), torch.float32)[:, :, -nq:]
    for mask in (M.from_fn(_dilated), M.from_fn(lambda b, h, q, k: (q - k) % 2 == 0) & M.causal()):
        got = qkv.attention(q[:, :, -nq:], k, v, mask=mask, backend=backend)
        assert_within_budget(got, want64, base, what=f"{backend} {mask!r} Nq={nq} of Nk={N}")


def test_user_mask_top_left_alignment_passes_row_indices():
    m = M.from_fn(lambda b, h, q, k: k <= q, align="top_left")
    assert torch.equal(m.dense(1, 1, 2, 4)[0, 0], M.causal(align="top_left").dense(1, 1, 2, 4)[0, 0])
    assert torch.equal(M.from_fn(lambda b, h, q, k: k <= q).dense(1, 1, 2, 4)[0, 0], M.causal().dense(1, 1, 2, 4)[0, 0])
    with pytest.raises(ValueError, match="align"):
        M.from_fn(lambda b, h, q, k: k <= q, align="top")


def test_user_mask_decode_on_flex_matches_the_full_pass():
    """One tiny compiled Flex case: a decode step with a user mask equals the last row of the full pass."""
    from qkv._request import build_request
    from qkv.backends.flex import FlexBackend

    torch.manual_seed(1)
    N = 13
    q, k, v = (torch.randn(1, 2, N, 16) for _ in range(3))
    req = build_request(q[:, :, -1:], k, v, mask=M.from_fn(_dilated))
    reason = FlexBackend().decline(req)
    if reason is not None:
        pytest.skip(f"flex declines here: {reason}")
    with torch.no_grad():
        got = qkv.attention(q[:, :, -1:], k, v, mask=M.from_fn(_dilated), backend="flex")
    want64 = _by_definition(q.double(), k.double(), v.double(), _positions_mask(N, N), torch.float64)[:, :, -1:]
    base = _by_definition(q, k, v, _positions_mask(N, N), torch.float32)[:, :, -1:]
    assert_within_budget(got, want64, base, what="flex decode, from_fn dilated causal")


def _head_reader(b, h, q, k):
    """Head 0 sees only key 0; head 1 sees every key at or before its position."""
    return torch.where(h == 0, k == 0, k <= q)


def test_block_map_refuses_a_head_dependent_mask_without_the_head_count():
    m = M.from_fn(_head_reader)
    with pytest.raises(ValueError, match=r"block_map.*H="):
        m.block_map(32, 32, 8, 8)
    with pytest.raises(ValueError, match=r"sparsity.*H="):
        m.sparsity(32, 32)
    bm = m.block_map(32, 32, 8, 8, H=2)[0, 0]
    assert int((bm == EMPTY).sum()) == 6, "tiles head 1 reads must not be EMPTY"  # strictly above the diagonal


def test_sparsity_reads_every_head():
    m = M.from_fn(_head_reader)
    N = 16
    want = 1 - (N + N * (N + 1) / 2) / (2 * N * N)  # head 0: one key per row; head 1: causal
    assert m.sparsity(N, N, H=2) == pytest.approx(want)


def test_triton_lowering_covers_every_head_of_a_head_reading_mask():
    """The Triton lowering lists the tiles of every head: head 1's causal tiles must be visited."""
    from qkv.backends.triton._lower import lower_mask

    plan = lower_mask(M.from_fn(_head_reader), 1, 2, 64, 64, 16, 16, "cpu")
    assert plan.visited == 10, f"visited {plan.visited} tiles; the causal tiles of head 1 are 10"
    assert plan.tile_heads, "partial tiles must be kept per head"


def test_nan_is_never_reported_as_an_empty_row():
    """A NaN score or sink makes the row NaN (out and lse), never "empty" (zeros, lse = -inf)."""
    q = torch.randn(1, 2, 3, 8)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    q[0, 0, 1, 0] = float("nan")
    for backend in ("reference", "tiled"):
        res = qkv.attention(q, k, v, return_lse=True, backend=backend)
        assert torch.isnan(res.lse[0, 0, 1]) and torch.isnan(res.out[0, 0, 1]).all(), backend
        assert torch.isfinite(res.lse[0, 1]).all() and torch.isfinite(res.lse[0, 0, [0, 2]]).all(), backend
    sinks = torch.tensor([float("nan"), 0.0])
    res = qkv.attention(torch.randn(1, 2, 3, 8), k, v, sinks=sinks, return_lse=True, backend="reference")
    assert torch.isnan(res.out[0, 0]).all() and torch.isnan(res.lse[0, 0]).all(), "a NaN sink must not be ignored"
    assert torch.isfinite(res.out[0, 1]).all()


def test_merge_keeps_nan_and_ignores_the_buffer_of_an_empty_part():
    a = torch.randn(1, 2, 3, 8)
    untouched = torch.full_like(a, float("nan"))  # a split-KV slot no key reached
    m = qkv.merge_states([a, untouched], [torch.zeros(1, 2, 3), torch.full((1, 2, 3), float("-inf"))])
    assert torch.equal(m.out, a) and torch.equal(m.lse, torch.zeros(1, 2, 3))
    lse = torch.zeros(1, 2, 3)
    lse[0, 1, 2] = float("nan")
    m = qkv.merge_states([a, a], [torch.zeros(1, 2, 3), lse])
    assert torch.isnan(m.lse[0, 1, 2]) and torch.isnan(m.out[0, 1, 2]).all(), "a NaN lse was read as empty"
    assert torch.isfinite(m.lse[0, 0]).all()


def test_sdpa_rows_whose_scores_overflow_are_nan_like_the_reference():
    """Finite inputs whose scores overflow float32: SDPA's CPU kernel (few keys) returned zeros."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 3, 8, generator=g) * 1e20, torch.randn(1, 2, 3, 8, generator=g) * 1e20
    v = torch.randn(1, 2, 3, 8, generator=g)
    want = qkv.attention(q, k, v, backend="reference")
    got = qkv.attention(q, k, v, backend="sdpa")
    assert torch.isnan(want).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "overflowing rows must be NaN, not zeros"


def test_float64_inputs_keep_a_float64_lse_through_merges():
    """The reference is the float64 oracle: float64 in, float64 lse out, and a split-KV merge of float64 parts
    agrees with one call to float64 rounding (a float32 lse left 6e-8)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 5, 16, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = torch.randn(2, 2, 40, 16, generator=g, dtype=torch.float64), torch.randn(2, 2, 40, 16, generator=g,
                                                                                      dtype=torch.float64)
    for backend in ("reference", "tiled"):
        whole = qkv.attention(q, k, v, return_lse=True, backend=backend)
        assert whole.lse.dtype == torch.float64, backend
        parts = [qkv.attention(q, k[:, :, s], v[:, :, s], return_lse=True, backend=backend)
                 for s in (slice(0, 13), slice(13, 40))]
        m = qkv.merge_states([p.out for p in parts], [p.lse for p in parts])
        assert m.lse.dtype == torch.float64
        err = max(float((m.out - whole.out).abs().max()), float((m.lse - whole.lse).abs().max()))
        assert err < 1e-12, f"{backend}: float64 merge off by {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_of_large_magnitude_scores_matches_one_call(dtype):
    """q scaled by 30: lse far above 88, where a merge without the max subtraction overflows float32."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 6, 32, generator=g, dtype=torch.float64) * 30
    k, v = torch.randn(2, 2, 50, 32, generator=g, dtype=torch.float64), torch.randn(2, 2, 50, 32, generator=g,
                                                                                      dtype=torch.float64)
    ref = qkv.attention(q, k, v, return_lse=True, backend="reference")
    assert float(ref.lse.max()) > 88, "the case must reach lse values where exp overflows float32"
    qc, kc, vc = (t.to(dtype) for t in (q, k, v))
    base = qkv.attention(qc, kc, vc, return_lse=True, backend="reference")
    cuts = (0, 7, 31, 50)
    parts = [qkv.attention(qc, kc[:, :, a:b], vc[:, :, a:b], return_lse=True, backend="reference")
             for a, b in zip(cuts[:-1], cuts[1:])]
    m = qkv.merge_states([p.out for p in parts], [p.lse for p in parts])
    assert torch.isfinite(m.out).all() and torch.isfinite(m.lse).all()
    assert_within_budget(m.out, ref.out, base.out, what=f"merged out {dtype}")
    assert_within_budget(m.lse, ref.lse, base.lse, what=f"merged lse {dtype}", floor=1e-4 * float(ref.lse.abs().max()))


def _ring_worker(rank: int, world: int, port: int, outdir: str) -> None:
    import datetime
    import os

    import torch.distributed as dist

    import qkv.distributed as cp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        for dtype in (torch.float64, torch.float32):
            for scheme in ("ring", "zigzag"):
                q, k, v, dout = _ring_inputs()
                ql, kl, vl = (cp.shard(t.to(dtype), scheme=scheme).clone().requires_grad_(True) for t in (q, k, v))
                res = cp.attention(ql, kl, vl, mask=M.causal(), scheme=scheme, return_lse=True, timeout=60.0)
                ((res.out.to(dtype) * cp.shard(dout.to(dtype), scheme=scheme)).sum() + res.lse.sum()).backward()
                un = lambda t: cp.unshard(t.detach(), scheme=scheme)  # noqa: E731
                results[(scheme, dtype)] = (un(res.out), cp.unshard(res.lse.detach().unsqueeze(-1), scheme=scheme)
                                            .squeeze(-1), [un(t.grad) for t in (ql, kl, vl)])
    finally:
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _ring_inputs():
    g = torch.Generator().manual_seed(6)
    q, k, v, dout = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(4))
    return q * 30, k, v, dout


def _one_call(dtype):
    q, k, v, dout = _ring_inputs()
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    res = qkv.attention(q, k, v, mask=M.causal(), return_lse=True, backend="reference")
    ((res.out * dout.to(dtype)).sum() + res.lse.sum()).backward()
    return res.out.detach(), res.lse.detach(), [q.grad, k.grad, v.grad]


def test_context_parallel_float64_and_large_scores_match_one_call(tmp_path):
    """Ring and zigzag over 2 ranks with q scaled by 30 (lse above 88): float64 agrees with one float64 call to
    float64 rounding, forward and backward (a float32 lse left ~1e-7), and float32 stays within budget."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ring_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    out64, lse64, grads64 = _one_call(torch.float64)
    assert float(lse64.max()) > 88, "the case must reach lse values where exp overflows float32"
    base = _one_call(torch.float32)
    for scheme in ("ring", "zigzag"):
        out, lse, grads = got[(scheme, torch.float64)]
        assert lse.dtype == torch.float64, f"{scheme}: float64 inputs gave a {lse.dtype} lse"
        for name, a, b in [("out", out, out64), ("lse", lse, lse64)] + list(zip(("dq", "dk", "dv"), grads, grads64)):
            err = float((a - b).abs().max()) / max(1.0, float(b.abs().max()))
            assert err < 1e-12, f"{scheme} float64 {name} off by {err:.2e}"
        out, lse, grads = got[(scheme, torch.float32)]
        assert_within_budget(out, out64, base[0], what=f"{scheme} float32 out")
        assert_within_budget(lse, lse64, base[1], what=f"{scheme} float32 lse", floor=1e-4 * float(lse64.abs().max()))
        scale = max(float(g.abs().max()) for g in grads64)
        for name, a, b, c in zip(("dq", "dk", "dv"), grads, grads64, base[2]):
            assert_within_budget(a / scale, b / scale, c / scale, what=f"{scheme} float32 {name}")


def test_unpacking_two_results_without_return_lse_raises():
    q = torch.randn(2, 2, 4, 8)  # batch 2: unpacking would silently split the batch
    with pytest.raises(TypeError, match="return_lse=True"):
        out, lse = qkv.attention(q, q, q)
    out, lse = qkv.attention(q, q, q, return_lse=True)
    assert out.shape == (2, 2, 4, 8) and lse.shape == (2, 2, 4)
    first, second = qkv.attention(q, q, q).unbind(0)  # splitting the batch on purpose still works
    assert torch.equal(torch.stack([first, second]), qkv.attention(q, q, q))
    a, b = qkv.sdpa(q, q, q)  # the drop-in returns what torch returns, as torch does
    assert torch.allclose(torch.stack([a, b]), torch.nn.functional.scaled_dot_product_attention(q, q, q), atol=1e-6)


def test_unpack_guard_keeps_torch_compile_working():
    q = torch.randn(2, 2, 4, 8)
    fn = torch.compile(lambda q: qkv.attention(q, q, q, mask=M.causal()) * 2, backend="eager", fullgraph=False)
    want = qkv.attention(q, q, q, mask=M.causal()) * 2
    assert torch.allclose(fn(q), want, atol=1e-6)


def test_transposed_layout_warns_under_the_documented_rule():
    x = torch.randn(2, 100, 8, 16)  # (B, N, H, D) passed without layout=
    with pytest.warns(UserWarning, match="layout='bnhd'"):
        qkv.attention(x, x, x, mask=M.causal())
    qkv.attention(x, x, x, layout="bnhd")
    legit = {
        "stated": (x, x, x, dict(layout="bhnd")),
        "decode-128-heads": (torch.randn(1, 128, 1, 16), torch.randn(1, 128, 5, 16), torch.randn(1, 128, 5, 16), {}),
        "short-prompt-32-heads": (torch.randn(1, 32, 5, 16),) * 3 + ({},),
        "short-cache-gqa": (torch.randn(1, 128, 2, 16), torch.randn(1, 8, 3, 16), torch.randn(1, 8, 3, 16), {}),
        "cross-attention-short-memory": (torch.randn(1, 64, 40, 16), torch.randn(1, 64, 3, 16),
                                         torch.randn(1, 64, 3, 16), {}),
    }
    import warnings

    for name, (q, k, v, kw) in legit.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            qkv.attention(q, k, v, **kw)
        assert not [w for w in seen if "layout" in str(w.message)], f"{name}: a legitimate call warned"


def test_bigbird_holds_a_bounded_number_of_patterns():
    """A decode loop asks for one more key each step: the mask must not keep one pattern per length."""
    m = M.bigbird(4, 3, 1, 1, seed=0)
    first = m.coarse(40).clone()
    for nk in range(1, 400):
        m.coarse(nk)
    held = sum(t.numel() for t in m._cache.values())
    assert len(m._cache) <= 8 and held <= 8 * 100 ** 2, f"{len(m._cache)} patterns, {held} cells held"
    assert torch.equal(m.coarse(40), first), "an evicted pattern must come back the same (seeded)"
    assert torch.equal(m.coarse(37), first), "lengths in one block count share the pattern"


class _Counting:
    """A user predicate (a sliding window of 64 on positions) that counts its evaluations."""

    def __init__(self):
        self.calls = 0

    def __call__(self, b, h, q, k):
        self.calls += 1
        return (k <= q) & (q - k < 64)


def test_auto_with_a_user_mask_decides_once_per_mask_object():
    from qkv._attention import _choose
    from qkv._request import build_request

    fn = _Counting()
    mask = M.from_fn(fn)
    q = torch.randn(1, 2, 1024, 16)  # past SMALL_PROBLEM: auto estimates every backend
    req = build_request(q, q, q, mask=mask)
    first = _choose(req, "auto").name
    assert fn.calls > 0
    fn.calls = 0
    again = _choose(build_request(q, q, q, mask=mask), "auto").name
    assert again == first and fn.calls == 0, f"the second choice evaluated the predicate {fn.calls} times"


def test_explain_counts_the_predicate_cost_of_a_user_mask():
    from qkv.backends.base import PREDICATE_PAIR_SECONDS

    q = torch.randn(1, 2, 1024, 16)
    pairs = 2 * 1024 * 1024
    ex = qkv.explain(q, q, q, mask=M.from_fn(_Counting()))
    for name in ("tiled", "sdpa"):
        est = ex.estimates[name]
        assert est.seconds >= pairs * PREDICATE_PAIR_SECONDS, (name, est)
    assert "predicate" in ex.estimates["tiled"].note, ex.estimates["tiled"]
    analytic = qkv.explain(q, q, q, mask=M.sliding_window(63))
    assert "predicate" not in analytic.estimates["tiled"].note


def test_a_user_block_map_is_a_public_extension_point():
    """from_fn(block_map=...) gives the tiles without evaluating the predicate; results are unchanged."""
    from qkv.masks.base import predicate_block_map

    def window_tiles(nq, nk, bq, bk, B, H, device):
        return predicate_block_map(M.sliding_window(63), 1, 1, nq, nk, bq, bk, device)

    fn = _Counting()
    mask = M.from_fn(fn, block_map=window_tiles)
    bm = mask.block_map(300, 300, 32, 32, H=2)
    assert fn.calls == 0 and torch.equal(bm, M.sliding_window(63).block_map(300, 300, 32, 32))
    assert mask.predicate_pairs(1, 2, 300, 300) == 0
    q, k, v = (torch.randn(1, 2, 300, 16, dtype=torch.float64) for _ in range(3))
    want = qkv.attention(q, k, v, mask=M.sliding_window(63), backend="reference")
    assert torch.allclose(qkv.attention(q, k, v, mask=mask, backend="tiled"), want, atol=1e-12)
    bad = M.from_fn(fn, block_map=lambda *a: torch.zeros(3, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match="from_fn: block_map returned"):
        bad.block_map(300, 300, 32, 32, H=2)


def test_flex_cpu_rows_at_a_ragged_length_with_several_batches_and_heads():
    """B = H = 2, D = 16, N = 40 (the shape a probe saw Flex's CPU kernel return wrong rows for): every row of
    every head within budget of float64, over several calls of one compiled kernel (the error was run to run)."""
    from qkv._request import build_request
    from qkv.backends.flex import FlexBackend

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(3))
    reason = FlexBackend().decline(build_request(q, k, v))
    if reason is not None:
        pytest.skip(f"flex declines here: {reason}")
    for _ in range(5):
        q, k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(3))
        with torch.no_grad():
            got = qkv.attention(q, k, v, backend="flex")
        want = _by_definition(q.double(), k.double(), v.double(), torch.ones(40, 40, dtype=torch.bool), torch.float64)
        base = _by_definition(q, k, v, torch.ones(40, 40, dtype=torch.bool), torch.float32)
        assert_within_budget(got, want, base, what="flex B2-H2-N40-D16")


def test_flex_is_declined_on_the_avx2_kernel_that_returns_wrong_rows(monkeypatch):
    """The AVX2 Flex CPU kernel of this torch returns wrong rows at B = H = 2, D = 16, N = 40 (reproduced with
    ATEN_CPU_CAPABILITY=avx2): an AVX2 CPU must not get Flex, neither by name nor from auto."""
    from qkv._request import build_request
    from qkv.backends import flex

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    flex._cpu_problem.cache_clear()
    try:
        q = torch.randn(2, 2, 40, 16)
        reason = flex.FlexBackend().decline(build_request(q, q, q))
        assert reason is not None and "AVX2" in reason and "wrong rows" in reason, reason
        with pytest.raises(ValueError, match="AVX2"):
            with torch.no_grad():
                qkv.attention(q, q, q, backend="flex")
        assert "flex" in qkv.explain(q, q, q).declined
    finally:
        flex._cpu_problem.cache_clear()
