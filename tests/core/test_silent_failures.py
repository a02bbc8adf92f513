"""Silent wrong results that once slipped through: aliasing, negative query positions, NaN propagation, device
checks, stale plans, -inf biases and overflow, repeated cache positions; and masks whose block maps cover every
head and batch row they read. Every test here failed before its fix."""

from __future__ import annotations

import pytest
import torch

import qkv
from _helpers import mask_catalogue
from qkv import masks as M
from qkv import mods
from qkv.cache import KIVI, Dynamic, FullSpec, KVCache, Paged, SlidingWindowSpec, Static
from qkv.masks import EMPTY, FULL

BACKENDS = ["reference", "sdpa", "tiled"]


def _run(q, k, v, backend, **kw):
    return qkv.attention(q, k, v, backend=backend, **kw)


def _nan_equal(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.allclose(a.nan_to_num(), b.nan_to_num(), atol=1e-5)


def test_kivi_first_write_does_not_alias_the_callers_buffers():
    c = KVCache([FullSpec(2, 8)], quant=KIVI(bits=4, group_size=4, residual=64))
    k = torch.randn(1, 2, 8, 8)
    pos = torch.arange(8).view(1, 8)
    keep_k, keep_pos = k.clone(), pos.clone()
    c.update(0, k, k, positions=pos)
    k.zero_()  # a decode loop (or CUDA graph) reusing its input buffers in place
    pos += 100
    view = c.update(0, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), positions=torch.tensor([[8]]))
    assert torch.equal(view.k[:, :, :8], keep_k), "cached keys changed with the caller's buffer"
    assert torch.equal(view.kv_positions[:, :8], keep_pos), view.kv_positions


@pytest.mark.parametrize("kind", [k for k in mask_catalogue(2, 5, 9) if k not in ("none", "document", "positions")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_mask_with_more_queries_than_keys_agrees_across_backends(kind, backend):
    """Nq > Nk: rows at negative positions see nothing that needs a non-negative position, on every backend,
    and the tiled block map (which skips tiles) agrees with the predicate."""
    Nq, Nk = 13, 7
    m = mask_catalogue(2, Nq, Nk, seed=3)[kind]
    if kind == "dense":
        m = M.dense(torch.rand(2, 1, Nq, Nk, generator=torch.Generator().manual_seed(0)) < 0.5)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for n in (Nq, Nk, Nk))
    ref = _run(q, k, v, "reference", mask=m)
    out = _run(q, k, v, backend, mask=m)
    assert torch.allclose(out, ref, atol=1e-9), f"{kind}: max diff {float((out - ref).abs().max())}"
    d = m.materialize(2, 2, Nq, Nk).any(1)  # (B, Nq, Nk): a tile the predicate allows must not be EMPTY
    bm = m.block_map(Nq, Nk, 2, 2, B=2, H=2)[:, 0].expand(2, -1, -1)
    pad = torch.zeros(2, 14, 8, dtype=torch.bool)
    pad[:, :Nq, :Nk] = d
    any_tile = pad.view(2, 7, 2, 4, 2).any(4).any(2)
    assert not ((bm == EMPTY) & any_tile).any(), f"{kind}: the block map skips a tile the predicate allows"


@pytest.mark.parametrize("name", ["graph", "bigbird", "global_tokens"])
def test_negative_query_positions_see_nothing_position_indexed(name):
    mask = {"graph": M.graph(torch.ones(4, 4, dtype=torch.bool)), "bigbird": M.bigbird(2, 3, 1, 1),
            "global_tokens": M.global_tokens([0])}[name]
    d = mask.materialize(1, 1, 7, 4)[0, 0]
    if name == "global_tokens":  # key 0 is global: every query still sees it, and only it
        assert d[:3].sum(1).tolist() == [1, 1, 1], d
    else:
        assert not d[:3].any(), d
    bm = mask.block_map(7, 4, 1, 1)[0, 0]
    assert torch.equal(bm == FULL, d) and torch.equal(bm == EMPTY, ~d), "block map disagrees with the predicate"


def test_document_without_query_ids_refuses_more_queries_than_keys():
    with pytest.raises(ValueError, match="q_ids"):
        qkv.attention(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4),
                      mask=M.document(torch.tensor([0, 0, 1, 1])))


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_inputs_propagate_on_every_backend(backend, where):
    for nk in range(1, 41):
        g = torch.Generator().manual_seed(nk)
        q, k, v = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, nk, 8, generator=g), \
            torch.randn(1, 2, nk, 8, generator=g)
        t = {"q": q, "k": k, "v": v}[where]
        t[0, 0, min(1, t.shape[2] - 1), 2] = float("nan")
        ref = _run(q, k, v, "reference")
        out = _run(q, k, v, backend)
        assert _nan_equal(out, ref), f"Nk={nk}: NaN rows {out.isnan().any(-1).tolist()} vs {ref.isnan().any(-1)}"


