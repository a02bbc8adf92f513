"""The tiled backend equals the float64 reference, forward and backward, and really skips tiles.

Every check is an error budget (qkv.testing): the tiled result's error against the float64 reference
must be within k times the error of a naive same-dtype computation. Small tiles (32 x 32, a small step
budget) make small problems exercise many tiles, ragged edges, several row batches and chunks.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from _helpers_tiled import DTYPE_NAMES, check_against_reference, inputs, naive, run_backend, sid, sparse_masks, tiled
from qkv import masks as M
from qkv import mods
from qkv._request import build_request
from qkv.backends._tiled_kernel import Problem, forward_slice
from qkv.backends._tiled_plan import build_plan
from qkv.masks.causal import SlidingWindow
from qkv.testing import assert_within_budget

SMALL = tiled(32, 32, 2, 1 << 16)
MASKS_113 = sparse_masks(113)


@pytest.mark.parametrize("name", list(MASKS_113))
def test_every_mask_forward_backward(name):
    what = f"{name} {sid(2, 4, 2, 113, 113, 32)}"
    check_against_reference(SMALL, 2, 4, 2, 113, 113, 32, mask=MASKS_113[name], what=what)


@pytest.mark.parametrize("name", ["causal", "document", "bigbird", "longformer"])
def test_default_tiles_through_attention(name):
    """Through ``qkv.attention(backend="tiled")`` with the default tile sizes."""
    mask = sparse_masks(300)[name]
    check_against_reference("tiled", 2, 4, 4, 300, 300, 32, mask=mask, what=name)


@pytest.mark.parametrize("name,block", [("window", 16), ("longformer", 16), ("bigbird", 16), ("window256", 64)])
def test_narrow_bands_take_fine_default_tiles(name, block):
    """Default tiles go from 128 to 64 when most visited tiles are PARTIAL, then halve while that cuts the
    computed pairs by a third: a +-16 window (with or without global tokens) and BigBird's 16-token blocks
    at N = 520 end at 16 x 16 tiles, a 256-key window stays at 64. The chosen tiles equal the float64
    reference forward and backward through ``qkv.attention``."""
    mask = {"window": M.sliding_window(16, 16), "longformer": M.sliding_window(16, 16) | M.global_tokens([0, 7]),
            "bigbird": M.bigbird(16, 3, 1, 1, seed=0), "window256": M.sliding_window(255)}[name]
    for n in (520, 4096):
        q = torch.zeros(1, 4, n, 16)
        cfg = qkv.backends.get("tiled").config_for(build_request(q, q, q, mask=mask))
        assert (cfg.block_q, cfg.block_k) == (block, block), (n, cfg)
    if block == 16:  # auto trains these on the tiled backend, not SDPA with a dense boolean mask
        for B in (2, 16):
            qb = torch.zeros(B, 4, 520, 16, requires_grad=True)
            assert qkv.explain(qb, qb, qb, mask=mask).chosen == "tiled", (B, qkv.explain(qb, qb, qb, mask=mask))
    check_against_reference("tiled", 2, 4, 4, 520, 520, 16, mask=mask, what=name)


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=list(DTYPE_NAMES.values()))
@pytest.mark.parametrize("mask_name", ["none", "causal", "window"])
def test_dtypes(dtype, mask_name):
    mask = {"none": None, "causal": M.causal(), "window": M.sliding_window(20)}[mask_name]
    check_against_reference(SMALL, 2, 4, 2, 63, 63, 16, dtype=dtype, mask=mask, what=f"{mask_name} {dtype}")


@pytest.mark.parametrize("n,block", [(1, 32), (63, 16), (63, 64), (113, 32), (113, 128), (64, 32), (128, 64)],
                         ids=lambda x: str(x))
def test_awkward_sizes_and_tiles(n, block):
    """Tile sizes that do and do not divide N, a single token, a single partial tile."""
    be = tiled(block, block, 2, 1 << 16)
    for mask in (None, M.causal(), M.sliding_window(9, 3)):
        check_against_reference(be, 1, 2, 2, n, n, 16, mask=mask, what=f"N{n} block{block} {mask!r}")


def test_size_1023():
    check_against_reference("tiled", 1, 2, 1, 1023, 1023, 32, mask=M.causal(), what="B1-H2-KV1-N1023-D32 causal")
    check_against_reference(tiled(64, 64, 4, 1 << 18), 1, 2, 2, 1023, 1023, 16, mask=M.sliding_window(100),
                            backward=False, what="N1023 window")


@pytest.mark.parametrize("nq,nk", [(1, 100), (37, 100), (100, 37)], ids=lambda x: str(x))
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_nq_ne_nk_alignments(nq, nk, align):
    for mask in (M.causal(align=align), M.causal(align=align) & M.sliding_window(11)):
        check_against_reference(SMALL, 2, 2, 2, nq, nk, 16, mask=mask, what=f"{sid(2, 2, 2, nq, nk, 16)} {mask!r}")


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)], ids=["MHA", "GQA", "MQA"])
def test_gqa_mqa_and_dv(hq, hkv):
    check_against_reference(SMALL, 2, hq, hkv, 70, 70, 24, 40, mask=M.causal(), what=sid(2, hq, hkv, 70, 70, 24, 40))


def test_gqa_equals_repeated_kv():
    _, (q, k, v), _ = inputs(2, 6, 2, 50, 50, 16)
    a = run_backend(SMALL, q, k, v, mask=M.sliding_window(13)).out
    b = run_backend(SMALL, q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), mask=M.sliding_window(13)).out
    assert torch.allclose(a, b, atol=1e-6)


def test_non_contiguous_inputs():
    _, (q, k, v), _ = inputs(2, 3, 3, 40, 40, 8)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, N, H, D) memory
    assert not qt.is_contiguous()
    assert torch.allclose(run_backend(SMALL, qt, k, v, mask=M.causal()).out,
                          run_backend(SMALL, q, k, v, mask=M.causal()).out)


@pytest.mark.parametrize("name", ["head", "batch", "composed"])
def test_user_predicates_that_read_batch_and_head(name):
    """A from_fn mask may read b and h: tiles empty for one head must not be skipped for another."""
    mask = {"head": M.from_fn(lambda b, h, q, k: (k <= q) | (h == 1)),
            "batch": M.from_fn(lambda b, h, q, k: (k <= q) | (b == 1)),
            "composed": ~M.from_fn(lambda b, h, q, k: k > q + 7 * h) & M.sliding_window(40, 40)}[name]
    check_against_reference(SMALL, 2, 4, 2, 90, 90, 16, mask=mask, what=name)


H = 4
SCORE_MODS = {
    "alibi": (lambda s: mods.alibi(s), (torch.rand(H) * 0.2,)),
    "softcap": (lambda: mods.softcap(2.0), ()),
    "relative_bias": (lambda t: mods.relative_bias(t, lambda d: d.clamp(-8, 8) + 8), (torch.randn(17, H),)),
    "bias_full": (lambda t: mods.bias(t), (torch.randn(2, H, 70, 70),)),
    "bias_broadcast": (lambda t: mods.bias(t), (torch.randn(1, H, 1, 70),)),
    "from_fn": (lambda: mods.from_fn(lambda s, b, h, q, k: s * torch.sigmoid(s) + 0.01 * (q - k)), ()),
    "rel_then_softcap": (lambda t: [mods.relative_bias(t, lambda d: d.clamp(-8, 8) + 8), mods.softcap(1.5)],
                         (torch.randn(17, H),)),
}


@pytest.mark.parametrize("name", list(SCORE_MODS))
@pytest.mark.parametrize("mask_name", ["none", "causal"])
def test_score_mods_and_their_gradients(name, mask_name):
    fn, tensors = SCORE_MODS[name]
    mask = None if mask_name == "none" else M.causal()
    check_against_reference(SMALL, 2, H, 2, 70, 70, 16, mask=mask, mods_fn=fn, mod_tensors=tensors,
                            what=f"{name} {mask_name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_score_mods_low_precision(dtype):
    fn, tensors = SCORE_MODS["rel_then_softcap"]
    check_against_reference(SMALL, 1, H, 2, 70, 70, 16, dtype=dtype, mask=M.causal(), mods_fn=fn,
                            mod_tensors=tensors, what=f"rel+softcap {dtype}")


@pytest.mark.parametrize("name", ["window", "document", "bigbird", "longformer", "fixed"])
def test_sparse_skipping_equals_dense_masking(name):
    mask = MASKS_113[name]
    master, (q, k, v), _ = inputs(2, 2, 2, 113, 113, 16)
    dense = M.dense(mask.materialize(2, 2, 113, 113))
    sparse_out = run_backend(SMALL, q, k, v, mask=mask)
    dense_ref = run_backend("reference", *master, mask=dense)
    assert_within_budget(sparse_out.out, dense_ref.out, naive(q, k, v, mask=dense), what=name)
    skipped = SMALL.last_stats
    dense_out = run_backend(SMALL, q, k, v, mask=dense)
    assert torch.allclose(sparse_out.out, dense_out.out, atol=1e-6)
    # The dense mask's block map finds the same tiles (counted per batch row: it carries batch data).
    assert skipped.tiles * (2 if (mask.batch or 1) == 1 else 1) == SMALL.last_stats.tiles


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=list(DTYPE_NAMES.values()))
def test_fully_masked_rows(dtype):
    """Rows with no allowed key: zeros, lse -inf, zero gradients, no NaN anywhere."""
    _, (q, k, v), _ = inputs(2, 2, 2, 40, 20, 8, dtype=dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = M.causal() & M.padding([0, 20])  # batch 0: nothing; batch 1: rows 0..19 see no key (p < 0)
    res = run_backend(SMALL, q, k, v, mask=mask)
    assert torch.isfinite(res.out).all()
    assert (res.out[0] == 0).all() and (res.out[1, :, :20] == 0).all()
    assert torch.isneginf(res.lse[0]).all() and torch.isneginf(res.lse[1, :, :20]).all()
    assert torch.isfinite(res.lse[1, :, 20:]).all()
    (res.out.float().sum() + res.lse[1, :, 20:].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[0] == 0).all() and (q.grad[1, :, :20] == 0).all()
    assert (k.grad[0] == 0).all() and (v.grad[0] == 0).all()


def test_non_finite_keys_in_masked_slots_stay_hidden():
    """Garbage (inf/NaN) in keys the mask hides, as in padded cache slots, never reaches the output."""
    master, (q, k, v), _ = inputs(2, 2, 2, 70, 70, 8)
    k[0, :, 40:] = float("nan")
    k[1, :, 60:] = float("inf")
    mask = M.padding([40, 60]) & M.causal()
    out = run_backend(SMALL, q, k, v, mask=mask)
    ref = run_backend("reference", q.double(), k.double(), v.double(), mask=mask)
    assert torch.isfinite(out.out).all() and torch.allclose(out.out.double(), ref.out, atol=1e-5)


@pytest.mark.parametrize("nq,nk", [(0, 5), (4, 0)], ids=["no-queries", "no-keys"])
def test_empty_queries_or_keys(nq, nk):
    q = torch.randn(2, 2, nq, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, nk, 8, requires_grad=True) for _ in range(2))
    res = run_backend("tiled", q, k, v, mask=M.causal())
    assert res.out.shape == (2, 2, nq, 8) and (res.out == 0).all() and torch.isneginf(res.lse).all()
    res.out.sum().backward()
    assert q.grad.shape == q.shape and (q.grad == 0).all() and (k.grad == 0).all()


def test_no_key_tiles_at_all():
    """A mask whose block map is entirely EMPTY still returns zeros and -inf."""
    _, (q, k, v), _ = inputs(1, 2, 2, 50, 50, 8)
    res = run_backend(SMALL, q, k, v, mask=M.padding([0]))
    assert (res.out == 0).all() and torch.isneginf(res.lse).all()
    assert SMALL.last_stats.tiles == 0


def test_gradient_through_lse():
    """``lse`` is differentiable (merge_states and ring attention backpropagate through it)."""
    master, cast, _ = inputs(2, 4, 2, 70, 90, 16)
    grads = []
    for backend, tensors in (("reference", master), (SMALL, cast)):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        res = run_backend(backend, *leaves, mask=M.causal())
        w = torch.linspace(-1, 1, res.lse.shape[-1], dtype=res.lse.dtype)
        torch.autograd.backward([res.lse * w, res.out], [torch.ones_like(res.lse), torch.ones_like(res.out)])
        grads.append([t.grad for t in leaves])
    for g, r in zip(grads[1], grads[0]):
        assert torch.allclose(g.double(), r, atol=2e-5), float((g.double() - r).abs().max())


@pytest.mark.parametrize("mask_name", ["none", "window"])
def test_dropout_matches_reference_for_the_same_seed(mask_name):
    mask = None if mask_name == "none" else M.sliding_window(17)
    master, cast, dout = inputs(2, 4, 2, 70, 70, 16)

    def run(backend, tensors, seed):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = run_backend(backend, *leaves, mask=mask, dropout_p=0.3,
                          generator=torch.Generator().manual_seed(seed)).out
        return out, torch.autograd.grad(out, leaves, dout.to(out.dtype))

    ref_out, ref_g = run("reference", master, 7)
    base_out, base_g = run("reference", cast, 7)  # the reference on fp32 inputs is the same-dtype baseline
    out, g = run(SMALL, cast, 7)
    assert_within_budget(out.detach(), ref_out.detach(), base_out.detach(), what="dropout out")
    for name, a, r, b in zip(("dq", "dk", "dv"), g, ref_g, base_g):
        assert_within_budget(a, r, b, what=f"dropout {name}")
    other, _ = run(SMALL, cast, 8)
    assert not torch.allclose(other, out)  # another seed, another pattern


def test_sliding_window_visits_o_n_w_tiles():
    n, w, block = 2048, 128, 64
    _, (q, k, v), _ = inputs(1, 1, 1, n, n, 8)
    be = tiled(block, block, 4, 1 << 20)
    run_backend(be, q, k, v, mask=M.sliding_window(w - 1))
    st = be.last_stats
    tq = n // block
    assert st.grid_tiles == tq * tq
    assert st.tiles <= tq * (w // block + 1), st  # O(N * W / block^2), not O(N^2 / block^2)
    assert st.computed_tiles <= 1.25 * st.tiles, st  # little padding
    # Doubling N doubles the tiles (linear), it does not quadruple them.
    _, (q2, k2, v2), _ = inputs(1, 1, 1, 2 * n, 2 * n, 8)
    run_backend(be, q2, k2, v2, mask=M.sliding_window(w - 1))
    assert be.last_stats.tiles <= 2 * st.tiles + w // block + 2


def test_causal_skips_upper_triangle_and_full_tiles_skip_the_mask():
    """Causal: about half the tiles; only diagonal tiles evaluate the predicate."""

    class Counting(SlidingWindow):
        evaluated = 0

        def allowed(self, b, h, q_idx, kv_idx, nq, nk):
            out = super().allowed(b, h, q_idx, kv_idx, nq, nk)
            Counting.evaluated += torch.broadcast_shapes(q_idx.shape, kv_idx.shape).numel()
            return out

    n, block = 1024, 64
    mask = Counting(n, 0)  # a causal mask with an analytic block map
    _, (q, k, v), _ = inputs(1, 1, 1, n, n, 8)
    be = tiled(block, block, 4, 1 << 20)
    res = run_backend(be, q, k, v, mask=mask)
    st = be.last_stats
    tq = n // block
    assert st.tiles == tq * (tq + 1) // 2 and st.partial_tiles == tq
    assert Counting.evaluated <= 2 * st.partial_tiles * block * block, (Counting.evaluated, st)
    ref = run_backend("reference", q.double(), k.double(), v.double(), mask=M.causal())
    assert torch.allclose(res.out.double(), ref.out, atol=1e-5)


def test_poisoned_buffers_expose_unwritten_rows():
    """The kernel's output buffers start as NaN: a schedule that forgot a row batch would show."""
    _, (q, k, v), _ = inputs(1, 1, 1, 64, 64, 8)
    bm = M.causal().block_map(64, 64, 16, 16)[0, 0]
    plan = build_plan(bm, 64, 64, 16, 16, step_tiles=2, chunk_tiles=2)
    pb = Problem(b_index=torch.arange(1), Hkv=1, G=1, nq=64, nk=64, scale=8 ** -0.5, mask=M.causal(),
                 score_mod=None, dropout_p=0.0, seed=0, device=q.device)
    out, lse = forward_slice(plan, pb, q, k, v)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    plan.batches = plan.batches[1:]  # drop the first row batch
    out, lse = forward_slice(plan, pb, q, k, v)
    assert torch.isnan(out).any() and torch.isnan(lse).any()


