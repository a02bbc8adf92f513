"""The ``paged`` backend: block-pool operands (``qkv.attention(q, k_pool, v_pool, paged=qkv.PagedKV(...))``) against
a float64 reference computed here by advanced indexing (independent of the backend's gather and kernels), on the
compiled kernels and on the torch ops (the ``kernel_path`` fixture); what ``qkv.explain`` says of each path; bad
operands refused with errors that name the argument."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv._paged import write_slots
from qkv.cache import FullSpec, KVCache, Paged
from qkv.testing import assert_within_budget

pytestmark = [pytest.mark.xdist_group("cpu_kernels")]


def _operands(seed, *, B=3, Hq=4, Hkv=2, D=16, Dv=8, T=4, N=1, lens=(9, 1, 14), dtype=torch.float32, window=None):
    """Pools of shuffled blocks; row b holds lens[b] tokens at positions 0.., its last N (fewer for short rows:
    padding queries at -1) are the queries; filler entries point at the last block."""
    g = torch.Generator().manual_seed(seed)
    nb = max(-(-n // T) for n in lens)
    P = B * nb + 2
    kp = torch.randn(P, Hkv, T, D, generator=g).to(dtype)
    vp = torch.randn(P, Hkv, T, Dv, generator=g).to(dtype)
    order = torch.randperm(P - 1, generator=g)
    tables = torch.full((B, nb), P - 1)
    kv_pos = torch.full((B, nb * T), -1)
    q_pos = torch.full((B, N), -1)
    used = 0
    for b, n in enumerate(lens):
        for j in range(-(-n // T)):
            tables[b, j] = order[used]
            used += 1
        kv_pos[b, :n] = torch.arange(n)
        m = min(N, n)
        q_pos[b, N - m:] = torch.arange(n - m, n)
    q = torch.randn(B, Hq, N, D, generator=g).to(dtype)
    return q, kp, vp, qkv.PagedKV(tables, kv_pos, q_pos, window)


def _reference(q, kp, vp, paged, *, scale=None, sinks=None, dtype=torch.float64):
    """Attention over each row's slots in table order, by advanced indexing, in ``dtype``."""
    tables, kv_pos, q_pos, window = paged
    B, Hq, N, D = q.shape
    Hkv = kp.shape[1]
    k = kp.to(dtype)[tables].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)  # (B, Hkv, NB * T, D)
    v = vp.to(dtype)[tables].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, vp.shape[-1])
    k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    s = (q.to(dtype) @ k.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    kp_, qp = kv_pos.view(B, 1, 1, -1), q_pos.view(B, 1, N, 1)
    ok = (kp_ >= 0) & (qp >= 0) & (kp_ <= qp)
    if window is not None:
        ok &= qp - kp_ < window
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(dtype).view(1, Hq, 1, 1).expand(B, Hq, N, 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse).unsqueeze(-1), (s - lse.unsqueeze(-1)).exp(), 0.0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("N", [1, 5], ids=["decode", "chunk"])
@pytest.mark.parametrize("window", [None, 3], ids=["full", "W3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_paged_attention_matches_the_float64_reference(N, window, dtype):
    q, kp, vp, paged = _operands(N * 7 + (window or 0), N=N, dtype=dtype, window=window)
    res = qkv.attention(q, kp, vp, paged=paged, return_lse=True)
    assert res.out.dtype == dtype and res.lse.shape == q.shape[:3]
    ref_out, ref_lse = _reference(q, kp, vp, paged)
    base_out, _ = _reference(q, kp, vp, paged, dtype=dtype)
    assert_within_budget(res.out, ref_out, base_out, what="out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(res.lse), finite), "rows without a visible key must give lse = -inf"
    torch.testing.assert_close(res.lse[finite].double(), ref_lse[finite], atol=1e-4, rtol=1e-4)
    padding = paged.q_positions < 0  # (B, N): a padding query's output is zeros
    assert res.out.permute(0, 2, 1, 3)[padding].eq(0).all()
    plain = qkv.attention(q, kp, vp, paged=paged)  # without the lse: the torch-op path may take torch's SDPA
    assert_within_budget(plain, ref_out, base_out, what="out without lse")
    assert plain.permute(0, 2, 1, 3)[padding].eq(0).all()


@pytest.mark.usefixtures("kernel_path")
def test_sinks_and_bfloat16_are_served():
    """Sinks are merged from the lse (the backend runs without them); bfloat16 takes the torch-op view path, which
    accumulates in float32."""
    q, kp, vp, paged = _operands(3, N=2)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = qkv.attention(q, kp, vp, paged=paged, sinks=sinks)
    ref, _ = _reference(q, kp, vp, paged, sinks=sinks)
    assert_within_budget(out, ref, _reference(q, kp, vp, paged, sinks=sinks, dtype=torch.float32)[0], what="sinks")
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, kp, vp))
    out = qkv.attention(qb, kb, vb, paged=paged)
    assert out.dtype == torch.bfloat16
    assert_within_budget(out, _reference(qb, kb, vb, paged)[0], _reference(qb, kb, vb, paged, dtype=torch.bfloat16)[0],
                         what="bfloat16")
    assert "float32/float64, got bfloat16" in qkv.explain(qb, kb, vb, paged=paged).note


def test_a_bfloat16_decode_step_runs_the_compiled_kernel(kernel_path):
    """One query per row over bfloat16 pools: the compiled paged-decode kernel (pools widened to float32 piece by
    piece, the output rounded once) within budget of the float64 reference, with sinks; the torch ops' view
    where the kernels are off."""
    q, kp, vp, paged = _operands(11, N=1, lens=(9, 1, 14, 0), B=4)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, kp, vp))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]).to(torch.bfloat16)
    note = qkv.explain(qb, kb, vb, paged=paged).note
    if kernel_path == "compiled":
        assert note.startswith("compiled paged-decode kernel") and "bfloat16" in note, note
    else:
        assert "torch ops over the gathered view" in note, note
    for z in (None, sinks):
        out = qkv.attention(qb, kb, vb, paged=paged, sinks=z)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert_within_budget(out, _reference(qb, kb, vb, paged, sinks=z)[0],
                             _reference(qb, kb, vb, paged, sinks=z, dtype=torch.bfloat16)[0], what="bfloat16 decode")
        assert out[3].eq(0).all()  # a padding query (an empty row) attends to nothing


