"""The Triton backend's kernels, run on CPU tensors in Triton's interpreter, against the float64 reference.

Not collected by itself: ``tests/test_triton.py`` runs this file in a child pytest process with
``TRITON_INTERPRET=1`` set before triton is imported (triton decides at import whether its own library
functions are interpreted), so no other test sees the variable or interpreted kernels. Sizes are tiny
(the interpreter runs each tile as numpy arrays); the 16 x 16 tiles used on CPU still give several
tiles, ragged edges and every tile kind. Every comparison is an error budget (qkv.testing), forward
(out, lse) and backward (q, k, v and the modifier tensors).
"""

from __future__ import annotations

import os

import pytest
import torch

import qkv
from _helpers_tiled import check_against_reference, inputs, sid, sparse_masks
from qkv import masks as M
from qkv import mods
from qkv.testing import assert_within_budget

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_triton.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)


def check(*args, **kw):
    check_against_reference("triton", *args, **kw)


MASKS = sparse_masks(33)


@pytest.mark.parametrize("name", list(MASKS))
def test_every_mask_forward_backward(name):
    check(2, 2, 1, 33, 33, 16, mask=MASKS[name], what=f"{name} {sid(2, 2, 1, 33, 33, 16)}")


@pytest.mark.parametrize("heavy_first", [False, True], ids=["in_order", "heavy_first"])
def test_forward_tile_order_changes_nothing(heavy_first, monkeypatch):
    """The forward's query tiles run last-first on CUDA (FWD_HEAVY_FIRST); either order gives the reference."""
    from qkv.backends.triton import attention as A

    monkeypatch.setattr(A, "FWD_HEAVY_FIRST", heavy_first)
    check(1, 2, 2, 45, 45, 16, mask=M.causal() & M.sliding_window(9), what=f"heavy_first={heavy_first}")


@pytest.mark.parametrize("nq,nk", [(1, 37), (19, 37), (37, 19)], ids=lambda x: str(x))
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_causal_alignments(nq, nk, align):
    for mask in (M.causal(align=align), M.causal(align=align) & M.sliding_window(5)):
        check(1, 2, 2, nq, nk, 16, mask=mask, what=f"{sid(1, 2, 2, nq, nk, 16)} {mask!r}")


def test_head_reading_user_mask_and_user_mask_decode():
    """A mask that reads the head gets every head's tiles (not head 0's), and a user mask decoded alone sees the
    query's position (issue 29 items 1 and 2). Tiny: the interpreter is slow."""
    heads = M.from_fn(lambda b, h, q, k: torch.where(h == 0, k == 0, k <= q))
    check(1, 2, 2, 33, 33, 16, mask=heads, what=f"head-reading {sid(1, 2, 2, 33, 33, 16)}")
    dilated = M.from_fn(lambda b, h, q, k: (k <= q) & ((q - k) % 2 == 0))
    check(1, 2, 1, 1, 33, 16, mask=dilated, backward=False, what=f"dilated decode {sid(1, 2, 1, 1, 33, 16)}")


def test_lowering_kinds():
    """The analytic masks are evaluated in the kernel, the others from dense tiles; EMPTY tiles are not
    listed and FULL tiles carry kind -1 (no mask arithmetic)."""
    from qkv.backends.triton._lower import lower_mask

    plan = lower_mask(M.sliding_window(20) & M.padding(torch.tensor([50, 70])), 2, 2, 100, 100, 16, 16, "cpu")
    assert plan.kind == 1 and plan.band == (-20, 0) and plan.kvlen.tolist() == [50, 70]
    num, idx, kind = plan.fwd
    assert plan.visited < 2 * 7 * 7, "a window must skip tiles"
    assert int(num.sum()) == plan.visited and int((kind >= 0).sum()) == plan.partial
    full = lower_mask(M.causal(), 1, 1, 64, 64, 16, 16, "cpu")
    assert full.visited == 10 and full.partial == 4, (full.visited, full.partial)
    assert lower_mask(M.strided(8), 1, 1, 64, 64, 16, 16, "cpu").kind == 2