def test_nan_check_runs_only_where_the_cpu_kernel_drops_nan():
    """The SDPA fix-up's common case is one sum; it never touches calls with 16 keys or more."""
    from qkv.backends import sdpa as sdpa_mod

    calls = []
    real = sdpa_mod.restore_nonfinite
    sdpa_mod.restore_nonfinite = lambda req, out, lse=None, **kw: (calls.append(req.Nk), real(req, out, lse, **kw))[1]
    try:
        for nk in (4, 16, 64):
            x = torch.randn(1, 1, 2, 8)
            qkv.attention(x, torch.randn(1, 1, nk, 8), torch.randn(1, 1, nk, 8), backend="sdpa")
    finally:
        sdpa_mod.restore_nonfinite = real
    assert calls == [4], calls


def test_masked_nan_keys_do_not_poison_rows_that_cannot_see_them():
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    k[0, 0, 3] = float("nan")  # only the last query row may see key 3 under causal
    for backend in BACKENDS:
        out = _run(q, k, v, backend, mask=M.causal())
        assert out[0, 0, :3].isfinite().all() and out[0, 0, 3].isnan().all(), (backend, out)


@pytest.mark.parametrize("what", ["bias", "alibi", "relative_bias", "padding", "dense"])
def test_mask_and_modifier_tensors_on_another_device_are_refused(what):
    q = torch.randn(1, 2, 4, 8)
    meta = {"device": "meta"}
    if what == "padding":
        with pytest.raises(ValueError, match="kv_lengths.*meta"):
            M.padding(torch.tensor([3], **meta))
        return
    kw = {
        "bias": lambda: {"score_mod": mods.bias(torch.zeros(4, 4, **meta))},
        "alibi": lambda: {"score_mod": mods.alibi(torch.ones(2, **meta))},
        "relative_bias": lambda: {"score_mod": mods.relative_bias(torch.zeros(8, 2, **meta),
                                                                  torch.zeros(4, 4, dtype=torch.long))},
        "dense": lambda: {"mask": M.dense(torch.ones(4, 4, dtype=torch.bool, **meta))},
    }[what]()
    arg = next(iter(kw))
    for backend in ("auto", *BACKENDS):
        with pytest.raises(ValueError, match=f"{arg}.*meta.*cpu"):
            qkv.attention(q, q, q, backend=backend, **kw)


