"""The flex backend: FlexAttention against the float64 reference, its BlockMask, compile cache and declines.

Every numerical check is an error budget (qkv.testing): Flex's error against the float64 reference must
be within k times the error of the reference backend run in the same dtype. Flex compiles one kernel per
signature (5-10 s each on CPU, ~40 s for the first in a cold process), so the unmarked tests compile
seven kernels, each serving several checks (``CI_SUBSET`` folds the matrix's document, Longformer and
BigBird masks, fully masked rows, MQA, fp16 softcap, relative and tensor bias, a per-head dense mask in
bf16 and Nq = 1 into four), all on one xdist worker (``xdist_group``) so the first compile is paid once;
the full matrix is ``@pytest.mark.slow``. On CPU
FlexAttention is inference-only (no backward, no log-sum-exp; the backend declines those), so gradient
and lse checks run where CUDA is present.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import qkv
from qkv import masks as M
from qkv import mods
from qkv._request import build_request
from qkv.backends.flex import BLOCK_SIZE, to_block_mask
from qkv.masks.base import EMPTY, FULL, PARTIAL
from qkv.masks.causal import SlidingWindow
from qkv.testing import assert_within_budget

pytestmark = pytest.mark.xdist_group("flex")  # one worker pays the first compile for every kernel here

FLEX = qkv.backends.get("flex")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRAINS = DEVICE == "cuda"  # FlexAttention has a backward and an lse only off CPU
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

_probe = build_request(*(torch.zeros(1, 1, 8, 16, device=DEVICE),) * 3)
needs_flex = pytest.mark.skipif(FLEX.decline(_probe) is not None,
                                reason=f"flex cannot run here: {FLEX.decline(_probe)}")


def sid(B, Hq, Hkv, Nq, Nk, D, Dv=None, dtype=torch.float32) -> str:
    dv = f"-Dv{Dv}" if Dv not in (None, D) else ""
    return f"B{B}-Hq{Hq}-Hkv{Hkv}-Nq{Nq}-Nk{Nk}-D{D}{dv}-{DTYPE_NAMES.get(dtype, dtype)}"


def inputs(B, Hq, Hkv, Nq, Nk, D, Dv=None, *, seed=0):
    """Fresh float64 q, k, v (B, H, N, D) on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv or D)]
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE) for s in shapes]


def _run(backend, qkv64, dtype, mask, make_mod, extra64, *, grad, cotangent):
    """Output, lse and gradients (q, k, v, then the modifier's tensors) of one backend in ``dtype``."""
    leaves = [t.to(dtype).requires_grad_(grad) for t in qkv64]
    extra_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    extra = {n: t.to(extra_dtype).requires_grad_(grad) for n, t in extra64.items()}
    mod = make_mod(extra) if make_mod is not None else None
    with torch.set_grad_enabled(grad):
        result = qkv.attention(*leaves, mask=mask, score_mod=mod, return_lse=grad, backend=backend)
    out, lse = result if grad else (result, None)
    grads = []
    if grad:
        out.backward(cotangent.to(out.dtype))
        grads = [t.grad for t in (*leaves, *extra.values())]
    return out, lse, grads


def check(qkv64, *, dtype=torch.float32, mask=None, make_mod=None, extra=None, what=""):
    """Flex within budget of the float64 reference: forward, and on CUDA also lse and every gradient."""
    extra = extra or {}
    cot = torch.randn(*qkv64[0].shape[:3], qkv64[2].shape[-1], dtype=torch.float64,
                      generator=torch.Generator().manual_seed(1)).to(DEVICE)
    args = dict(grad=TRAINS, cotangent=cot)
    out, lse, grads = _run("flex", qkv64, dtype, mask, make_mod, extra, **args)
    ref, ref_lse, ref_grads = _run("reference", qkv64, torch.float64, mask, make_mod, extra, **args)
    base, base_lse, base_grads = _run("reference", qkv64, dtype, mask, make_mod, extra, **args)
    assert out.dtype == dtype and not out.isnan().any(), f"{what}: NaN or wrong dtype {out.dtype}"
    assert_within_budget(out, ref, base, what=f"{what} out")
    if TRAINS:
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape, what
        assert_within_budget(lse, ref_lse, base_lse, what=f"{what} lse")
        names = ["dq", "dk", "dv", *(f"d{n}" for n in extra)]
        for name, g, r, b in zip(names, grads, ref_grads, base_grads, strict=True):
            assert g is not None and not g.isnan().any(), f"{what}: {name} missing or NaN"
            assert_within_budget(g, r, b, what=f"{what} {name}")
    return out


