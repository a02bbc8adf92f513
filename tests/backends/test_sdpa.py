"""The SDPA backend equals the float64 reference within error budget, forward and backward."""

import pytest
import torch

import qkv
from _helpers import DTYPES, eager_same_dtype, make_qkv, mask_catalogue, reference64, shape_id
from qkv.testing import DEFAULT_FLOOR, assert_within_budget

MASK_KINDS = list(mask_catalogue(2, 8, 8))


def _check(B, Hq, Hkv, Nq, Nk, D, Dv, dtype, mask_kind, score_mod=None, grad=True, backend="sdpa"):
    master, cast = make_qkv(B, Hq, Hkv, Nq, Nk, D, Dv, dtype=dtype, requires_grad=grad)
    mask = mask_catalogue(B, Nq, Nk)[mask_kind]
    ref = reference64(master, mask=mask, score_mod=score_mod)
    out = qkv.attention(*cast, mask=mask, score_mod=score_mod, backend=backend)
    assert out.dtype == dtype and out.shape == (B, Hq, Nq, Dv)
    base_in = [t.detach().clone().requires_grad_(grad) for t in cast]
    base = eager_same_dtype(*base_in, mask=mask, score_mod=score_mod)
    assert_within_budget(out, ref, base, what=f"{backend} forward")
    if grad:
        g = torch.randn_like(ref)
        ref.backward(g)
        out.backward(g.to(dtype))
        base.backward(g.to(dtype))
        # A gradient that is exactly zero in float64 (a query that sees one key has dq = 0) is still held to
        # rounding at the problem's gradient scale, not at 1: the floor scales with the largest gradient.
        scale = max(1.0, *(float(m.grad.abs().max()) for m in master if m.grad.numel()))
        for name, m, c, b in zip("qkv", master, cast, base_in):
            assert_within_budget(c.grad, m.grad, b.grad, floor=DEFAULT_FLOOR[dtype] * scale, what=f"{backend} d{name}")


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_every_mask_every_dtype(mask_kind, dtype):
    _check(2, 4, 2, 37, 37, 16, 16, dtype, mask_kind)


SHAPES = [
    (1, 1, 1, 1, 1, 8, 8),
    (2, 4, 4, 63, 63, 64, 64),
    (2, 4, 2, 63, 113, 32, 16),
    (1, 8, 1, 113, 63, 16, 24),
    (2, 6, 3, 1, 113, 64, 64),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: shape_id(*s))
@pytest.mark.parametrize("mask_kind", ["none", "causal", "causal_top_left", "window", "padding"])
def test_shapes_and_alignments(shape, mask_kind):
    _check(*shape, torch.float32, mask_kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_additive_mods_fold_into_float_mask(dtype):
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    _check(2, 4, 2, 29, 29, 16, 16, dtype, "causal", score_mod=qkv.mods.alibi(slopes))


def test_learnable_bias_gets_gradient_through_sdpa():
    master, cast = make_qkv(1, 2, 2, 9, 11, 8, dtype=torch.float32)
    bias64 = torch.randn(1, 2, 9, 11, dtype=torch.float64, requires_grad=True)
    bias32 = bias64.detach().float().requires_grad_(True)
    ref = reference64(master, score_mod=qkv.mods.bias(bias64))
    out = qkv.attention(*cast, score_mod=qkv.mods.bias(bias32), backend="sdpa")
    ref.sum().backward()
    out.sum().backward()
    assert torch.allclose(bias32.grad.double(), bias64.grad, atol=1e-5)


def test_causal_alignment_maps_correctly():
    """Bottom-right causal with Nq < Nk must not be passed as torch's top-left is_causal."""
    _, (q, k, v) = make_qkv(1, 2, 2, 3, 7, 8)
    br = qkv.attention(q, k, v, mask=qkv.masks.causal(), backend="sdpa")
    tl = qkv.attention(q, k, v, mask=qkv.masks.causal(align="top_left"), backend="sdpa")
    # The last query sees every key under bottom-right alignment: plain attention for that row.
    full = qkv.attention(q, k, v, backend="sdpa")
    assert torch.allclose(br[:, :, -1], full[:, :, -1], atol=1e-6)
    assert not torch.allclose(tl[:, :, -1], full[:, :, -1], atol=1e-3)


def test_sdpa_declines_with_reasons():
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="log-sum-exp"):
        qkv.attention(x, x, x, return_lse=True, backend="sdpa")
    with pytest.raises(ValueError, match="not additive"):
        qkv.attention(x, x, x, score_mod=qkv.mods.softcap(5.0), backend="sdpa")
    with pytest.raises(ValueError, match="dropout"):
        qkv.attention(x, x, x, dropout_p=0.1, backend="sdpa")


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_one_query_gqa_folds_groups_into_rows(mask_kind, monkeypatch):
    """A decode step under GQA runs as G query rows per KV head (sdpa._decode_grouped) for every mask whose
    dense form has one or Hq heads (per-head masks included), and equals the reference."""
    from qkv.backends import sdpa

    calls = []
    real = sdpa._decode_grouped
    monkeypatch.setattr(sdpa, "_decode_grouped", lambda *a: calls.append(1) or real(*a))
    _check(2, 8, 2, 1, 23, 16, 16, torch.float32, mask_kind)
    slopes = torch.tensor([2.0 ** -i for i in range(1, 9)], dtype=torch.float64)
    _check(2, 8, 2, 1, 23, 16, 16, torch.float32, mask_kind, score_mod=qkv.mods.alibi(slopes))
    assert calls or mask_kind in ("causal_top_left",), "the grouped decode path was not taken"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", [(2, 8, 2, 1, 40, 16), (1, 4, 4, 1, 129, 64), (3, 6, 1, 1, 9, 8),
                                   (2, 8, 2, 1, 300, 64)], ids=lambda s: shape_id(*s))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_step_by_positions_in_one_compiled_call(dtype, shape, window, sinks, monkeypatch):
    """A cached decode step (one query per row, a positions mask with padding, a window, sinks) on the CPU
    without autograd runs qkv's compiled decode_attention (the paged-decode kernel over the cache as one block a
    row, keys longer than its 128-key spans included), the ``cpu_decode`` backend: within budget of the float64
    reference, with torch SDPA as the baseline (bfloat16 too: its cache widened to float32 piece by piece), and a
    row whose keys are all padding gives zeros. Switched off, the backend declines by name."""
    from qkv import masks
    from qkv.cpu import kernels

    if kernels.load() is None:
        pytest.skip(f"qkv's CPU kernels: {kernels.unavailable_reason()}")
    B, Hq, Hkv, Nq, Nk, D = shape
    master, cast = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=dtype)
    kv_pos = torch.arange(Nk).repeat(B, 1)
    kv_pos[0, :3] = -1  # left padding
    if B > 1:
        kv_pos[1] = -1  # a row with no key at all
    q_pos = torch.full((B, 1), Nk - 1)
    mask = masks.positions(q_pos, kv_pos, causal=True, window=window)
    z = torch.randn(Hq, generator=torch.Generator().manual_seed(2), dtype=torch.float64) if sinks else None
    with torch.no_grad():
        out = qkv.attention(*cast, mask=mask, sinks=None if z is None else z.to(dtype), backend="cpu_decode")
        ref = qkv.attention(*master, mask=mask, sinks=z, backend="reference")
        monkeypatch.setenv(kernels.ENV, "0")
        ops = qkv.attention(*cast, mask=mask, sinks=None if z is None else z.to(dtype), backend="sdpa")
        with pytest.raises(ValueError, match=f"cpu_decode.*{kernels.ENV}=0 in the environment"):
            qkv.attention(*cast, mask=mask, backend="cpu_decode")
    assert out.shape == (B, Hq, 1, D) and out.dtype == dtype and torch.isfinite(out).all()
    assert_within_budget(out, ref, ops, what="compiled decode step")
    if B > 1:
        assert (out[1] == 0).all(), "a row with no key attends to nothing: zeros"


