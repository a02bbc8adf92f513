"""The block paths of a paged decode step (qkv.backends.paged) against the float64 reference: every test runs twice,
on the compiled kernel (qkv's CPU kernels built: the visible slots read in place) and on the torch ops
(QKV_CPU_KERNELS=0)."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.backends.paged import SPAN_TOKENS, paged_decode_blocks
from qkv.testing import assert_within_budget

pytestmark = [pytest.mark.xdist_group("cpu_kernels"), pytest.mark.usefixtures("kernel_path")]


def _case(seed: int, *, B: int, Hq: int, Hkv: int, D: int, Dv: int, T: int, lens: list[int], first: list[int],
          dtype=torch.float32):
    """Pools of shuffled blocks; row b holds lens[b] tokens from position first[b] on (its table's leading entries
    before that are filler, as a sliding layer's dropped blocks are), the rest of its table filler."""
    g = torch.Generator().manual_seed(seed)
    nb = max(-(-(f + n) // T) for f, n in zip(first, lens, strict=True)) or 1
    P = B * nb + 3
    kp = torch.randn(P, Hkv, T, D, generator=g, dtype=dtype)
    vp = torch.randn(P, Hkv, T, Dv, generator=g, dtype=dtype)
    order = torch.randperm(P, generator=g)
    tables = torch.full((B, nb), int(order[-1]))
    kpos = torch.full((B, nb * T), -1)
    used = 0
    for b, (f, n) in enumerate(zip(first, lens, strict=True)):
        blocks = range(f // T, -(-(f + n) // T))
        for j in blocks:
            tables[b, j] = order[used]
            used += 1
        kpos[b, f:f + n] = torch.arange(f, f + n)
    qpos = torch.tensor([f + n - 1 if n else 0 for f, n in zip(first, lens, strict=True)])
    q = torch.randn(B, Hq, D, generator=g, dtype=dtype)
    return q, kp, vp, tables, kpos, qpos


def _reference(q, kp, vp, tables, kpos, qpos, *, window, scale=None):
    B, Hkv = q.shape[0], kp.shape[1]
    k_all = kp[tables].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, kp.shape[-1])
    v_all = vp[tables].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, vp.shape[-1])
    mask = M.positions(qpos[:, None], kpos, causal=True, window=window)
    ref = qkv.attention(q[:, :, None].double(), k_all.double(), v_all.double(), mask=mask, scale=scale,
                        backend="reference", return_lse=True)
    base = qkv.attention(q[:, :, None], k_all, v_all, mask=mask, scale=scale, backend="reference", return_lse=True)
    return ref, base


@pytest.mark.parametrize("window", [None, 7, 70])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("T", [4, 16, 48])  # spans of 16, 4 and 1 blocks (SPAN_TOKENS = 64)
def test_blocks_equal_the_reference(window, heads, T):
    Hq, Hkv = heads
    lens = [1, 5, 90, 37, 0, 130]
    first = [0, 0, 0, 9, 0, 3]  # rows 3 and 5 start after their tables' first entries
    q, kp, vp, tables, kpos, qpos = _case(T + Hq, B=6, Hq=Hq, Hkv=Hkv, D=16, Dv=24, T=T, lens=lens, first=first)
    out, lse = paged_decode_blocks(q, kp, vp, tables, kpos, qpos, window=window, scale=0.3)
    ref, base = _reference(q, kp, vp, tables, kpos, qpos, window=window, scale=0.3)
    assert out.shape == (6, Hq, 24) and lse.shape == (6, Hq) and out.dtype == torch.float32
    live = [0, 1, 2, 3, 5]
    assert_within_budget(out[live], ref.out[live, :, 0], base.out[live, :, 0], what="blocks out")
    assert_within_budget(lse[live], ref.lse[live, :, 0].double(), base.lse[live, :, 0], what="blocks lse",
                         floor=1e-5)
    assert bool((out[4] == 0).all()) and bool(torch.isneginf(lse[4]).all()), "a row with no key: zeros, -inf"


def test_float64_and_the_query_before_some_keys():
    """float64 in, float64 out; a query whose position lies before some stored slots sees only the earlier ones."""
    q, kp, vp, tables, kpos, qpos = _case(1, B=2, Hq=2, Hkv=1, D=8, Dv=8, T=4, lens=[11, 6], first=[0, 0],
                                          dtype=torch.float64)
    qpos = torch.tensor([4, 5])  # row 0 sees 5 of its 11 slots
    out, lse = paged_decode_blocks(q, kp, vp, tables, kpos, qpos)
    ref, _ = _reference(q, kp, vp, tables, kpos, qpos, window=None)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref.out[:, :, 0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref.lse[:, :, 0].double(), atol=1e-12, rtol=1e-12)


def test_a_dead_block_between_live_ones():
    """A table whose live blocks are not one run (a filler entry, all slots empty, between them): every live block
    is read, the dead one masked."""
    T = SPAN_TOKENS // 2  # two blocks a span: a run counted by its live blocks alone would stop one block short
    q, kp, vp, tables, kpos, qpos = _case(3, B=2, Hq=2, Hkv=1, D=8, Dv=8, T=T, lens=[7 * T - 3, 9], first=[0, 0])
    kpos[0, 2 * T:3 * T] = -1  # row 0's third block holds nothing
    for window in (None, 5 * T):
        out, lse = paged_decode_blocks(q, kp, vp, tables, kpos, qpos, window=window)
        ref, base = _reference(q, kp, vp, tables, kpos, qpos, window=window)
        assert_within_budget(out, ref.out[:, :, 0], base.out[:, :, 0], what="gap")
        assert_within_budget(lse, ref.lse[:, :, 0].double(), base.lse[:, :, 0], what="gap lse", floor=1e-5)


def test_long_rows_cross_many_spans():
    """Rows longer than several spans: the split softmax merges them exactly."""
    T = 16
    lens = [SPAN_TOKENS * 5 + 3, SPAN_TOKENS - 1, SPAN_TOKENS]
    q, kp, vp, tables, kpos, qpos = _case(2, B=3, Hq=8, Hkv=2, D=32, Dv=32, T=T, lens=lens, first=[0, 0, 0])
    out, lse = paged_decode_blocks(q, kp, vp, tables, kpos, qpos)
    ref, base = _reference(q, kp, vp, tables, kpos, qpos, window=None)
    assert_within_budget(out, ref.out[:, :, 0], base.out[:, :, 0], what="long rows")
    assert_within_budget(lse, ref.lse[:, :, 0].double(), base.lse[:, :, 0], what="long rows lse", floor=1e-5)


@pytest.mark.parametrize("window", [None, 100])
def test_blocks_wider_than_a_span_and_model_shapes(window):
    """Blocks of 160 tokens (wider than the compiled kernel's span of 128 keys: one block a span) and the head
    shapes of a served model (8 query heads over 2 KV heads of 64 channels), float32."""
    lens, first = [480, 1, 300, 161], [0, 0, 0, 0]
    q, kp, vp, tables, kpos, qpos = _case(5, B=4, Hq=8, Hkv=2, D=64, Dv=64, T=160, lens=lens, first=first)
    out, lse = paged_decode_blocks(q, kp, vp, tables, kpos, qpos, window=window)
    ref, base = _reference(q, kp, vp, tables, kpos, qpos, window=window)
    assert_within_budget(out, ref.out[:, :, 0], base.out[:, :, 0], what="wide blocks")
    assert_within_budget(lse, ref.lse[:, :, 0].double(), base.lse[:, :, 0], what="wide blocks lse", floor=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_bfloat16_blocks_within_budget(window):
    """bfloat16 pools and queries, on the compiled kernel or the torch ops alike: computed in float32, out and lse
    rounded once to bfloat16, within budget of the float64 reference (bfloat16 attention the baseline); a row
    with no key gives zeros and -inf."""
    lens, first = [1, 70, 0, 33], [0, 0, 0, 5]
    q, kp, vp, tables, kpos, qpos = _case(8, B=4, Hq=4, Hkv=2, D=16, Dv=24, T=16, lens=lens, first=first,
                                          dtype=torch.bfloat16)
    out, lse = paged_decode_blocks(q, kp, vp, tables, kpos, qpos, window=window)
    assert out.dtype == lse.dtype == torch.bfloat16
    ref, base = _reference(q, kp, vp, tables, kpos, qpos, window=window)
    live = [0, 1, 3]
    assert_within_budget(out[live], ref.out[live, :, 0], base.out[live, :, 0], what="bf16 blocks out")
    assert_within_budget(lse[live], ref.lse[live, :, 0].double(), base.lse[live, :, 0], what="bf16 blocks lse")
    assert bool((out[2] == 0).all()) and bool(torch.isneginf(lse[2]).all())


def test_bad_input():
    q, kp, vp, tables, kpos, qpos = _case(0, B=2, Hq=2, Hkv=1, D=8, Dv=8, T=4, lens=[3, 2], first=[0, 0])
    with pytest.raises(ValueError, match="kv_positions"):
        paged_decode_blocks(q, kp, vp, tables, kpos[:, :3], qpos)
    with pytest.raises(ValueError, match="q must be a 3-D tensor"):
        paged_decode_blocks(q[:, :, None], kp, vp, tables, kpos, qpos)
    with pytest.raises(ValueError, match="disagree"):
        paged_decode_blocks(q[:, :, :4], kp, vp, tables, kpos, qpos)
    with pytest.raises(TypeError, match="float32/float64/bfloat16, got torch.float16"):
        paged_decode_blocks(q.half(), kp.half(), vp.half(), tables, kpos, qpos)
    with pytest.raises(TypeError, match="float32/float64/bfloat16"):
        paged_decode_blocks(q, kp.double(), vp, tables, kpos, qpos)
    bad = tables.clone()
    bad[0, 0] = kp.shape[0] + 5  # a visible slot's block outside the pool
    with pytest.raises(ValueError, match="outside the pool"):
        paged_decode_blocks(q, kp, vp, bad, kpos, qpos)


def test_the_paged_backend_takes_the_block_path_for_large_ragged_views_only(kernel_path):
    """A CPU decode step over rows of very different lengths is served by the block path (no view gathered) and
    equals attention over the gathered view. On the torch ops, rows of one length take the padded view (nothing
    to save), and so do small views (the block path's fixed cost); the compiled kernel serves every step. The cache
    never gathers a view for the step itself: the paged backend chooses, and qkv.explain names its path."""
    from qkv.backends.paged import BLOCKS_BELOW_FILL, BLOCKS_MIN_SLOTS
    from qkv.cache import FullSpec, KVCache, Paged

    g = torch.Generator().manual_seed(0)

    def step(lens, T=16):
        cache = KVCache([FullSpec(2, 16)], storage=Paged(block_size=T, num_blocks=1024))
        B, n = len(lens), max(lens)
        pos = torch.full((B, n), -1, dtype=torch.int64)
        for b, m in enumerate(lens):
            pos[b, n - m:] = torch.arange(m)
        cache.update(0, torch.randn(B, 2, n, 16, generator=g), torch.randn(B, 2, n, 16, generator=g), positions=pos)
        step_pos = torch.tensor(lens).view(B, 1)
        kv = torch.randn(B, 2, 1, 16, generator=g), torch.randn(B, 2, 1, 16, generator=g)
        view = cache.update(0, *kv, positions=step_pos, defer_view=True)
        q = torch.randn(B, 4, 1, 16, generator=g)
        store, slots = cache._layers[0].store, cache._manager.step
        paged = qkv.PagedKV(slots.tables[0], slots.view_pos[0], step_pos)
        return cache, view, q, step_pos, qkv.explain(q, store.kp, store.vp, paged=paged, scale=0.25)

    ragged = [1100, 10, 20, 5, 3, 300, 2, 1]
    slots = len(ragged) * -(-(max(ragged) + 1) // 16) * 16
    assert slots >= BLOCKS_MIN_SLOTS and (sum(ragged) + len(ragged)) / slots <= BLOCKS_BELOW_FILL
    for lens, T, why in ((ragged, 16, "ragged rows"), ([1100] * 8, 16, "rows of one length"),
                         ([40, 3, 2, 1], 4, "a small view")):
        cache, view, q, step_pos, report = step(lens, T)
        assert view.k is None, f"{why}: the cache gathers no view for an in-place step"
        assert report.chosen == "paged"
        if kernel_path == "compiled":
            assert report.note.startswith("compiled paged-decode kernel"), (why, report.note)
        elif lens is ragged:
            assert report.note.startswith("torch ops by blocks"), (why, report.note)
        else:
            assert report.note.startswith("torch ops over the gathered view"), (why, report.note)
        out = cache.decode(0, q, scale=0.25)
        full = cache.view(0)
        ref = qkv.attention(q, full.k, full.v, mask=M.positions(step_pos, full.kv_positions), scale=0.25)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