@pytest.mark.parametrize("fwd,bwd", [((32, 16), (16, 32)), ((16, 32), (32, 16))], ids=["32x16-16x32", "16x32-32x16"])
def test_backward_tiles_differ_from_forward(fwd, bwd):
    """On a GPU the backward takes smaller tiles than the forward: its own lowering of the mask must agree."""
    from qkv.backends.triton.attention import Tiles, run

    class Sized:
        name = "triton-sized"

        def run(self, req):
            return run(req, Tiles(*fwd, 4, 1), Tiles(*bwd, 4, 1))

    be = Sized()
    for mask in (M.causal(), M.sliding_window(9) | M.global_tokens([3]), MASKS["document"]):
        check_against_reference(be, 2, 2, 1, 33, 33, 16, mask=mask, what=f"fwd{fwd} bwd{bwd} {mask!r}")


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (3, 1)], ids=["MHA", "GQA", "MQA"])
def test_gqa_and_dv(hq, hkv):
    check(1, hq, hkv, 24, 24, 16, 24, mask=M.causal(), what=sid(1, hq, hkv, 24, 24, 16, 24))


def test_gqa_equals_repeated_kv():
    _, (q, k, v), _ = inputs(1, 4, 2, 30, 30, 16)
    a = qkv.attention(q, k, v, mask=M.sliding_window(7), backend="triton")
    b = qkv.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask=M.sliding_window(7),
                      backend="triton")
    assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_dtypes(dtype):
    check(1, 2, 1, 33, 33, 16, dtype=dtype, mask=M.causal(), what=f"causal {dtype}")


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (40, 72)], ids=lambda x: f"D{x}")
def test_head_dims(d, dv):
    check(1, 1, 1, 17, 17, d, dv, dtype=torch.bfloat16, mask=M.causal(), what=f"D{d} Dv{dv}")


