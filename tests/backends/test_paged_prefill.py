"""Several queries per row over a paged cache's blocks (qkv.backends.paged.paged_prefill_blocks) against the float64
reference: every test runs twice, on the compiled kernel (the visible slots read in place, tile by tile of queries)
and on the torch ops over the gathered view (QKV_CPU_KERNELS=0)."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.backends.paged import paged_prefill_blocks
from qkv.testing import assert_within_budget

pytestmark = [pytest.mark.xdist_group("cpu_kernels"), pytest.mark.usefixtures("kernel_path")]


def _case(seed: int, *, Hq: int, Hkv: int, D: int, Dv: int, T: int, past: list[int], chunk: list[int], first=None,
          N: int | None = None, dtype=torch.float32, layout: str = "bhnd"):
    """Pools of shuffled blocks; row b holds its past[b] earlier tokens and this step's chunk[b] (from position
    first[b] on: the table's leading entries before that are filler, as a sliding layer's dropped blocks are); the
    step's N queries are the chunk, right-aligned behind padding queries (position -1)."""
    g = torch.Generator().manual_seed(seed)
    B = len(past)
    first = first or [0] * B
    N = N or max(chunk)
    lens = [p + c for p, c in zip(past, chunk, strict=True)]
    nb = max(-(-n // T) for n in lens) or 1
    P = B * nb + 3
    kp = torch.randn(P, Hkv, T, D, generator=g, dtype=dtype)
    vp = torch.randn(P, Hkv, T, Dv, generator=g, dtype=dtype)
    order = torch.randperm(P, generator=g)
    tables = torch.full((B, nb), int(order[-1]))
    kpos = torch.full((B, nb * T), -1)
    qpos = torch.full((B, N), -1)
    used = 0
    for b in range(B):
        for j in range(first[b] // T, -(-lens[b] // T)):
            tables[b, j] = order[used]
            used += 1
        kpos[b, first[b]:lens[b]] = torch.arange(first[b], lens[b])
        qpos[b, N - chunk[b]:] = torch.arange(past[b], lens[b])
    if layout == "bnhd":  # the projections' layout: (B, N, H, D) memory seen as (B, H, N, D)
        q = torch.randn(B, N, Hq, D, generator=g, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, N, D, generator=g, dtype=dtype)
    return q, kp, vp, tables, kpos, qpos


def _reference(q, kp, vp, tables, kpos, qpos, *, window=None, causal=True, scale=None, sinks=None):
    B, Hkv = q.shape[0], kp.shape[1]
    k_all = kp[tables].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, kp.shape[-1])
    v_all = vp[tables].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, vp.shape[-1])
    mask = M.positions(qpos, kpos, causal=causal, window=window)
    kw = dict(mask=mask, scale=scale, backend="reference", return_lse=True, sinks=sinks)
    ref = qkv.attention(q.double(), k_all.double(), v_all.double(), **kw)
    base = qkv.attention(q, k_all, v_all, **kw)
    return ref, base


def _check(out, lse, ref, base, qpos, what):
    live = (qpos >= 0).view(qpos.shape[0], 1, -1).expand(-1, out.shape[1], -1)
    assert_within_budget(out[live], ref.out[live], base.out[live], what=what)
    assert_within_budget(lse[live], ref.lse[live].double(), base.lse[live], what=f"{what} lse", floor=1e-5)
    assert bool((out[~live] == 0).all()) and bool(torch.isneginf(lse[~live]).all()), "padding queries: zeros, -inf"


@pytest.mark.parametrize("window", [None, 7, 70])
@pytest.mark.parametrize("heads", [(8, 2), (3, 3), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("T", [4, 16, 160])  # blocks narrower than the kernel's 128-key span, and wider
def test_chunks_equal_the_reference(window, heads, T):
    """Rows with and without earlier tokens, chunks of different widths (padding queries in front), rows whose
    table starts after filler entries, more queries than one tile holds."""
    Hq, Hkv = heads
    past, chunk, first = [0, 5, 90, 200, 3, 0], [37, 1, 70, 45, 12, 70], [0, 0, 0, 30, 0, 0]
    q, kp, vp, tables, kpos, qpos = _case(T + Hq, Hq=Hq, Hkv=Hkv, D=16, Dv=24, T=T, past=past, chunk=chunk,
                                          first=first, layout="bnhd")
    out, lse = paged_prefill_blocks(q, kp, vp, tables, kpos, qpos, window=window, scale=0.3)
    assert out.shape == (6, Hq, 70, 24) and lse.shape == (6, Hq, 70) and out.dtype == torch.float32
    ref, base = _reference(q, kp, vp, tables, kpos, qpos, window=window, scale=0.3)
    _check(out, lse, ref, base, qpos, "chunks")


@pytest.mark.parametrize("causal", [True, False])
def test_sinks_and_bidirectional(causal):
    """Sink logits (one more term in each softmax's denominator, no value) and a non-causal step (every filled
    slot), at a served model's head shapes (64 channels)."""
    q, kp, vp, tables, kpos, qpos = _case(4, Hq=8, Hkv=2, D=64, Dv=64, T=16, past=[0, 40, 300], chunk=[130, 9, 64])
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1))
    out, lse = paged_prefill_blocks(q, kp, vp, tables, kpos, qpos, causal=causal, sinks=sinks)
    ref, base = _reference(q, kp, vp, tables, kpos, qpos, causal=causal, sinks=sinks)
    _check(out, lse, ref, base, qpos, "sinks")


def test_float64_tight():
    q, kp, vp, tables, kpos, qpos = _case(2, Hq=4, Hkv=2, D=8, Dv=8, T=4, past=[0, 13], chunk=[20, 7],
                                          dtype=torch.float64)
    out, lse = paged_prefill_blocks(q, kp, vp, tables, kpos, qpos, window=9)
    ref, _ = _reference(q, kp, vp, tables, kpos, qpos, window=9)
    assert out.dtype == torch.float64
    live = (qpos >= 0)[:, None, :].expand(-1, 4, -1)
    torch.testing.assert_close(out[live], ref.out[live], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse[live], ref.lse[live].double(), atol=1e-12, rtol=1e-12)


def test_slots_out_of_position_order():
    """A table whose blocks hold positions out of order (the second block before the first, a gap between): the
    kernel's per-slot mask, not the one for ascending positions, decides what each query sees."""
    q, kp, vp, tables, kpos, qpos = _case(6, Hq=4, Hkv=1, D=16, Dv=16, T=8, past=[16], chunk=[8])
    tables = tables[:, [1, 0, 2]].contiguous()
    kpos = kpos.view(1, 3, 8)[:, [1, 0, 2]].reshape(1, 24).clone()
    kpos[0, 3] = -1  # an empty slot inside the first block
    out, lse = paged_prefill_blocks(q, kp, vp, tables, kpos, qpos, window=12)
    ref, base = _reference(q, kp, vp, tables, kpos, qpos, window=12)
    _check(out, lse, ref, base, qpos, "out of order")


@pytest.mark.parametrize("chunk, at", [(12, 6), (40, 21)])  # spans shorter and longer than one vector of scores
def test_a_non_finite_key_keeps_its_rows_nan(chunk, at):
    """A NaN key leaves the rows of the queries that see it NaN (the contract), the other queries finite."""
    q, kp, vp, tables, kpos, qpos = _case(7, Hq=2, Hkv=1, D=8, Dv=8, T=4, past=[0], chunk=[chunk])
    kp[tables[0, at // 4], 0, at % 4] = float("nan")
    out, _ = paged_prefill_blocks(q, kp, vp, tables, kpos, qpos)
    assert bool(out[0, :, at:].isnan().all()) and bool(out[0, :, :at].isfinite().all())


def test_no_queries_and_queries_before_every_key():
    q, kp, vp, tables, kpos, qpos = _case(8, Hq=2, Hkv=1, D=8, Dv=8, T=4, past=[0], chunk=[5])
    out, lse = paged_prefill_blocks(q[:, :, :0], kp, vp, tables, kpos, qpos[:, :0])
    assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)
    kpos2 = kpos.clone()
    kpos2[kpos2 >= 0] += 10  # every key after every query
    out, lse = paged_prefill_blocks(q, kp, vp, tables, kpos2, qpos)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


def test_bad_input():
    q, kp, vp, tables, kpos, qpos = _case(0, Hq=2, Hkv=1, D=8, Dv=8, T=4, past=[0, 2], chunk=[3, 2])
    with pytest.raises(ValueError, match=r"q must be a \(B, Hq, N, D\)"):
        paged_prefill_blocks(q[:, :, 0], kp, vp, tables, kpos, qpos)
    with pytest.raises(ValueError, match="q_positions must be"):
        paged_prefill_blocks(q, kp, vp, tables, kpos, qpos[:, :1])
    with pytest.raises(ValueError, match="kv_positions"):
        paged_prefill_blocks(q, kp, vp, tables, kpos[:, :3], qpos)
    with pytest.raises(ValueError, match="disagree"):
        paged_prefill_blocks(q[..., :4], kp, vp, tables, kpos, qpos)
    with pytest.raises(TypeError, match="float32/float64"):
        paged_prefill_blocks(q.bfloat16(), kp.bfloat16(), vp.bfloat16(), tables, kpos, qpos)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        paged_prefill_blocks(q, kp, vp, tables, kpos, qpos, window=0)
    with pytest.raises(ValueError, match="sinks must be a"):
        paged_prefill_blocks(q, kp, vp, tables, kpos, qpos, sinks=torch.zeros(3))
    bad = tables.clone()
    bad[0, 0] = kp.shape[0] + 5  # a visible slot's block outside the pool
    with pytest.raises(ValueError, match="outside the pool"):
        paged_prefill_blocks(q, kp, vp, bad, kpos, qpos)


def test_a_paged_cache_serves_prompt_chunks_in_place(kernel_path):
    """A prompt chunk over a paged KV cache: with the compiled kernels its view is never gathered (the chunk is
    attended in place), and every layer's output equals attention over the gathered view; on the torch ops the
    paged backend gathers the view itself (its torch-op path, named by qkv.explain), never the cache."""
    from qkv.cache import FullSpec, KVCache, Paged, SlidingWindowSpec
    from qkv.nn.cached import cached_attention

    g = torch.Generator().manual_seed(0)
    cache = KVCache([FullSpec(2, 16), SlidingWindowSpec(6, 2, 16)], storage=Paged(block_size=4, num_blocks=64))
    B, seen = 3, [0, 0, 0]
    for n in (9, 5, 1, 7):  # rows of different widths: right-aligned behind padding
        widths = [n, max(1, n - 3), n]
        pos = torch.full((B, n), -1)
        for b, w in enumerate(widths):
            pos[b, n - w:] = torch.arange(seen[b], seen[b] + w)
            seen[b] += w
        for layer, window in ((0, None), (1, 6)):
            q = torch.randn(B, 4, n, 16, generator=g)
            k, v = torch.randn(B, 2, n, 16, generator=g), torch.randn(B, 2, n, 16, generator=g)
            got = cached_attention(q, k, v, layer_idx=layer, cache=cache, positions=pos, window=window).out
            assert cache._layers[layer].last_view.k is None  # the cache gathered no view: the backend chose
            store, slots = cache._layers[layer].store, cache._manager.step
            paged = qkv.PagedKV(slots.tables[store.gi], slots.view_pos[store.gi], pos, window)
            path = qkv.explain(q, store.kp, store.vp, paged=paged).note
            if kernel_path == "compiled":
                assert path.startswith("compiled paged-"), (n, layer, path)
            elif n > 1:  # (one query per row on the torch ops: the block path's own rule)
                assert path.startswith("torch ops over the gathered view"), (n, layer, path)
            view = cache.view(layer)
            ref = qkv.attention(q, view.k, view.v, mask=M.positions(view.q_positions, view.kv_positions,
                                                                    window=window))
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