def test_one_mask_object_across_shapes_batches_and_heads():
    """Plans and mask biases are cached on the mask object; reuse must never leak across problems."""
    mask = M.sliding_window(20) | M.from_fn(lambda b, h, q, k: (k == 0) & (h == 1))
    for B, Hq, Hkv, n in ((1, 2, 2, 100), (2, 4, 2, 100), (1, 2, 1, 150), (2, 4, 2, 100)):
        master, (q, k, v), _ = inputs(B, Hq, Hkv, n, n, 8, seed=n + B)
        out = run_backend(SMALL, q, k, v, mask=mask).out
        ref = run_backend("reference", *master, mask=mask).out
        assert torch.allclose(out.double(), ref, atol=1e-5), sid(B, Hq, Hkv, n, n, 8)


def test_auto_picks_sdpa_for_small_dense_and_tiled_for_long_sparse():
    x = torch.randn(1, 8, 512, 64)
    assert qkv.explain(x, x, x).chosen == "sdpa"
    assert qkv.explain(x, x, x, mask=M.causal()).chosen == "sdpa"
    y = torch.randn(1, 8, 16384, 64)
    ex = qkv.explain(y, y, y, mask=M.sliding_window(255))
    assert ex.chosen == "tiled", str(ex)
    assert "tiles" in ex.estimates["tiled"].note


def test_tiled_accepts_everything_and_estimates_are_cached():
    be = qkv.backends.get("tiled")
    _, (q, k, v), _ = inputs(1, 2, 1, 64, 64, 8)
    mask = M.bigbird(16)
    req = build_request(q, k, v, mask=mask, score_mod=mods.softcap(3.0), return_lse=True, dropout_p=0.1)
    assert be.decline(req) is None
    e1 = be.estimate(req)
    assert e1.seconds > 0 and "tiles" in e1.note
    assert be.estimate(req) == e1