def test_fully_masked_rows_zero_without_nan():
    q = torch.randn(2, 2, 20, 16, requires_grad=True)
    k = torch.randn(2, 2, 20, 16, requires_grad=True)
    v = torch.randn(2, 2, 20, 16, requires_grad=True)
    mask = M.padding(torch.tensor([0, 7])) & M.causal(align="top_left")
    out, lse = qkv.attention(q, k, v, mask=mask, backend="triton", return_lse=True)
    assert bool((out[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())
    out.sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert not torch.isnan(t.grad).any(), name
    assert bool((q.grad[0] == 0).all())


SLOPES = torch.tensor([0.5, 0.25])


@pytest.mark.parametrize("case", ["alibi", "alibi_bidir", "softcap", "bias_full", "bias_broadcast",
                                  "bias_then_softcap", "softcap_then_alibi", "relative_bias"])
def test_score_mods(case):
    N = 30
    g = torch.Generator().manual_seed(1)
    table = {
        "alibi": (lambda s: mods.alibi(s), (SLOPES,)),
        "alibi_bidir": (lambda s: mods.alibi(s, bidirectional=True), (SLOPES,)),
        "softcap": (lambda: mods.softcap(2.0), ()),
        "bias_full": (lambda b: mods.bias(b), (torch.randn(2, 2, N, N, generator=g),)),
        "bias_broadcast": (lambda b: mods.bias(b), (torch.randn(N, N, generator=g),)),
        "bias_then_softcap": (lambda b: [mods.bias(b), mods.softcap(3.0)], (torch.randn(1, 2, N, N, generator=g),)),
        "softcap_then_alibi": (lambda s: [mods.softcap(3.0), mods.alibi(s)], (SLOPES,)),
        "relative_bias": (lambda t: mods.relative_bias(t, lambda d: d.clamp(-4, 4) + 4),
                          (torch.randn(9, 2, generator=g),)),
    }
    fn, tensors = table[case]
    check(2, 2, 1, N, N, 16, mask=M.causal(), mods_fn=fn, mod_tensors=tensors, what=case)


def test_declines_python_score_mod():
    x = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="Python function cannot run inside a Triton kernel"):
        qkv.attention(x, x, x, score_mod=mods.from_fn(lambda s, b, h, q, k: s), backend="triton")


def test_dropout_matches_reference_pattern():
    """Same seed, same keep pattern as the reference backend: forward and gradients within budget."""
    _, (q, k, v), dout = inputs(1, 2, 1, 33, 33, 16)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    qc, kc, vc = (t.detach().requires_grad_(True) for t in (q, k, v))
    ref = qkv.attention(q64, k64, v64, mask=M.causal(), dropout_p=0.3, generator=torch.Generator().manual_seed(5),
                        backend="reference")
    out = qkv.attention(qc, kc, vc, mask=M.causal(), dropout_p=0.3, generator=torch.Generator().manual_seed(5),
                        backend="triton")
    base = qkv.attention(qc.detach(), kc.detach(), vc.detach(), mask=M.causal(), dropout_p=0.3,
                         generator=torch.Generator().manual_seed(5), backend="reference")
    assert_within_budget(out.detach(), ref.detach(), base, what="dropout out")
    g_ref = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    g = torch.autograd.grad(out, (qc, kc, vc), dout)
    for name, a, r in zip("qkv", g, g_ref):
        assert (a.double() - r).abs().max() < 1e-5, f"d{name}: {(a.double() - r).abs().max():.3e}"


def _with_sinks(q, k, v, sinks, allowed):
    """Attention with a sink written out (one more softmax logit per head, without a value), in the inputs'
    dtype: (out, lse), lse including the sink."""
    B, Hq, Nq, D = q.shape
    g = Hq // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(~allowed, float("-inf"))
    s = torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(B, Hq, Nq, 1)], -1)
    return torch.softmax(s, -1)[..., :-1] @ v.repeat_interleave(g, 1), torch.logsumexp(s, -1)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sinks_lse_and_layout_forward_backward(dtype, layout):
    """The Triton kernels take no sink: qkv.attention merges it from their log-sum-exp, and the lse's own
    gradient reaches the kernels' backward. Checked against the float64 definition: out, lse (with the
    sink), and the gradients of q, k, v and the sinks; one batch row has no key (all its mass on the sink)."""
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 19, 21, 16
    master, cast, dout = inputs(B, Hq, Hkv, Nq, Nk, D, dtype=dtype)
    z = (torch.randn(Hq, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2).to(dtype)
    mask = M.causal() & M.padding(torch.tensor([Nk, 0]))
    allowed = mask.materialize(B, Hq, Nq, Nk)
    to_layout = (lambda t: t.transpose(1, 2).contiguous()) if layout == "bnhd" else (lambda t: t)
    leaves = [to_layout(t).requires_grad_() for t in (*cast, z)[:3]] + [z.clone().requires_grad_()]
    res = qkv.attention(*leaves[:3], mask=mask, sinks=leaves[3], return_lse=True, layout=layout, backend="triton")
    out = res.out.transpose(1, 2) if layout == "bnhd" else res.out
    ref_leaves = [t.clone().requires_grad_() for t in (*master, z.double())]
    base_leaves = [t.detach().clone().requires_grad_() for t in (*cast, z)]
    ref_out, ref_lse = _with_sinks(*ref_leaves, allowed)
    base_out, base_lse = _with_sinks(*base_leaves, allowed)
    assert out.dtype == dtype and res.lse.dtype == torch.float32 and res.lse.shape == (B, Hq, Nq)
    assert bool((out[1] == 0).all()), "a row with no key puts all its mass on the sink"
    assert_within_budget(out.detach(), ref_out.detach(), base_out.detach(), what=f"{layout} out")
    assert_within_budget(res.lse.detach(), ref_lse.detach(), base_lse.detach().float(), what=f"{layout} lse")
    w = torch.randn(Nq, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def loss(o, lse):
        return (o * dout.to(o.dtype)).sum() + (lse * w.to(lse.dtype)).sum()

    g = torch.autograd.grad(loss(out, res.lse), leaves)
    g = [t.transpose(1, 2) for t in g[:3]] + [g[3]] if layout == "bnhd" else list(g)
    g_ref = torch.autograd.grad(loss(ref_out, ref_lse), ref_leaves)
    g_base = torch.autograd.grad(loss(base_out, base_lse), base_leaves)
    for name, a, r, b in zip(["dq", "dk", "dv", "dsinks"], g, g_ref, g_base):
        assert_within_budget(a, r, b, what=f"{layout} {dtype} {name}")


def test_sinks_with_dropout_keep_the_reference_pattern():
    """Dropout drops the keys' probabilities after the sink joined the normalizer: same seed, same result
    and gradients as the reference backend in float64."""
    master, (q, k, v), dout = inputs(1, 2, 1, 21, 21, 16)
    z = torch.tensor([0.5, -1.0])
    leaves = [t.clone().requires_grad_() for t in (q, k, v, z)]
    ref_leaves = [t.clone().requires_grad_() for t in (*master, z.double())]
    kw = dict(mask=M.causal(), dropout_p=0.3)
    out = qkv.attention(*leaves[:3], sinks=leaves[3], generator=torch.Generator().manual_seed(5), backend="triton",
                        **kw)
    ref = qkv.attention(*ref_leaves[:3], sinks=ref_leaves[3], generator=torch.Generator().manual_seed(5),
                        backend="reference", **kw)
    base = qkv.attention(q, k, v, sinks=z, generator=torch.Generator().manual_seed(5), backend="reference", **kw)
    assert_within_budget(out.detach(), ref.detach(), base, what="sinks+dropout out")
    g = torch.autograd.grad(out, leaves, dout.float())
    g_ref = torch.autograd.grad(ref, ref_leaves, dout)
    for name, a, r in zip(["dq", "dk", "dv", "dsinks"], g, g_ref):
        assert (a.double() - r).abs().max() < 1e-5, f"{name}: {(a.double() - r).abs().max():.3e}"


def test_bnhd_is_the_same_kernel_result():
    """layout='bnhd' reads (B, N, H, D) through strided views: the same numbers as the (B, H, N, D) call."""
    _, (q, k, v), _ = inputs(1, 4, 2, 23, 23, 16)
    mod = mods.alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    a = qkv.attention(q, k, v, mask=M.sliding_window(6), score_mod=mod, backend="triton", return_lse=True)
    b = qkv.attention(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), mask=M.sliding_window(6), score_mod=mod,
                      backend="triton", return_lse=True, layout="bnhd")
    assert torch.allclose(a.out, b.out.transpose(1, 2), atol=1e-6) and torch.allclose(a.lse, b.lse, atol=1e-6)


def _pool_case(seed=0, window=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, D, Dv, T, P = 3, 4, 2, 16, 24, 4, 12
    kp = torch.randn(P, Hkv, T, D, generator=g).to(dtype)
    vp = torch.randn(P, Hkv, T, Dv, generator=g).to(dtype)
    tables = torch.tensor([[3, 1, 7, 5], [2, 9, 11, 11], [0, 11, 11, 11]])
    lens = [15, 6, 0]
    kpos = torch.full((B, 16), -1)
    for b, n in enumerate(lens):
        kpos[b, :n] = torch.arange(n)
    qpos = torch.tensor([14, 5, 0])
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    return q, kp, vp, tables, kpos, qpos


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("splits", [1, 3, 4])  # 4: one block per split, so a two-block tile is half empty
def test_paged_decode_against_reference(window, splits):
    from qkv.backends.triton.decode import paged_decode

    q, kp, vp, tables, kpos, qpos = _pool_case(window=window)
    out, lse = paged_decode(q, kp, vp, tables, kpos, qpos, window=window, splits=splits)
    B, Hkv = q.shape[0], kp.shape[1]
    k_all = kp[tables].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, kp.shape[-1])
    v_all = vp[tables].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, vp.shape[-1])
    mask = M.positions(qpos[:, None], kpos, causal=True, window=window)
    ref = qkv.attention(q[:, :, None].double(), k_all.double(), v_all.double(), mask=mask, backend="reference",
                        return_lse=True)
    base = qkv.attention(q[:, :, None], k_all, v_all, mask=mask, backend="reference", return_lse=True)
    assert_within_budget(out, ref.out[:, :, 0], base.out[:, :, 0], what="paged out")
    assert bool(torch.isneginf(lse[2]).all()) and bool((out[2] == 0).all()), "a row with no slot: zeros, -inf"
    assert_within_budget(lse[:2], ref.lse[:2, :, 0].double(), base.lse[:2, :, 0], what="paged lse", floor=1e-5)