def test_gradients_flow_through_the_torch_op_path():
    q, kp, vp, paged = _operands(5, N=3, dtype=torch.float64)
    q.requires_grad_(True)
    kp.requires_grad_(True)
    report = qkv.explain(q, kp, vp, paged=paged)
    assert report.chosen == "paged" and "gradients are asked for" in report.note, report.note
    qkv.attention(q, kp, vp, paged=paged).sum().backward()
    q2, kp2 = q.detach().clone().requires_grad_(True), kp.detach().clone().requires_grad_(True)
    _reference(q2, kp2, vp, paged)[0].sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)
    torch.testing.assert_close(kp.grad, kp2.grad)


def test_explain_names_the_compiled_paged_backend_on_a_cpu_decode_step(kernel_path):
    """A decode step over a paged cache on CPU: qkv.explain names the paged backend and its path: the compiled
    kernel (through qkv.cpu.ops) where it is built, else the torch ops with the reason; every other backend is
    declined for reading (B, Hkv, Nk, D) tensors, not block pools."""
    cache = KVCache([FullSpec(2, 16)], storage=Paged(block_size=4, num_blocks=16))
    k = torch.randn(2, 2, 6, 16)
    cache.update(0, k, k, positions=torch.arange(6).expand(2, 6))
    cache.update(0, k[:, :, :1], k[:, :, :1], positions=torch.full((2, 1), 6), defer_view=True)
    store, step = cache._layers[0].store, cache._manager.step
    q = torch.randn(2, 4, 1, 16)
    paged = qkv.PagedKV(step.tables[0], step.view_pos[0], torch.full((2, 1), 6))
    report = qkv.explain(q, store.kp, store.vp, paged=paged)
    assert report.chosen == "paged"
    if kernel_path == "compiled":
        assert report.note.startswith("compiled paged-decode kernel (qkv.cpu.ops.paged_decode)"), report.note
    else:
        assert report.note == ("torch ops over the gathered view, because qkv's compiled CPU kernels are unavailable "
                               "(QKV_CPU_KERNELS=0 in the environment)"), report.note
    assert set(report.estimates) == {"paged"}
    assert all("not block pools" in why for why in report.declined.values()) and "sdpa" in report.declined
    assert "paged" in str(report)
    torch.testing.assert_close(cache.decode(0, q, scale=0.25), qkv.attention(q, store.kp, store.vp, paged=paged,
                                                                              scale=0.25))


def test_named_backends_refuse_the_other_kind_of_operands():
    q, kp, vp, paged = _operands(1)
    with pytest.raises(ValueError, match="backend 'sdpa' cannot run this request: .*not block pools"):
        qkv.attention(q, kp, vp, paged=paged, backend="sdpa")
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="backend 'paged' cannot run this request: .*block pools .* only"):
        qkv.attention(x, x, x, backend="paged")
    assert qkv.explain(x, x, x).declined["paged"].startswith("it reads block pools")


def _bad(**change):
    q, kp, vp, paged = _operands(2, N=2)
    args = {"q": q, "k": kp, "v": vp, **{k: v for k, v in change.items() if k in ("q", "k", "v")}}
    paged = paged._replace(**{k: v for k, v in change.items() if k in paged._fields})
    return args, {"paged": change.get("paged", paged), **{k: v for k, v in change.items()
                                                          if k in ("mask", "score_mod", "dropout_p", "scale")}}


