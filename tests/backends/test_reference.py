"""The reference backend is the specification: check it against the textbook formula and the contract."""

import math

import pytest
import torch

import qkv
from _helpers import make_qkv, mask_catalogue


def test_matches_textbook_formula_float64():
    (q, k, v), _ = make_qkv(2, 3, 3, 5, 7, 4, 6, dtype=torch.float64)
    expected = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(4), dim=-1) @ v
    out = qkv.attention(q, k, v, backend="reference")
    assert torch.allclose(out, expected, atol=1e-12)


def test_lse_is_logsumexp_of_final_scores():
    (q, k, v), _ = make_qkv(1, 2, 2, 6, 9, 8, dtype=torch.float64)
    slopes = torch.tensor([0.3, 0.7], dtype=torch.float64)
    res = qkv.attention(q, k, v, mask=qkv.masks.causal(), score_mod=qkv.mods.alibi(slopes), return_lse=True,
                        backend="reference")
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    p = torch.arange(6).view(-1, 1) + 3
    j = torch.arange(9).view(1, -1)
    s = s - slopes.view(1, 2, 1, 1) * (p - j)
    s = s.masked_fill(j > p, float("-inf"))
    assert res.lse.dtype == torch.float64 and res.lse.shape == (1, 2, 6)  # float64 inputs keep a float64 lse
    assert torch.allclose(res.lse, torch.logsumexp(s, -1), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_fully_masked_rows_zero_no_nan(dtype):
    _, (q, k, v) = make_qkv(2, 2, 2, 5, 6, 8, dtype=dtype, requires_grad=True)
    mask = qkv.masks.padding([0, 6])  # batch 0 has no keys at all
    declined = set()
    for backend in ("reference", "sdpa", "tiled", "flex"):
        for t in (q, k, v):
            t.grad = None
        try:
            res = qkv.attention(q, k, v, mask=mask, backend=backend, return_lse=backend != "sdpa")
        except ValueError as e:
            assert "cannot run this request" in str(e), f"{backend}: {e}"
            declined.add(backend)
            continue
        out = res.out if isinstance(res, tuple) else res
        assert torch.isfinite(out).all(), backend
        assert (out[0] == 0).all(), backend
        ref = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
        tol = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
        torch.testing.assert_close(out[1].double(), ref[1], atol=tol, rtol=tol, msg=f"{backend}: the row with keys")
        if isinstance(res, tuple):
            assert torch.isneginf(res.lse[0]).all() and torch.isfinite(res.lse[1]).all()
        out.float().sum().backward()
        assert torch.isfinite(q.grad).all() and (q.grad[0] == 0).all(), backend
        assert (k.grad[0] == 0).all() and (v.grad[0] == 0).all(), backend
    # Flex on CPU is inference-only (these inputs require grad); every other backend must run this.
    assert declined == {"flex"}, f"backends that declined: {sorted(declined)}"


def test_low_precision_accumulates_in_float32():
    """bf16 inputs: the reference's error is far smaller than a bf16-accumulating computation's."""
    (q64, k64, v64), (q, k, v) = make_qkv(1, 1, 1, 4, 4096, 64, dtype=torch.bfloat16)
    exact = qkv.attention(q64, k64, v64, backend="reference")
    out = qkv.attention(q, k, v, backend="reference")
    assert out.dtype == torch.bfloat16
    assert float((out.double() - exact).abs().max()) < 2 ** -8


def test_dropout_reproducible_for_a_seed_and_unbiased():
    _, (q, k, v) = make_qkv(2, 2, 2, 16, 16, 8)
    a = qkv.attention(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(3), backend="reference")
    b = qkv.attention(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(3), backend="reference")
    c = qkv.attention(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(4), backend="reference")
    assert torch.equal(a, b) and not torch.equal(a, c)
    # The keep rate is 1 - p over many coordinates.
    from qkv._dropout import keep_mask

    idx = torch.arange(200_000)
    rate = keep_mask(123, 0.3, idx * 0, idx * 0, idx // 500, idx % 500, 1, 400, 500).float().mean()
    assert abs(float(rate) - 0.7) < 0.005


def test_mask_catalogue_runs_on_reference():
    """Every catalogue mask on the reference equals an explicit float64 softmax over its materialized mask
    (rows with no allowed key: zeros)."""
    for name, m in mask_catalogue(2, 9, 9).items():
        _, (q, k, v) = make_qkv(2, 2, 2, 9, 9, 4)
        q, k, v = q.double(), k.double(), v.double()
        out = qkv.attention(q, k, v, mask=m, backend="reference")
        allowed = torch.ones(2, 2, 9, 9, dtype=torch.bool) if m is None else m.materialize(2, 2, 9, 9)
        scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~allowed, float("-inf"))
        want = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0) @ v
        assert torch.isfinite(out).all(), name
        assert torch.allclose(out, want, atol=1e-12), (name, (out - want).abs().max().item())