def test_paged_decode_bf16():
    from qkv.backends.triton.decode import paged_decode

    q, kp, vp, tables, kpos, qpos = _pool_case(dtype=torch.bfloat16)
    out, _ = paged_decode(q, kp, vp, tables, kpos, qpos, splits=2)
    B, Hkv = q.shape[0], kp.shape[1]
    k_all = kp[tables].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, kp.shape[-1])
    v_all = vp[tables].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, vp.shape[-1])
    mask = M.positions(qpos[:, None], kpos)
    ref = qkv.attention(q[:, :, None].double(), k_all.double(), v_all.double(), mask=mask, backend="reference")
    base = qkv.attention(q[:, :, None], k_all, v_all, mask=mask, backend="reference")
    assert out.dtype == torch.bfloat16
    assert_within_budget(out, ref[:, :, 0], base[:, :, 0], what="paged bf16 out")


def test_paged_decode_bad_input():
    from qkv.backends.triton.decode import paged_decode

    q, kp, vp, tables, kpos, qpos = _pool_case()
    with pytest.raises(ValueError, match="kv_positions"):
        paged_decode(q, kp, vp, tables, kpos[:, :5], qpos)
    with pytest.raises(ValueError, match="q must be a 3-D tensor"):
        paged_decode(q[:, :, None], kp, vp, tables, kpos, qpos)


