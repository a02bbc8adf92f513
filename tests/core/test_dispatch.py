"""The operator's common path stays cheap: no dense mask where SDPA's own causal flag or no mask says the
same thing, a cached one for a chunk over a cache, and ``auto``'s per-shape decisions reused only while no
backend's costs changed. (The microseconds themselves are measured in ``benchmarks/dense.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv import backends
from qkv._attention import _decisions
from qkv.backends import sdpa as sdpa_mod
from qkv.backends.base import Backend, Estimate
from qkv.masks.causal import Causal


@pytest.fixture
def no_dense_causal(monkeypatch):
    def refuse(self, *a, **k):
        raise AssertionError("the causal mask was evaluated element by element")

    monkeypatch.setattr(Causal, "allowed", refuse)
    monkeypatch.setattr(Causal, "dense", refuse)


@pytest.mark.parametrize("nq,nk", [(1, 300), (16, 16), (5, 40), (40, 5)], ids=["decode", "square", "chunk", "Nq>Nk"])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_causal_on_sdpa_never_builds_the_mask_elementwise(nq, nk, align, no_dense_causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, nq, 16, generator=g), torch.randn(2, 2, nk, 16, generator=g), \
        torch.randn(2, 2, nk, 16, generator=g)
    out = qkv.attention(q, k, v, mask=qkv.masks.causal(align=align), backend="sdpa")
    i = torch.arange(nq).view(-1, 1)
    allowed = torch.arange(nk) <= i + (nk - nq if align == "bottom_right" else 0)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed, enable_gqa=True)
    rows = allowed.any(-1)  # rows with no key: zeros by the contract, whatever torch gives
    torch.testing.assert_close(out[:, :, rows], want[:, :, rows].float(), rtol=1e-5, atol=1e-5)
    assert (out[:, :, ~rows] == 0).all(), "a query row with no allowed key returns zeros"


def test_chunk_mask_is_cached_and_safe_under_inference_mode():
    sdpa_mod._BOTTOM_RIGHT.clear()
    with torch.inference_mode():
        m = sdpa_mod._bottom_right_causal(3, 7, torch.device("cpu"))
    assert not m.is_inference(), "a cached mask made in inference mode could not be saved for backward later"
    assert sdpa_mod._bottom_right_causal(3, 7, torch.device("cpu")) is m
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k = v = torch.randn(1, 2, 7, 8)
    qkv.attention(q, k, v, mask=qkv.masks.causal(), backend="sdpa").sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


class _Cheap(Backend):
    """Claims to be free for one shape, so ``auto`` must pick it once registered."""

    name = "cheap-test"

    def decline(self, req):
        return None if req.Nq == 1500 else "not this shape"

    def estimate(self, req):
        return Estimate(0.0, "free")

    def run(self, req):
        return backends.get("reference").run(req)


def test_auto_decisions_follow_registration_and_stay_bounded():
    """A problem past the small-problem shortcut: the first call estimates, later calls reuse the decision;
    registering a backend moves the generation, so the next call decides again."""
    q = torch.randn(1, 8, 1500, 16)
    k = v = torch.randn(1, 8, 1500, 16)
    before = qkv.explain(q, k, v, mask=qkv.masks.causal()).chosen
    with torch.no_grad():
        qkv.attention(q, k, v, mask=qkv.masks.causal())
    assert any(key[0] == backends.generation() for key in _decisions), "the decision was not kept"
    gen = backends.generation()
    backends.register(_Cheap())
    try:
        assert backends.generation() == gen + 1
        assert qkv.explain(q, k, v, mask=qkv.masks.causal()).chosen == "cheap-test"
        from qkv._attention import _choose
        from qkv._request import build_request

        assert _choose(build_request(q, k, v, mask=qkv.masks.causal()), "auto").name == "cheap-test"
    finally:
        from qkv.backends import _loaded

        _loaded.pop("cheap-test", None)
        backends.state_changed()
    assert qkv.explain(q, k, v, mask=qkv.masks.causal()).chosen == before


@pytest.mark.parametrize("bad, match", [
    (dict(scale=float("nan")), "scale must be finite"),
    (dict(scale="2"), "scale must be a float"),
    (dict(dropout_p=-0.1), r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p="0.1"), r"dropout_p must be in \[0, 1\)"),
    (dict(mask=torch.ones(4, 4, dtype=torch.bool)), "wrap a boolean tensor"),
], ids=["scale-nan", "scale-str", "dropout-negative", "dropout-str", "mask-tensor"])
def test_fast_path_still_names_bad_arguments(bad, match):
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        qkv.attention(x, x, x, **bad)


def test_fast_path_accepts_int_and_numpy_scale():
    import numpy as np

    x = torch.randn(1, 2, 4, 8)
    a = qkv.attention(x, x, x, scale=1)
    torch.testing.assert_close(qkv.attention(x, x, x, scale=np.float64(1.0)), a)
    torch.testing.assert_close(qkv.attention(x, x, x, scale=torch.tensor(1.0)), a)


def test_large_chunk_masks_are_not_kept():
    """A long chunked prefill asks for a new (Nq, Nk) each chunk: masks past 1 Mi elements are built, not cached."""
    sdpa_mod._BOTTOM_RIGHT.clear()
    q = torch.randn(1, 1, 600, 4)
    k = v = torch.randn(1, 1, 2000, 4)
    qkv.attention(q, k, v, mask=qkv.masks.causal(), backend="sdpa")
    assert len(sdpa_mod._BOTTOM_RIGHT) == 0
    qkv.attention(q[:, :, :3], k, v, mask=qkv.masks.causal(), backend="sdpa")
    assert len(sdpa_mod._BOTTOM_RIGHT) == 1


def test_chunk_mask_cache_holds_a_bounded_number():
    sdpa_mod._BOTTOM_RIGHT.clear()
    for nq in range(1, 3 * sdpa_mod._BOTTOM_RIGHT_HELD):
        sdpa_mod._bottom_right_causal(nq + 1, 64, torch.device("cpu"))
        assert len(sdpa_mod._BOTTOM_RIGHT) <= sdpa_mod._BOTTOM_RIGHT_HELD
    m = sdpa_mod._bottom_right_causal(5, 9, torch.device("cpu"))
    torch.testing.assert_close(m, torch.ones(5, 9, dtype=torch.bool).tril(4))


def test_auto_with_no_capable_backend_names_every_reason():
    """batch_invariant=True on meta tensors: no backend runs it. auto and explain raise a ValueError naming each
    backend's reason (it was a bare AssertionError)."""
    q = k = v = torch.empty(1, 2, 4, 8, device="meta")
    for call in (qkv.attention, qkv.explain):
        with pytest.raises(ValueError, match=r"no backend can run this request: .*reference: "):
            call(q, k, v, batch_invariant=True)