@pytest.mark.parametrize("change, error, match", [
    ({"block_tables": "neg"}, ValueError, r"block_tables hold block ids -1 \.\. .* every entry must lie in \[0, "),
    ({"block_tables": "big"}, ValueError, r"block_tables hold block ids .* but the pools have \d+ blocks"),
    ({"block_tables": "float"}, TypeError, "block_tables must hold int64"),
    ({"block_tables": "rows"}, ValueError, r"block_tables must be \(3, "),
    ({"kv_positions": "short"}, ValueError, r"kv_positions must be \(3, \d+\)"),
    ({"q_positions": "wide"}, ValueError, r"q_positions must be \(3, 2\)"),
    ({"window": 0}, ValueError, "window must be an int >= 1"),
    ({"k": "3d"}, ValueError, r"k_pool must be a \(P, Hkv, T, Dqk\) tensor"),
    ({"v": "half"}, TypeError, "q, k_pool, v_pool must share a dtype"),
    ({"v": "heads"}, ValueError, "disagree"),
    ({"mask": "causal"}, ValueError, "mask=.* is not taken with paged= operands"),
    ({"dropout_p": 0.1}, ValueError, "dropout_p=0.1 is not taken with paged= operands"),
    ({"paged": "tuple"}, TypeError, "paged must be a qkv.PagedKV"),
], ids=["negative-block-id", "block-id-past-the-pool", "float-tables", "tables-rows", "kv-positions-short",
        "q-positions-wide", "window-0", "k-pool-3d", "v-pool-half", "v-pool-heads", "mask", "dropout", "paged-tuple"])
def test_bad_operands_are_refused_naming_the_argument(change, error, match):
    q, kp, vp, paged = _operands(2, N=2)
    tables, kv_pos, q_pos, _ = paged
    concrete = {
        "neg": tables.clone().index_fill_(1, torch.tensor([0]), -1), "big": tables + kp.shape[0],
        "float": tables.float(), "rows": tables[:2], "short": kv_pos[:, :-1], "wide": torch.zeros(3, 3, dtype=int),
        "3d": kp[0], "half": vp.half(), "heads": vp[:, :1], "causal": qkv.masks.causal(), "tuple": tuple(paged),
    }
    change = {k: concrete.get(v, v) if isinstance(v, str) else v for k, v in change.items()}
    args, kw = _bad(**change)
    with pytest.raises(error, match=match):
        qkv.attention(args["q"], args["k"], args["v"], **kw)
    with pytest.raises(error, match=match):
        qkv.explain(args["q"], args["k"], args["v"], **kw)


@pytest.mark.usefixtures("kernel_path")
def test_the_store_writes_each_real_token_to_its_slot():
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 4, 5, generator=g)
    real = torch.tensor([[False, True, True, True], [False, False, True, True]])
    blocks, offsets = torch.tensor([3, 3, 0, 1, 1]), torch.tensor([0, 1, 1, 0, 1])
    src = real.reshape(-1).nonzero().view(-1)
    for s in (src, None):  # the compiled write (CPU, src given) and the indexed assignment
        kp, vp = torch.full((4, 3, 2, 8), float("nan")), torch.full((4, 3, 2, 5), float("nan"))
        write_slots(kp, vp, k, v, blocks=blocks, offsets=offsets, real=real, src=s)
        for i, (b, t) in enumerate(real.nonzero().tolist()):
            assert torch.equal(kp[blocks[i], :, offsets[i]], k[b, :, t]) and torch.equal(vp[blocks[i], :, offsets[i]],
                                                                                         v[b, :, t])
        assert int(kp.isnan().sum()) == (4 * 2 - 5) * 3 * 8  # nothing else was written


def test_block_tables_made_under_inference_mode_are_checked_every_call():
    """Inference tensors keep no version counter (the Engine and benchmarks run under torch.inference_mode): the
    table check still runs, and an id changed in place between two calls is refused on the second."""
    with torch.inference_mode():
        kp, vp = torch.randn(4, 2, 4, 8), torch.randn(4, 2, 4, 8)  # (P, Hkv, T, D)
        tables = torch.tensor([[0, 1]])
        paged = qkv.PagedKV(tables, torch.tensor([[0, 1, 2, 3, 4, 5, -1, -1]]), torch.tensor([[5]]), None)
        q = torch.randn(1, 2, 1, 8)
        qkv.attention(q, kp, vp, paged=paged)
        tables[0, 1] = 9
        with pytest.raises(ValueError, match="block_tables"):
            qkv.attention(q, kp, vp, paged=paged)