@pytest.mark.parametrize("splits", [1, 2])
def test_mla_decode_equals_absorbed_reference(splits):
    """The kernel against MLA's absorbed attention done by the float64 reference."""
    from qkv.backends.triton.decode import mla_decode

    g = torch.Generator().manual_seed(0)
    B, H, r, dr, S = 2, 3, 32, 8, 21
    ql, qr = torch.randn(B, H, r, generator=g), torch.randn(B, H, dr, generator=g)
    c, kr = torch.randn(B, S, r, generator=g), torch.randn(B, S, dr, generator=g)
    kpos = torch.stack([torch.arange(S), torch.where(torch.arange(S) < 10, torch.arange(S), -1)])
    qpos = torch.tensor([S - 1, 9])
    out, lse = mla_decode(ql, qr, c, kr, kpos, qpos, scale=0.2, splits=splits)
    q_all, k_all = torch.cat([ql, qr], -1)[:, :, None], torch.cat([c, kr], -1)[:, None]
    mask = M.positions(qpos[:, None], kpos)
    ref = qkv.attention(q_all.double(), k_all.double(), c[:, None].double(), mask=mask, scale=0.2,
                        backend="reference", return_lse=True)
    base = qkv.attention(q_all, k_all, c[:, None], mask=mask, scale=0.2, backend="reference", return_lse=True)
    assert_within_budget(out, ref.out[:, :, 0], base.out[:, :, 0], what="mla out")
    assert_within_budget(lse, ref.lse[:, :, 0].double(), base.lse[:, :, 0], what="mla lse", floor=1e-5)


def test_paged_store_decode_equals_attention_over_the_view(monkeypatch):
    from qkv.backends import triton as tb
    from qkv.cache import FullSpec, KVCache, Paged

    monkeypatch.setattr(tb, "gpu_decode_ready", lambda *ts: True)
    g = torch.Generator().manual_seed(0)
    cache = KVCache([FullSpec(2, 16)], storage=Paged(block_size=4, num_blocks=16))
    B, n = 2, 7
    k, v = torch.randn(B, 2, n, 16, generator=g), torch.randn(B, 2, n, 16, generator=g)
    pos = torch.arange(n).expand(B, n).clone()
    pos[1, :2] = -1  # left padding: not stored
    cache.update(0, k, v, positions=pos)
    step_pos = torch.tensor([[n], [n]])
    view = cache.update(0, torch.randn(B, 2, 1, 16, generator=g), torch.randn(B, 2, 1, 16, generator=g),
                        positions=step_pos)
    q = torch.randn(B, 4, 1, 16, generator=g)
    out = cache._layers[0].store.decode(q, step_pos, scale=0.25)
    mask = M.positions(view.q_positions, view.kv_positions, causal=True)
    ref = qkv.attention(q.double(), view.k.double(), view.v.double(), mask=mask, scale=0.25, backend="reference")
    base = qkv.attention(q, view.k, view.v, mask=mask, scale=0.25, backend="reference")
    assert out is not None and out.shape == (B, 4, 1, 16)
    assert_within_budget(out, ref, base, what="paged store decode")


