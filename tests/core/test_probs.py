"""``qkv.attention_probs``: exact probabilities for chosen heads and rows, never an N^2 detour."""

from __future__ import annotations

import pytest
import torch

import qkv
from _helpers_tiled import inputs, sid
from qkv import masks as M
from qkv import mods
from qkv.masks.causal import SlidingWindow
from qkv.testing import assert_within_budget


def softmax_probs(q, k, v, *, mask=None, score_mod=None):
    """Probabilities by the definition, in the inputs' dtype; rows with no allowed key are zeros."""
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    k = k.repeat_interleave(Hq // k.shape[1], 1)
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    b, h = torch.arange(B).view(-1, 1, 1, 1), torch.arange(Hq).view(1, -1, 1, 1)
    qi, kj = torch.arange(Nq).view(1, 1, -1, 1), torch.arange(Nk).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod.apply(s, b, h, qi, kj, Nq, Nk).to(q.dtype)
    if mask is not None:
        s = s.masked_fill(~mask.allowed(b, h, qi, kj, Nq, Nk), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0)


CASES = {
    "causal": dict(mask=M.causal()),
    "window+alibi": dict(mask=M.sliding_window(9), score_mod=mods.alibi(torch.tensor([0.1, 0.2, 0.3, 0.4]))),
    "softcap": dict(score_mod=mods.softcap(2.0)),
    "document": dict(mask=M.document(torch.tensor([0] * 20 + [1] * 30 + [2] * 17))),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("heads,rows", [(None, None), ([3, 0], [0, 66, 17]), (2, torch.arange(10, 40))],
                         ids=["all", "few", "range"])
def test_matches_reference_softmax(name, heads, rows):
    kw = CASES[name]
    (q64, k64, v64), (q, k, v), _ = inputs(2, 4, 2, 67, 67, 16)
    p = qkv.attention_probs(q, k, v, heads=heads, rows=rows, **kw)
    h = torch.arange(4) if heads is None else torch.as_tensor([heads] if isinstance(heads, int) else heads)
    r = torch.arange(67) if rows is None else torch.as_tensor(rows)
    ref = softmax_probs(q64, k64, v64, **kw)[:, h][:, :, r]
    base = softmax_probs(q, k, v, **kw)[:, h][:, :, r]
    assert p.dtype == torch.float32 and p.shape == (2, len(h), len(r), 67), (p.dtype, p.shape)
    assert_within_budget(p, ref, base, what=f"{name} {sid(2, 4, 2, 67, 67, 16)}")


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_any_backend_that_returns_lse(backend):
    _, (q, k, v), _ = inputs(1, 2, 2, 30, 50, 8)
    p = qkv.attention_probs(q, k, v, mask=M.causal(), backend=backend, rows=[0, 29])
    ref = softmax_probs(q.double(), k.double(), v.double(), mask=M.causal())[:, :, [0, 29]]
    assert torch.allclose(p.double(), ref, atol=1e-6)
    with pytest.raises(ValueError, match="return_lse"):
        qkv.attention_probs(q, k, v, backend="sdpa")


def test_rows_sum_to_one_and_empty_rows_are_zero():
    _, (q, k, v), _ = inputs(2, 2, 2, 20, 10, 8)
    p = qkv.attention_probs(q, k, v, mask=M.causal() & M.padding([0, 10]))  # batch 0 and rows 0..9 empty
    assert torch.isfinite(p).all()
    assert (p[0] == 0).all() and (p[1, :, :10] == 0).all()
    assert torch.allclose(p[1, :, 10:].sum(-1), torch.ones(2, 10))


def test_float64_inputs_and_dv():
    (q, k, v), _, _ = inputs(1, 2, 1, 12, 12, 8, 5, dtype=torch.float64)
    p = qkv.attention_probs(q, k, v, mask=M.causal())
    assert p.dtype == torch.float32
    assert torch.allclose(p.double(), softmax_probs(q, k, v, mask=M.causal()), atol=1e-7)


@pytest.mark.parametrize("kw,err", [
    (dict(heads=[4]), ValueError), (dict(heads=[-1]), ValueError), (dict(rows=[12]), ValueError),
    (dict(rows=torch.tensor([0.5])), TypeError), (dict(rows=torch.zeros(2, 2, dtype=torch.long)), TypeError),
    (dict(heads=True), TypeError), (dict(heads="0"), TypeError), (dict(rows=[0, 1.0]), TypeError),
])
def test_validates_heads_and_rows(kw, err):
    _, (q, k, v), _ = inputs(1, 4, 2, 12, 12, 8)
    with pytest.raises(err, match="heads|rows"):
        qkv.attention_probs(q, k, v, **kw)


def test_few_rows_never_materialize_n_squared():
    """Two rows at N = 4096: no predicate evaluation (nor score chunk) anywhere near N x N elements."""

    class Recording(SlidingWindow):
        largest = 0

        def allowed(self, b, h, q_idx, kv_idx, nq, nk):
            out = super().allowed(b, h, q_idx, kv_idx, nq, nk)
            Recording.largest = max(Recording.largest, out.numel())
            return out

    n = 4096
    _, (q, k, v), _ = inputs(1, 2, 2, n, n, 16)
    mask = Recording(n, 0)  # causal, with an analytic block map
    p = qkv.attention_probs(q, k, v, mask=mask, heads=[1], rows=[5, n - 1], backend="tiled")
    assert Recording.largest < n * n // 8, Recording.largest
    ref = softmax_probs(q[:, 1:2, [5, n - 1]].double(), k[:, 1:2].double(), v[:, 1:2].double())
    assert torch.allclose(p[0, 0, 1].double(), ref[0, 0, 1], atol=1e-6)  # the last row sees every key
    assert (p[0, 0, 0, 6:] == 0).all() and torch.allclose(p.sum(-1), torch.ones(1, 1, 2))