def _block_masks():
    g = torch.Generator().manual_seed(0)
    doc = torch.repeat_interleave(torch.arange(5), torch.tensor([100, 28, 300, 1, 211]))  # 640 tokens
    return {
        "none": (None, 1, 300, 300),
        "causal-Nq384-Nk640": (M.causal(), 2, 384, 640),
        "causal-top_left-Nq384-Nk640": (M.causal(align="top_left"), 1, 384, 640),
        "causal-Nq300-Nk413": (M.causal(), 1, 300, 413),
        "window(200,50)-N640": (M.sliding_window(200, 50), 1, 640, 640),
        "padding-B3-N512": (M.padding([512, 0, 130]), 3, 512, 512),
        "document-N640": (M.document(doc), 2, 640, 640),
        "document-B2-N640": (M.document(torch.stack([doc, doc.flip(0)])), 2, 640, 640),
        "longformer-N640": (M.sliding_window(64, 64) | M.global_tokens([0, 300]), 1, 640, 640),
        "bigbird-N640": (M.bigbird(64, seed=3), 1, 640, 640),
        "prefix_lm-N513": (M.prefix_lm([200]), 1, 513, 513),
        "dense-N260": (M.dense(torch.rand(260, 260, generator=g) < 0.01), 1, 260, 260),
    }


BLOCK_MASKS = _block_masks()