def test_mla_absorbed_decode_through_the_kernel(monkeypatch):
    from qkv.backends import triton as tb
    from qkv.nn.latent import mla_absorbed

    g = torch.Generator().manual_seed(0)
    B, H, S, dn, dr, r, dv = 2, 3, 19, 8, 8, 32, 8
    q_nope, q_rope = torch.randn(B, H, 1, dn, generator=g), torch.randn(B, H, 1, dr, generator=g)
    c_kv, k_rope = torch.randn(B, S, r, generator=g), torch.randn(B, S, dr, generator=g)
    w = torch.randn(H * (dn + dv), r, generator=g) * 0.2
    plain = mla_absorbed(q_nope, q_rope, c_kv, k_rope, w, return_lse=True)
    monkeypatch.setattr(tb, "gpu_decode_ready", lambda *ts: True)
    fast = mla_absorbed(q_nope, q_rope, c_kv, k_rope, w, return_lse=True)
    ref = mla_absorbed(*(t.double() for t in (q_nope, q_rope, c_kv, k_rope, w)), return_lse=True, backend="reference")
    assert_within_budget(fast.out, ref.out, plain.out, what="mla fast out")
    assert_within_budget(fast.lse, ref.lse.double(), plain.lse, what="mla fast lse", floor=1e-5)


def test_decoder_decode_step_through_the_paged_kernel(monkeypatch):
    """A decode step of the decoder over a paged cache, with the CUDA check forced on: same logits."""
    from qkv.backends import triton as tb
    from qkv.cache import KVCache, Paged
    from qkv.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=48, sliding_window=4,
                        layer_types=["full_attention", "sliding_attention"])
    model = DecoderLM(cfg).eval()
    ids = torch.randint(0, 50, (2, 7))
    nxt = torch.randint(0, 50, (2, 1))

    def step():
        cache = KVCache(model.cache_specs(), storage=Paged(block_size=4, num_blocks=16))
        with torch.no_grad():
            model(ids, cache=cache)
            return model(nxt, cache=cache).logits[:, -1]

    import qkv.backends.paged as paged_backend

    gathers = []
    real_gather = paged_backend.gather_head_major
    monkeypatch.setattr(paged_backend, "gather_head_major", lambda *a: gathers.append(1) or real_gather(*a))
    monkeypatch.setenv("QKV_CPU_KERNELS", "0")  # the plain run on views (the compiled CPU kernel reads in place)
    plain = step()
    assert len(gathers) == 8, "prefill and decode each gather both layers' keys and values (the torch-op path)"
    calls = []
    monkeypatch.setattr(tb, "gpu_decode_ready", lambda *ts: calls.append(1) or True)
    gathers.clear()
    fast = step()
    assert calls, "the decoder did not reach the paged kernel"
    assert len(gathers) == 4, "the decode step read the blocks in place: only the prefill gathered views"
    assert torch.allclose(fast, plain, atol=1e-5), (fast - plain).abs().max()


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
def test_topk_lists_forward_backward(per_head):
    """masks.topk lowers through its block map; the kernel evaluates the lists in the partial tiles."""
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(-1, 33, (2, 2 if per_head else 1, 33, 6), generator=g)
    idx[0, 0, 2] = -1  # a row that lists nothing
    idx[..., -1] = idx[..., 0]  # duplicates count once
    for mask in (M.topk(idx), M.topk(idx) & M.causal()):
        check(2, 2, 1, 33, 33, 16, mask=mask, what=f"{mask!r} {sid(2, 2, 1, 33, 33, 16)}")