def test_masks_copy_their_tensors_so_an_in_place_edit_changes_nothing():
    lens = torch.tensor([5, 9])
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2]])
    dense = torch.ones(9, 9, dtype=torch.bool).tril()
    masks = [M.padding(lens), M.document(ids), M.dense(dense), M.prefix_lm(lens)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    before = [[_run(q, k, v, be, mask=m) for be in ("reference", "tiled")] for m in masks]
    lens.fill_(1)
    ids.fill_(7)
    dense.fill_(False)
    for m, (ref0, tiled0) in zip(masks, before, strict=True):
        assert torch.equal(_run(q, k, v, "reference", mask=m), ref0), repr(m)
        assert torch.equal(_run(q, k, v, "tiled", mask=m), tiled0), repr(m)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_additive_bias_row_of_minus_inf_reads_as_a_fully_masked_row(backend):
    b = torch.zeros(1, 1, 3, 5)
    b[0, 0, 1] = float("-inf")
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out = _run(q, k, v, backend, score_mod=mods.bias(b))
    assert torch.equal(out[0, :, 1], torch.zeros(2, 8)), out[0, :, 1]
    assert out.isfinite().all()


def test_scores_overflowing_only_where_masked_do_not_become_nan_on_tiled():
    q = torch.full((1, 1, 4, 64), 1e19)
    k = torch.randn(1, 1, 4, 64)
    k[0, 0, 3] = 1e19  # q.k overflows float32 at key 3 only; causal hides it from rows 0-2
    v = torch.randn(1, 1, 4, 64)
    ref = _run(q, k, v, "reference", mask=M.causal())
    out = _run(q, k, v, "tiled", mask=M.causal())
    assert _nan_equal(out, ref), (out[0, 0, :, 0], ref[0, 0, :, 0])
    assert out[0, 0, :3].isfinite().all()


@pytest.mark.parametrize("storage", ["dynamic", "static", "paged", "kivi", "window"])
def test_cache_positions_that_repeat_or_go_back_are_refused(storage):
    spec = SlidingWindowSpec(8, 2, 8) if storage == "window" else FullSpec(2, 8)
    kw = {"static": {"storage": Static(32)}, "paged": {"storage": Paged(4, 16)},
          "kivi": {"quant": KIVI(bits=4, group_size=4, residual=8)}}.get(storage, {"storage": Dynamic()})
    c = KVCache([spec, spec], **kw)

    def step(pos):
        ids = torch.zeros(1, len(pos), dtype=torch.long)
        p = torch.tensor([pos])
        c.prepare(ids, p)
        for layer in (0, 1):
            c.update(layer, torch.randn(1, 2, len(pos), 8), torch.randn(1, 2, len(pos), 8), positions=p)

    step([0, 1, 2, 3])
    for bad in ([3], [1], [4, 4], [6, 5]):
        held = c.seq_length
        with pytest.raises(ValueError, match="positions must increase"):
            c.update(0, torch.randn(1, 2, len(bad), 8), torch.randn(1, 2, len(bad), 8), positions=torch.tensor([bad]))
        assert c.seq_length == held
    step([4])
    c.crop(-1) if storage != "window" else None  # the documented way back
    if storage != "window":
        step([4])


def test_padding_positions_are_not_ordered():
    c = KVCache([FullSpec(2, 8)])
    c.update(0, torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), positions=torch.tensor([[-1, -1, 0], [0, 1, 2]]))
    view = c.update(0, torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), positions=torch.tensor([[1], [-1]]))
    assert view.kv_positions.tolist() == [[-1, -1, 0, 1], [0, 1, 2, -1]]  # repeated -1s are padding, not a repeat
    with pytest.raises(ValueError, match="positions must increase"):  # while a real repeat is refused
        c.update(0, torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), positions=torch.tensor([[2], [2]]))


def test_block_map_of_a_composite_with_a_head_dependent_part_covers_every_head():
    m = M.causal() | M.from_fn(lambda b, h, q, k: (h == 1) & (k >= 0))
    bm = m.block_map(16, 16, 4, 4, B=1, H=2)[0, 0]
    d = m.materialize(1, 2, 16, 16)
    any_tile = d.any(1)[0].view(4, 4, 4, 4).any(3).any(1)
    assert not ((bm == EMPTY) & any_tile).any(), "a tile head 1 reads is skipped"
    for backend in ("tiled",):
        q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
        assert torch.allclose(_run(q, k, v, backend, mask=m), _run(q, k, v, "reference", mask=m))


def test_a_new_mask_subclass_gets_a_block_map_over_its_heads_without_overriding_it():
    class ByHead(M.Mask):
        depends_on_head = True

        def allowed(self, b, h, q_idx, kv_idx, nq, nk):
            return kv_idx <= q_idx + h * 8

    m = ByHead()
    assert m.reads(3, 4) == (1, 4)
    bm = m.block_map(16, 16, 8, 8, H=2)[0, 0]
    assert bm[0, 1].item() != EMPTY, "head 1 sees the upper-right tile"
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    assert torch.allclose(_run(q, k, v, "tiled", mask=m), _run(q, k, v, "reference", mask=m))


@pytest.mark.parametrize("kind", [k for k in mask_catalogue(2, 8, 8) if k != "none"])
def test_check_changes_nothing(kind):
    m = mask_catalogue(2, 8, 8)[kind]
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(m).items()}
    m.check(2, 3, 8, 8)
    after = vars(m)
    assert before.keys() == after.keys()
    for key, val in before.items():
        same = torch.equal(val, after[key]) if isinstance(val, torch.Tensor) else val is after[key] or val == after[key]
        assert same, f"check() changed {key}"


def test_explain_prints_sensible_units():
    x = torch.randn(1, 2, 8, 16)
    text = str(qkv.explain(x, x, x, return_lse=True, mask=M.causal()))
    assert "e+" not in text and "e-" not in text and "0.000" not in text, text
    from qkv.backends.base import format_seconds, format_size, format_work

    assert format_seconds(40.0) == "40 s" and format_seconds(3.07e-4) == "307 us" and format_seconds(7200) == "2 h"
    assert format_work(3.07e5) == "307 kFLOP" and format_size(512) == "512 B" and format_size(4.19e6) == "4.19 MB"