@pytest.mark.parametrize("causal", [True, False])
def test_compiled_decode_step_broadcast_positions_and_strided_cache(causal):
    """The compiled decode step with positions shared by every row ((1, S) and (1, 1)), not causal (a query
    before some keys sees them), and K/V views that are not contiguous (a (B, S, H, D) cache seen as (B, H, S, D)):
    within budget of the float64 reference."""
    from qkv import masks
    from qkv.cpu import kernels

    if kernels.load() is None:
        pytest.skip(f"qkv's CPU kernels: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, S, D = 3, 8, 2, 150, 32
    q = torch.randn(B, Hq, 1, D, generator=g)
    k = torch.randn(B, S, Hkv, D, generator=g).transpose(1, 2)
    v = torch.randn(B, S, Hkv, D, generator=g).transpose(1, 2)
    kv_pos = torch.arange(S).view(1, S)
    q_pos = torch.tensor([[100]])
    mask = masks.positions(q_pos, kv_pos, causal=causal, window=None)
    with torch.no_grad():
        out = qkv.attention(q, k, v, mask=mask, backend="sdpa")
        ref = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
        base = qkv.attention(q, k, v, mask=mask, backend="reference")
    assert_within_budget(out, ref, base, what="broadcast positions decode step")


@pytest.mark.parametrize("Nk", [5, 40])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_compiled_decode_step_keeps_nonfinite_scores(Nk, bad):
    """A NaN or +inf score in a row's allowed keys makes that row NaN (the reference's answer), short caches and
    long ones alike, on the compiled decode step and the paged one; the other rows stay finite and within budget."""
    from qkv import masks
    from qkv.backends.paged import paged_decode_blocks
    from qkv.cpu import kernels

    if kernels.load() is None:
        pytest.skip(f"qkv's CPU kernels: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D = 2, 4, 2, 16
    q = torch.randn(B, Hq, 1, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g)
    v = torch.randn(B, Hkv, Nk, D, generator=g)
    k[0, :, Nk // 2] = bad  # row 0: one key's scores non-finite
    kv_pos, q_pos = torch.arange(Nk).repeat(B, 1), torch.full((B, 1), Nk - 1)
    mask = masks.positions(q_pos, kv_pos, causal=True)
    with torch.no_grad():
        out = qkv.attention(q, k, v, mask=mask, backend="sdpa")
        ref = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    assert bool(torch.isnan(ref[0]).all()) and bool(torch.isnan(out[0]).all()), "row 0 is NaN, as the reference"
    assert torch.isfinite(out[1]).all()
    # k, v (B, Hkv, Nk, D) read as pools of B blocks of Nk slots, row b's table [b]
    paged, _ = paged_decode_blocks(q[:, :, 0], k, v, torch.arange(B).view(B, 1), kv_pos, q_pos[:, 0])
    assert bool(torch.isnan(paged[0]).all()) and torch.isfinite(paged[1]).all()