@pytest.mark.parametrize("name", list(BLOCK_MASKS))
def test_block_mask_lists_full_and_partial_tiles_of_the_block_map(name):
    mask, B, nq, nk = BLOCK_MASKS[name]
    bm = to_block_mask(mask, nq, nk)
    bq, bk = BLOCK_SIZE
    states = (torch.full((1, 1, -(-nq // bq), -(-nk // bk)), FULL, dtype=torch.int8) if mask is None
              else mask.block_map(nq, nk, bq, bk))
    assert bm.BLOCK_SIZE == BLOCK_SIZE and tuple(bm.seq_lengths) == (nq, nk)
    assert tuple(bm.kv_indices.shape) == tuple(states.shape), name
    assert torch.equal(bm.to_dense().bool(), states != EMPTY), f"{name}: visited tiles differ from the block map"
    listed_by_state = ((bm.kv_num_blocks, bm.kv_indices, PARTIAL), (bm.full_kv_num_blocks, bm.full_kv_indices, FULL))
    for num, idx, state in listed_by_state:
        want = states == state
        assert torch.equal(num, want.sum(-1).int()), f"{name}: block counts for state {state}"
        listed = torch.zeros_like(want)
        cols = torch.arange(want.shape[-1])
        listed.scatter_(-1, idx.long(), (cols < num.unsqueeze(-1)).expand_as(want))
        assert torch.equal(listed, want), f"{name}: listed tiles for state {state}"
    # Ground truth: FULL tiles are all allowed, EMPTY tiles have nothing allowed.
    dense = (torch.ones(1, nq, nk, dtype=torch.bool) if mask is None
             else mask.dense(B, 1, nq, nk)[:, 0])
    padded = torch.zeros(dense.shape[0], states.shape[2] * bq, states.shape[3] * bk, dtype=torch.int32)
    padded[:, :nq, :nk] = dense.int()
    counts = padded.view(dense.shape[0], states.shape[2], bq, states.shape[3], bk).sum((2, 4))
    rows = torch.clamp(nq - torch.arange(states.shape[2]) * bq, max=bq).view(-1, 1)
    area = rows * torch.clamp(nk - torch.arange(states.shape[3]) * bk, max=bk).view(1, -1)
    visited = bm.to_dense()[:, 0].bool().expand_as(counts)
    full = torch.zeros_like(visited)
    full.scatter_(-1, bm.full_kv_indices[:, 0].long(),
                  (torch.arange(full.shape[-1]) < bm.full_kv_num_blocks[:, 0].unsqueeze(-1)).expand_as(full))
    assert bool((counts[full.expand_as(counts)] == area.expand_as(counts)[full.expand_as(counts)]).all()), name
    assert bool((counts[~visited] == 0).all()), f"{name}: a tile with allowed pairs is skipped"


@pytest.mark.parametrize("name", ["causal-Nq384-Nk640", "window(200,50)-N640", "document-B2-N640", "bigbird-N640"])
def test_block_mask_equals_torch_create_block_mask(name):
    """External check on lengths that are multiples of 128 (torch marks ragged edge tiles partial, qkv full)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask, B, nq, nk = BLOCK_MASKS[name]
    ours = to_block_mask(mask, nq, nk)
    theirs = create_block_mask(ours.mask_mod, mask.batch or 1, 1, nq, nk, device="cpu")
    assert torch.equal(ours.kv_num_blocks, theirs.kv_num_blocks), name
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks), name
    assert torch.equal(ours.to_dense(), theirs.to_dense()), name


class CountingWindow(SlidingWindow):
    """A sliding window that counts how often its element-wise predicate runs."""

    calls = 0

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        CountingWindow.calls += 1
        return super().allowed(b, h, q_idx, kv_idx, nq, nk)


def test_block_mask_and_estimate_never_evaluate_an_analytic_mask():
    CountingWindow.calls = 0
    mask = CountingWindow(100) | M.global_tokens([0]) & M.padding([4000, 17])
    bm = to_block_mask(mask, 4096, 4096)
    q = torch.zeros(2, 2, 4096, 16)
    FLEX.estimate(build_request(q, q, q, mask=mask))
    assert CountingWindow.calls == 0, f"allowed() ran {CountingWindow.calls} times building the BlockMask"
    assert int(bm.kv_num_blocks.sum()) > 0
    bm.mask_mod(torch.tensor(0), torch.tensor(0), torch.tensor(5), torch.tensor(3))
    assert CountingWindow.calls == 1, "the mask_mod must be the mask's own predicate"


def test_estimate_counts_allowed_tiles_and_compile():
    q = torch.zeros(1, 4, 4096, 64)
    est = {name: FLEX.estimate(build_request(q, q, q, mask=m))
           for name, m in [("dense", None), ("causal", M.causal()), ("window", M.sliding_window(255))]}
    assert est["window"].seconds < est["causal"].seconds < est["dense"].seconds, est
    assert all("compile will be paid" in e.note for e in est.values()), est
    visited = {name: int(re.match(r"(\d+)% of tiles", e.note).group(1)) for name, e in est.items()}
    assert visited["dense"] == 100 and 50 <= visited["causal"] <= 53 and visited["window"] < 10, est


def test_explain_mentions_compile():
    q = torch.randn(1, 2, 96, 24)  # a shape no test compiles
    text = str(qkv.explain(q, q, q, mask=M.sliding_window(7)))
    if FLEX.decline(build_request(q, q, q)) is None:
        assert "compile will be paid (~" in text, text
        assert qkv.explain(q, q, q).chosen != "flex", "auto must not pay a compile for a tiny problem"
    else:
        assert "flex" in text and "declined" in text, text


def _declines():
    x = torch.randn(1, 2, 8, 16)
    g = x.clone().requires_grad_()
    cases = {
        "dropout": (dict(q=x, k=x, v=x, dropout_p=0.1), "dropout"),
        "float64": (dict(q=x.double(), k=x.double(), v=x.double()), "float64"),
    }
    if FLEX.decline(build_request(x, x, x)) is None:  # CPU-only limits, on a CPU Flex can otherwise use
        cases["cpu-backward"] = (dict(q=g, k=x, v=x), "inference-only")
        cases["cpu-bias-grad"] = (dict(q=x, k=x, v=x, score_mod=mods.bias(torch.zeros(8, 8, requires_grad=True))),
                                  "inference-only")
        cases["cpu-return_lse"] = (dict(q=x, k=x, v=x, return_lse=True), "log-sum-exp")
    return cases


DECLINES = _declines()


@pytest.mark.parametrize("name", list(DECLINES))
def test_declined_requests_raise_naming_flex(name):
    kwargs, why = DECLINES[name]
    with pytest.raises(ValueError, match=f"backend 'flex' cannot run this request: .*{why}"):
        qkv.attention(**kwargs, backend="flex")
    assert why in str(qkv.explain(**kwargs)), "explain must give the same reason"


@pytest.mark.parametrize("shape", [(2, 2, 0, 5, 16), (2, 2, 5, 0, 16), (0, 2, 5, 5, 16)],
                         ids=["Nq0", "Nk0", "B0"])
def test_empty_problems_need_no_kernel(shape):
    B, H, Nq, Nk, D = shape
    q, kv = torch.randn(B, H, Nq, D), torch.randn(B, H, Nk, D)
    why = FLEX.decline(build_request(q, kv, kv))
    if why is not None:
        pytest.skip(f"flex cannot run here: {why}")
    out = qkv.attention(q, kv, kv, mask=M.causal(), backend="flex")
    assert torch.equal(out, torch.zeros(B, H, Nq, D)), "no keys: every row is fully masked, so zeros"


@needs_flex
def test_compile_is_paid_once_per_signature():
    """Causal (bottom-right, Nq != Nk), GQA, Dv != Dqk: the first call compiles, the second reuses it."""
    qkv64 = inputs(2, 4, 2, 200, 263, 64, 32)
    q, k, v = (t.float() for t in qkv64)
    req = build_request(q, k, v, mask=M.causal())
    assert not FLEX.is_compiled(req), "no other test may compile this signature"
    before = FLEX.estimate(req)
    assert "compile will be paid" in before.note, before
    t0 = time.perf_counter()
    first = check(qkv64, mask=M.causal(), what="causal GQA " + sid(2, 4, 2, 200, 263, 64, 32))
    t_first = time.perf_counter() - t0
    assert FLEX.is_compiled(build_request(q, k, v, mask=M.causal())), "a fresh, equal mask shares the kernel"
    assert not FLEX.is_compiled(build_request(q, k, v, mask=M.causal(align="top_left")))
    assert not FLEX.is_compiled(build_request(q[:1], k[:1], v[:1], mask=M.causal()))
    after = FLEX.estimate(req)
    assert "compiled kernel cached" in after.note and after.seconds < before.seconds - 1.0, (before, after)
    assert "compiled kernel cached" in str(qkv.explain(q, k, v, mask=M.causal()))
    with torch.no_grad():
        t0 = time.perf_counter()
        second = qkv.attention(q, k, v, mask=M.causal(), backend="flex")
        t_second = time.perf_counter() - t0
    assert t_second < t_first / 5, f"second call {t_second:.3f}s vs first {t_first:.3f}s: it recompiled"
    assert torch.equal(first.detach(), second)


@needs_flex
def test_padding_with_empty_rows_shares_one_kernel_across_lengths():
    """Per-batch block maps (Bm = B), a batch row with no keys (fully masked rows, zeros, no NaN), and new
    lengths reusing the compiled kernel (tensor contents are not part of the signature)."""
    qkv64 = inputs(3, 2, 2, 300, 300, 64, seed=2)
    out = check(qkv64, mask=M.padding([300, 0, 129]), what="padding " + sid(3, 2, 2, 300, 300, 64))
    assert torch.equal(out[1], torch.zeros_like(out[1])), "rows with no allowed key must be exactly zero"
    q, k, v = (t.float() for t in qkv64)
    assert FLEX.is_compiled(build_request(q, k, v, mask=M.padding([1, 255, 17])))
    check(qkv64, mask=M.padding([1, 255, 17]), what="padding, other lengths")


@needs_flex
def test_sliding_window_alibi_bfloat16():
    qkv64 = inputs(1, 4, 4, 257, 257, 64, seed=3)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    check(qkv64, dtype=torch.bfloat16, mask=M.sliding_window(63, 8), make_mod=lambda t: mods.alibi(t["slopes"]),
          extra={"slopes": slopes.double()}, what="window+alibi " + sid(1, 4, 4, 257, 257, 64, dtype=torch.bfloat16))


def _matrix():
    g = torch.Generator().manual_seed(5)
    doc400 = torch.sort(torch.randint(0, 6, (2, 400), generator=g), dim=1).values
    q_ids = torch.cat([torch.full((40,), 99), torch.zeros(60, dtype=torch.int64)])  # 40 rows see no key
    rel = lambda t: mods.relative_bias(t["table"], lambda d: d.clamp(-8, 8) + 8)  # Shaw clipping
    return {
        # name: (B, Hq, Hkv, Nq, Nk, D, Dv, dtype, mask, make_mod, extra)
        "none": (2, 4, 4, 257, 257, 64, 64, torch.float32, None, None, {}),
        "causal-top_left": (1, 2, 2, 130, 300, 64, 64, torch.float32, M.causal(align="top_left"), None, {}),
        "causal-Nq>Nk-empty-rows": (1, 2, 2, 300, 130, 64, 64, torch.float32, M.causal(), None, {}),
        "sliding_window": (2, 2, 2, 513, 513, 64, 64, torch.float32, M.sliding_window(100, 20), None, {}),
        "document": (2, 2, 2, 400, 400, 32, 32, torch.float32, M.document(doc400), None, {}),
        "document-q_ids-empty-rows": (1, 2, 2, 100, 100, 64, 64, torch.float32,
                                      M.document(torch.zeros(100, dtype=torch.int64), q_ids=q_ids), None, {}),
        "longformer": (1, 2, 2, 384, 384, 64, 64, torch.float32, M.sliding_window(32, 32) | M.global_tokens([0, 200]),
                       None, {}),
        "bigbird": (1, 2, 2, 512, 512, 64, 64, torch.float32, M.bigbird(64, seed=1), None, {}),
        "mqa-group6": (2, 6, 1, 200, 200, 64, 64, torch.float32, M.causal(), None, {}),
        "softcap-fp16": (1, 4, 2, 200, 200, 64, 64, torch.float16, M.causal(), lambda t: mods.softcap(5.0), {}),
        "relative_bias": (1, 4, 4, 150, 150, 32, 32, torch.float32, None, rel,
                          {"table": torch.randn(17, 4, generator=g, dtype=torch.float64)}),
        "tensor_bias": (2, 2, 2, 140, 140, 32, 32, torch.float32, M.causal(), lambda t: mods.bias(t["bias"]),
                        {"bias": torch.randn(2, 1, 140, 140, generator=g, dtype=torch.float64)}),
        "head-dependent-dense-D80-Dv48-bf16": (1, 2, 2, 200, 200, 80, 48, torch.bfloat16,
                                               M.dense(torch.rand(2, 200, 200, generator=g).unsqueeze(0) < 0.3),
                                               None, {}),
        "from_fn-N1": (1, 2, 2, 1, 300, 64, 64, torch.float32, M.from_fn(lambda b, h, q, k: k % 3 != 0), None, {}),
    }


MATRIX = _matrix()


def _ci_subset():
    g = torch.Generator().manual_seed(11)
    ids = torch.sort(torch.randint(0, 4, (2, 192), generator=g), dim=1).values
    q_ids = ids.clone()
    q_ids[1, :50] = 99  # 50 query rows of batch 1 carry an id no key has: fully masked rows
    rel = lambda t: mods.relative_bias(t["table"], lambda d: d.clamp(-8, 8) + 8)  # Shaw clipping
    return {
        # name: (B, Hq, Hkv, Nq, Nk, D, Dv, dtype, mask, make_mod, extra)
        "document-q_ids-empty-rows-MQA-tensor_bias": (
            2, 4, 1, 192, 192, 32, 32, torch.float32, M.document(ids, q_ids=q_ids), lambda t: mods.bias(t["bias"]),
            {"bias": torch.randn(2, 1, 192, 192, generator=g, dtype=torch.float64)}),
        "longformer-softcap-fp16": (1, 4, 2, 256, 256, 64, 64, torch.float16,
                                    M.sliding_window(32, 32) | M.global_tokens([0, 130]),
                                    lambda t: mods.softcap(5.0), {}),
        "bigbird-relative_bias": (1, 4, 4, 256, 256, 32, 32, torch.float32, M.bigbird(64, seed=1), rel,
                                  {"table": torch.randn(17, 4, generator=g, dtype=torch.float64)}),
        "head-dependent-dense-Nq1-D80-Dv48-bf16": (2, 2, 2, 1, 300, 80, 48, torch.bfloat16,
                                                   M.dense(torch.rand(2, 2, 1, 300, generator=g) < 0.3), None, {}),
    }


CI_SUBSET = _ci_subset()


@needs_flex
@pytest.mark.parametrize("name", list(CI_SUBSET))
def test_flex_equals_reference_ci_subset(name):
    """Four kernels that together cover every kind of case in the slow matrix (small shapes)."""
    B, Hq, Hkv, Nq, Nk, D, Dv, dtype, mask, make_mod, extra = CI_SUBSET[name]
    qkv64 = inputs(B, Hq, Hkv, Nq, Nk, D, Dv, seed=len(name))
    extra = {n: t.to(DEVICE) for n, t in extra.items()}
    out = check(qkv64, dtype=dtype, mask=mask, make_mod=make_mod, extra=extra,
                what=f"{name} {sid(B, Hq, Hkv, Nq, Nk, D, Dv, dtype)}")
    allowed = mask.dense(B, Hq, Nq, Nk, device=DEVICE).any(-1).expand(B, Hq, Nq)
    if "empty-rows" in name:
        assert bool((~allowed).any()), "the case must have fully masked rows"
    assert bool((out[~allowed] == 0).all()), "fully masked rows must be zeros"


@pytest.mark.slow
@needs_flex
@pytest.mark.parametrize("name", list(MATRIX))
def test_flex_equals_reference(name):
    B, Hq, Hkv, Nq, Nk, D, Dv, dtype, mask, make_mod, extra = MATRIX[name]
    qkv64 = inputs(B, Hq, Hkv, Nq, Nk, D, Dv, seed=len(name))
    extra = {n: t.to(DEVICE) for n, t in extra.items()}
    out = check(qkv64, dtype=dtype, mask=mask, make_mod=make_mod, extra=extra,
                what=f"{name} {sid(B, Hq, Hkv, Nq, Nk, D, Dv, dtype)}")
    if "empty-rows" in name:
        allowed = mask.dense(B, 1, Nq, Nk, device=DEVICE).any(-1)  # (B or 1, 1, Nq)
        empty = ~allowed.expand(B, Hq, Nq)
        assert bool(empty.any()) and bool((out[empty] == 0).all()), "fully masked rows must be zeros"


@pytest.mark.slow
@pytest.mark.skipif(not TRAINS, reason="FlexAttention has no backward on CPU; the backend declines it there")
def test_tensor_bias_gradient_flows_through_flex():
    bias = torch.zeros(1, 2, 64, 64, device=DEVICE, requires_grad=True)
    q = torch.randn(1, 2, 64, 32, device=DEVICE, requires_grad=True)
    out = qkv.attention(q, q, q, score_mod=mods.bias(bias), backend="flex")
    out.sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0


def _topk_lists(B, H, Nq, Nk, K, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, Nk, (B, H, Nq, K), generator=g)
    idx[0, 0, 5] = -1  # a row that lists nothing
    idx[..., -1] = idx[..., 0]  # duplicates count once
    return idx


@needs_flex
def test_topk_lists_per_head_and_causal_on_flex():
    """masks.topk on Flex: the mask_mod looks the key up in the row's list, the BlockMask is the lists' block map."""
    B, Hq, Hkv, N, D = 2, 2, 1, 150, 32
    mask = M.topk(_topk_lists(B, Hq, N, N, 7, seed=3)) & M.causal()
    out = check(inputs(B, Hq, Hkv, N, N, D, seed=3), mask=mask,
                what=f"topk per head & causal {sid(B, Hq, Hkv, N, N, D)}")
    assert bool((out[0, 0, 5] == 0).all()), "a row that lists nothing returns zeros"


@pytest.mark.slow
@needs_flex
def test_topk_shared_lists_softcap_fp16_on_flex():
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 130, 300, 64
    mask = M.topk(_topk_lists(B, 1, Nq, Nk, 33, seed=4))
    check(inputs(B, Hq, Hkv, Nq, Nk, D, seed=4), dtype=torch.float16, mask=mask,
          make_mod=lambda t: mods.softcap(5.0), what=f"topk shared, softcap {sid(B, Hq, Hkv, Nq, Nk, D)}")


def test_declines_long_topk_lists_and_names_gather():
    """Lists up to 64 keys compile (looked up entry by entry); longer ones would need a reduction in mask_mod."""
    x = torch.randn(1, 1, 80, 16)
    mask = M.causal() & ~M.topk(torch.zeros(1, 1, 80, 65, dtype=torch.int64))
    with pytest.raises(ValueError, match="topk lists of 65 keys.*backend='gather'"):
        qkv.attention(x, x, x, mask=mask, backend="flex")
    short = qkv.explain(x, x, x, mask=M.topk(torch.zeros(1, 1, 80, 64, dtype=torch.int64))).declined
    assert "topk lists" not in short.get("flex", ""), short
