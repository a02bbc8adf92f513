"""``qkv.sdpa`` against ``torch.nn.functional.scaled_dot_product_attention``: same call, same result.

The reference is torch's own function on float64 inputs (independent of qkv); the baseline is torch's
function in the candidate's dtype. Forward and backward (q, k, v and a float mask), over shapes from 2-D to
5-D, GQA, boolean / additive / key-padding / ``-inf`` masks, top-left ``is_causal`` with L < S and L > S.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.testing import assert_within_budget

# id -> (q shape, k/v heads (None: same as q's leading dims), S, Ev, mask kind, sdpa kwargs)
CASES = {
    "4d-B2-H4-L16-S16-none": ((2, 4, 16, 32), None, 16, 32, None, {}),
    "4d-gqa-H8-KV2-L13-S29-causal": ((2, 8, 13, 16), 2, 29, 16, None, dict(is_causal=True, enable_gqa=True)),
    "4d-L29-S13-causal-topleft": ((1, 2, 29, 16), None, 13, 24, None, dict(is_causal=True)),
    "4d-bool-LS-empty-row": ((2, 3, 11, 8), None, 17, 8, "bool_ls", {}),
    "4d-gqa-keypad-B11S": ((2, 4, 9, 16), 1, 12, 16, "keypad", dict(enable_gqa=True)),
    "4d-float-HLS-learnable": ((2, 4, 10, 16), None, 14, 16, "float_hls", dict(scale=0.3)),
    "4d-float-neginf": ((2, 2, 8, 16), None, 8, 16, "float_neginf", {}),
    "3d-NLE-bool-NLS": ((3, 7, 16), None, 9, 16, "bool_nls", {}),
    "2d-LE-causal": ((6, 8), None, 6, 8, None, dict(is_causal=True)),
    "5d-gqa-bool": ((2, 3, 4, 5, 8), 2, 7, 8, "bool_ls", dict(enable_gqa=True)),
}


def _make(case: str, dtype, seed: int = 0):
    qshape, kvh, S, Ev, mkind, kw = CASES[case]
    g = torch.Generator().manual_seed(seed)
    lead, L, E = qshape[:-2], qshape[-2], qshape[-1]
    klead = lead if kvh is None else (*lead[:-1], kvh)
    q = torch.randn(*lead, L, E, generator=g, dtype=torch.float64)
    k = torch.randn(*klead, S, E, generator=g, dtype=torch.float64)
    v = torch.randn(*klead, S, Ev, generator=g, dtype=torch.float64)
    q, k, v = (t.to(dtype).to(torch.float64) for t in (q, k, v))
    mask = None
    if mkind == "bool_ls":
        mask = torch.rand(L, S, generator=g) < 0.6
        mask[1] = False  # a row with no allowed key
    elif mkind == "bool_nls":
        mask = torch.rand(lead[0], L, S, generator=g) < 0.6
    elif mkind == "keypad":
        mask = torch.ones(lead[0], 1, 1, S, dtype=torch.bool)
        mask[0, ..., S // 2:] = False
    elif mkind == "float_hls":
        mask = torch.randn(lead[-1], L, S, generator=g, dtype=torch.float64)
    elif mkind == "float_neginf":
        mask = torch.randn(L, S, generator=g, dtype=torch.float64)
        mask[torch.rand(L, S, generator=g) < 0.3] = float("-inf")
        mask[2] = float("-inf")
    return q, k, v, mask, kw


def _run(fn, q, k, v, mask, kw, dtype, seed=1):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    m = None
    if mask is not None:
        m = mask if mask.dtype == torch.bool else mask.detach().to(dtype).requires_grad_(True)
        leaves.append(m) if m.dtype != torch.bool else None
    out = fn(*leaves[:3], attn_mask=m, **kw)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad((out * w).sum(), leaves, allow_unused=True)
    return out.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_match_torch(case, dtype):
    q, k, v, mask, kw = _make(case, dtype)
    ref_out, ref_grads = _run(F.scaled_dot_product_attention, q, k, v, mask, kw, torch.float64)
    base_out, base_grads = _run(F.scaled_dot_product_attention, q, k, v, mask, kw, dtype)
    out, grads = _run(qkv.sdpa, q, k, v, mask, kw, dtype)
    _check(case, out, grads, ref_out, ref_grads, base_out, base_grads, dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_tiled_backend_through_the_dropin(case):
    """The same calls pinned to the tiled backend (what ``auto`` picks on long sequences)."""
    q, k, v, mask, kw = _make(case, torch.float32)
    ref_out, ref_grads = _run(F.scaled_dot_product_attention, q, k, v, mask, kw, torch.float64)
    base_out, base_grads = _run(F.scaled_dot_product_attention, q, k, v, mask, kw, torch.float32)
    out, grads = _run(lambda *a, **k_: qkv.sdpa(*a, backend="tiled", **k_), q, k, v, mask, kw, torch.float32)
    _check(case, out, grads, ref_out, ref_grads, base_out, base_grads, torch.float32)


def _check(case, out, grads, ref_out, ref_grads, base_out, base_grads, dtype):
    assert out.dtype == dtype and out.shape == ref_out.shape, (out.dtype, out.shape, ref_out.shape)
    assert_within_budget(out, ref_out, base_out, what=f"{case} out")
    for name, g, r, b in zip("qkvm", grads, ref_grads, base_grads):
        assert_within_budget(g, r, b, what=f"{case} d{name}")


def test_fully_masked_rows_are_zeros_or_nan_on_request():
    q, k, v, mask, _ = _make("4d-bool-LS-empty-row", torch.float32)
    q, k, v = q.float(), k.float(), v.float()
    out = qkv.sdpa(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all() and (out[:, :, 1] == 0).all()
    nan = qkv.sdpa(q, k, v, attn_mask=mask, empty_rows="nan")
    assert torch.isnan(nan[:, :, 1]).all() and torch.equal(nan[:, :, [0, *range(2, 11)]], out[:, :, [0, *range(2, 11)]])


def test_dropout_is_seeded_and_unbiased_in_expectation():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    a = qkv.sdpa(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(5))
    b = qkv.sdpa(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    plain = qkv.sdpa(q, k, v)
    assert (a - plain).abs().max() > 1e-3
    mean = torch.stack([qkv.sdpa(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(s))
                        for s in range(300)]).mean(0)
    assert (mean - plain).abs().max() < 0.25, (mean - plain).abs().max()


def test_torch_name_is_the_same_function():
    assert qkv.scaled_dot_product_attention is qkv.sdpa


@pytest.mark.parametrize("call,match", [
    (lambda q, k: qkv.sdpa(q, k[:, :2], k[:, :2]), "enable_gqa=True"),
    (lambda q, k: qkv.sdpa(q, k, k, attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True), "not both"),
    (lambda q, k: qkv.sdpa(q, k, k, attn_mask=torch.ones(3, 8, dtype=torch.bool)), "does not broadcast"),
    (lambda q, k: qkv.sdpa(q, k, k, attn_mask=torch.ones(8, 8, dtype=torch.int32)), "bool .* or float"),
    (lambda q, k: qkv.sdpa(q, k, k, attn_mask=[[True]]), "attn_mask must be"),
    (lambda q, k: qkv.sdpa(q, k, k, dropout_p=1.0), "dropout_p"),
    (lambda q, k: qkv.sdpa(q, k, k, empty_rows="inf"), "empty_rows"),
    (lambda q, k: qkv.sdpa(q, k[0], k[0]), "same number of dims"),
    (lambda q, k: qkv.sdpa(q, k.expand(3, -1, -1, -1), k.expand(3, -1, -1, -1)), "batch dims must match"),
    (lambda q, k: qkv.sdpa(q[0, 0, 0], k, k), "at least 2 dims"),
    (lambda q, k: qkv.sdpa(q, k, k, scale=float("nan")), "scale"),
    (lambda q, k: qkv.sdpa(q, k[:, :3], k[:, :3], enable_gqa=True), "multiple"),
], ids=["gqa-off", "mask-and-causal", "mask-shape", "mask-dtype", "mask-type", "dropout", "empty-rows", "ranks",
        "batch", "rank1", "scale", "gqa-heads-not-a-multiple"])
def test_bad_input_is_named(call, match):
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 4, 8, 16)
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, k)


def _random_case(seed: int):
    """A random call: rank 3 or 4, GQA or not, lengths 1..40, one of five mask kinds, a random scale."""
    g = torch.Generator().manual_seed(1000 + seed)
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    rank, B, kv = pick(3, 4), pick(1, 2, 3), pick(1, 2)
    H = kv * pick(1, 2, 4) if rank == 4 else 1
    kv = kv if rank == 4 else 1
    L, S = (int(torch.randint(1, 41, (1,), generator=g)) for _ in range(2))
    E, Ev = pick(8, 16), pick(8, 24)
    kind = pick("none", "causal", "bool", "float", "keypad")
    lead_q, lead_k = ((B, H), (B, kv)) if rank == 4 else ((B,), (B,))
    q = torch.randn(*lead_q, L, E, generator=g, dtype=torch.float64)
    k = torch.randn(*lead_k, S, E, generator=g, dtype=torch.float64)
    v = torch.randn(*lead_k, S, Ev, generator=g, dtype=torch.float64)
    kw = dict(enable_gqa=H != kv, scale=pick(None, 0.2))
    mask = None
    if kind == "causal":
        kw["is_causal"] = True
    elif kind == "bool":
        mask = torch.rand(L, S, generator=g) < 0.7
    elif kind == "float":
        mask = torch.randn(*lead_q[:1], 1, L, S, generator=g, dtype=torch.float64) if rank == 4 else \
            torch.randn(L, S, generator=g, dtype=torch.float64)
    elif kind == "keypad":
        mask = (torch.arange(S) < torch.randint(1, S + 1, (B, 1), generator=g)).view(B, *([1] * (rank - 2)), S)
    desc = f"r{rank}-B{B}-H{H}-KV{kv}-L{L}-S{S}-E{E}-Ev{Ev}-{kind}"
    return desc, (q, k, v, mask, kw)


@pytest.mark.parametrize("seed", range(16), ids=lambda s: _random_case(s)[0])
def test_random_calls_match_torch(seed):
    _, (q, k, v, mask, kw) = _random_case(seed)
    for dtype in (torch.float32, torch.bfloat16):
        ref_out, ref_grads = _run(F.scaled_dot_product_attention, q, k, v, mask, kw, torch.float64)
        base_out, base_grads = _run(F.scaled_dot_product_attention, q, k, v, mask, kw, dtype)
        out, grads = _run(qkv.sdpa, q, k, v, mask, kw, dtype)
        _check(f"seed {seed} {dtype}", out, grads, ref_out, ref_grads, base_out, base_grads, dtype)


def test_three_dim_inputs_share_key_heads_with_enable_gqa_as_torch_does():
    """3-D inputs are (heads, length, dim): 8 query heads over 2 key/value heads."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(h, n, 16, generator=g, dtype=torch.float64) for h, n in ((8, 5), (2, 7), (2, 7)))
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    got = qkv.sdpa(q.float(), k.float(), v.float(), enable_gqa=True)
    base = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    assert got.shape == want.shape == (8, 5, 16)
    assert_within_budget(got, want, base, what="3-D enable_gqa")


@pytest.mark.parametrize("L,S", [(0, 7), (5, 0), (0, 0)])
def test_zero_length_queries_or_keys_give_torchs_result(L, S):
    """No queries: an empty output; no keys: every row empty, zeros as torch's CPU kernel gives them."""
    q, k, v = torch.randn(1, 2, L, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)
    got, want = qkv.sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v)
    assert got.shape == want.shape == (1, 2, L, 16)
    assert torch.equal(got, want)
