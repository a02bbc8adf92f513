"""The gather backend reads only the listed keys of a masks.topk request: it equals the float64 reference with
every term it evaluates at the gathered positions (other masks, score modifiers, sinks, GQA), forward and
backward; auto picks it when the lists are short against the keys, and explain says why it declines."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M
from qkv import mods


def _grads(backend, q, k, v, mask, **kw):
    out, lse = qkv.attention(q, k, v, mask=mask, backend=backend, return_lse=True, **kw)
    leaves = [q, k, v] + ([kw["sinks"]] if kw.get("sinks") is not None else [])
    loss = (out ** 2).sum() + (lse.nan_to_num(neginf=0.0) * torch.linspace(0, 1, lse.shape[-1], dtype=lse.dtype)).sum()
    return out, lse, torch.autograd.grad(loss, leaves)


CASES = {
    "per_head-gqa": (dict(B=2, Hq=4, Hkv=2, Nq=37, Nk=53, K=5, per_head=True), None, {}),
    "shared-mqa-causal": (dict(B=2, Hq=4, Hkv=1, Nq=37, Nk=53, K=9, per_head=False), M.causal(), {}),
    "window-sinks": (dict(B=1, Hq=4, Hkv=2, Nq=20, Nk=40, K=6, per_head=True),
                     M.causal() & M.sliding_window(10), {"sinks": True}),
    "padding-softcap": (dict(B=2, Hq=2, Hkv=2, Nq=17, Nk=30, K=4, per_head=False),
                        M.padding(torch.tensor([20, 30])), {"score_mod": mods.softcap(5.0)}),
    "alibi": (dict(B=1, Hq=2, Hkv=2, Nq=17, Nk=30, K=4, per_head=False), None,
              {"score_mod": mods.alibi(torch.tensor([0.5, 0.25]))}),
    "document": (dict(B=1, Hq=2, Hkv=1, Nq=24, Nk=24, K=8, per_head=False),
                 M.document(torch.tensor([[0] * 10 + [1] * 14])), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gather_equals_the_reference(case):
    shape, extra, kw = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    B, Hq, Hkv, Nq, Nk, K = (shape[x] for x in ("B", "Hq", "Hkv", "Nq", "Nk", "K"))
    q = torch.randn(B, Hq, Nq, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, Nk, 16, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, Nk, 11, dtype=torch.float64, generator=g, requires_grad=True)
    idx = torch.randint(-1, Nk, (B, Hq if shape["per_head"] else 1, Nq, K), generator=g)
    idx[..., 1] = idx[..., 0]
    mask = M.topk(idx) if extra is None else M.topk(idx) & extra
    if kw.get("sinks"):
        kw = dict(kw, sinks=torch.randn(Hq, dtype=torch.float64, generator=g, requires_grad=True))
    ref = _grads("reference", q, k, v, mask, **kw)
    got = _grads("gather", q, k, v, mask, **kw)
    assert got[1].dtype == torch.float64, "float64 inputs keep a float64 lse"
    assert (got[0] - ref[0]).abs().max() < 1e-12
    finite = torch.isfinite(ref[1])
    assert torch.equal(finite, torch.isfinite(got[1]))
    assert (got[1][finite] - ref[1][finite].double()).abs().max() < 1e-6  # the reference's lse is float32
    for a, b in zip(got[2], ref[2]):
        assert (a - b).abs().max() < 1e-6


def test_chunks_and_checkpointing_do_not_change_the_result(monkeypatch):
    import qkv.backends.gather as gather

    q = torch.randn(1, 2, 50, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 64, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 64, 8, dtype=torch.float64, requires_grad=True)
    mask = M.topk(torch.randint(0, 64, (1, 1, 50, 6))) & M.causal()
    whole = qkv.attention(q, k, v, mask=mask, backend="gather")
    (gq,) = torch.autograd.grad(whole.sum(), [q])
    monkeypatch.setattr(gather, "_CHUNK_BYTES", 1)  # one query row per chunk
    rows = qkv.attention(q, k, v, mask=mask, backend="gather")
    (gq1,) = torch.autograd.grad(rows.sum(), [q])
    assert torch.allclose(whole, rows, atol=1e-14, rtol=0) and torch.allclose(gq, gq1, atol=1e-13, rtol=0)


def test_auto_picks_gather_for_short_lists_and_explain_says_why_others_decline():
    q = torch.randn(1, 8, 2048, 64)
    k = v = torch.randn(1, 1, 2048, 64)
    mask = M.topk(torch.randint(0, 2048, (1, 1, 2048, 32))) & M.causal()
    report = qkv.explain(q, k, v, mask=mask)
    assert "chosen: gather" in str(report), report
    plain = str(qkv.explain(q, k, v, mask=M.causal()))
    assert "gather" in plain and "lists no keys" in plain, plain
    with pytest.raises(ValueError, match="lists no keys"):
        qkv.attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], mask=M.causal(), backend="gather")
    with pytest.raises(ValueError, match="dropout"):
        qkv.attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], mask=M.topk(torch.zeros(1, 1, 8, 1, dtype=torch.long)),
                      backend="gather", dropout_p=0.1)


def test_an_or_with_the_lists_is_not_a_selection():
    mask = M.topk(torch.zeros(1, 1, 8, 1, dtype=torch.long)) | M.causal()
    q = k = v = torch.randn(1, 1, 8, 8)
    with pytest.raises(ValueError, match="lists no keys"):
        qkv.attention(q, k, v, mask=mask, backend="gather")
