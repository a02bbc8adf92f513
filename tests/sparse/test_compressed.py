"""qkv.sparse.compressed_attention equals its dense float64 definition (compressed_attention_reference) forward and
backward (out, lse, every input's gradient, the lse's gradient too), holds error budgets in float32 and bfloat16,
and the definition itself equals HF transformers' DeepSeek-V4 eager attention (sliding mask + compressor block
bias + sinks). Bad inputs are refused."""

from __future__ import annotations

import pytest
import torch

from qkv.sparse import compressed_attention, compressed_attention_reference

# B, Hq, Hkv, Nq, Nk, T, D, Dv, rate, window, Hs (None: every entry), K, sinks, K=V, q_start, k_start
CASES = [
    (1, 4, 1, 37, 37, 9, 8, 8, 4, 5, 1, 4, True, True, None, 0),  # V4 CSA: one KV head, K = V, shared list
    (2, 4, 2, 37, 37, 9, 8, 6, 4, 5, 2, 4, False, False, None, 0),  # one list per KV head
    (2, 4, 2, 37, 37, 9, 8, 6, 4, 5, 4, 6, True, False, None, 0),  # one list per query head
    (2, 4, 2, 37, 37, 9, 8, 6, 4, 5, 1, 6, True, False, None, 0),  # one list for all heads, GQA
    (2, 4, 2, 37, 37, 9, 8, 6, 4, 5, None, 0, True, False, None, 0),  # HCA: every complete entry
    (1, 2, 2, 5, 20, 9, 8, 6, 4, 3, 2, 6, False, False, None, 0),  # the last 5 queries of 20 (bottom-right)
    (1, 2, 1, 30, 50, 12, 8, 6, 4, 3, 1, 6, False, False, 40, 20),  # window keys from position 20
    (1, 3, 1, 300, 300, 75, 8, 8, 4, 7, 1, 6, True, True, None, 0),  # several chunks
    (1, 2, 1, 300, 300, 2, 8, 8, 128, 128, None, 0, True, True, None, 0),  # HCA at rate 128
    (1, 2, 1, 9, 9, 4, 8, 8, 2, 0, 1, 3, False, True, None, 0),  # no window branch: early rows empty
    (1, 1, 1, 1, 64, 16, 8, 8, 4, 16, 1, 8, True, True, None, 0),  # a decode step
]


def _id(c):
    B, Hq, Hkv, Nq, Nk, T, D, Dv, rate, window, Hs, K, sinks, same, q0, k0 = c
    sel = "all" if Hs is None else f"Hs{Hs}-K{K}"
    return (f"B{B}-Hq{Hq}-Hkv{Hkv}-Nq{Nq}-Nk{Nk}-T{T}-D{D}-Dv{Dv}-r{rate}-w{window}-{sel}"
            f"{'-sinks' if sinks else ''}{'-KeqV' if same else ''}{f'-q{q0}-k{k0}' if q0 is not None else ''}")


def _inputs(case, dtype=torch.float64, seed=0):
    B, Hq, Hkv, Nq, Nk, T, D, Dv, rate, window, Hs, K, sinks, same, q0, k0 = case
    g = torch.Generator().manual_seed(seed + Nq * 7 + Nk)
    q = torch.randn(B, Hq, Nq, D, dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, Nk, D, dtype=dtype, generator=g)
    v = k if same else torch.randn(B, Hkv, Nk, Dv, dtype=dtype, generator=g)
    kc = torch.randn(B, Hkv, T, D, dtype=dtype, generator=g)
    vc = kc if same else torch.randn(B, Hkv, T, Dv, dtype=dtype, generator=g)
    sel = None if Hs is None else torch.randint(-1, T, (B, Hs, Nq, K), generator=g)
    if sel is not None and K > 1:
        sel[..., 1] = sel[..., 0]  # a repeat counts once
    z = torch.randn(Hq, dtype=dtype, generator=g) if sinks else None
    kw = dict(rate=rate, window=window, selected=sel, q_start=q0, k_start=k0)
    return (q, k, v, kc, vc, z), kw, same


def _leaves(tensors, same):
    q, k, v, kc, vc, z = (None if t is None else t.detach().clone().requires_grad_() for t in tensors)
    if same:
        v, vc = k, kc
    return (q, k, v, kc, vc, z)


def _run(fn, leaves, kw, g):
    q, k, v, kc, vc, z = leaves
    out, lse = fn(q, k, v, kc, vc, sinks=z, return_lse=True, **kw)
    cot = torch.randn(out.shape, dtype=torch.float64, generator=g).to(out.dtype)
    cot_lse = torch.randn(lse.shape, dtype=torch.float64, generator=g).to(lse.dtype)
    loss = (out * cot).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * cot_lse).sum()
    uniq = list({id(t): t for t in leaves if t is not None}.values())
    return out, lse, torch.autograd.grad(loss, uniq)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_equals_the_dense_definition_forward_and_backward(case):
    tensors, kw, same = _inputs(case)
    out, lse, grads = _run(compressed_attention, _leaves(tensors, same), kw, torch.Generator().manual_seed(1))
    ref, ref_lse, ref_grads = _run(compressed_attention_reference, _leaves(tensors, same), kw,
                                   torch.Generator().manual_seed(1))
    assert out.dtype == torch.float64 and lse.dtype == torch.float64 and out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-12
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "empty rows differ"
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-12
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert (a - b).abs().max().item() < 1e-11, f"gradient {i} off by {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype, k", [(torch.float32, 10), (torch.bfloat16, 2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=[_id(c) for c in (CASES[0], CASES[2], CASES[4])])
def test_error_budget_in_low_precision(case, dtype, k):
    """Error against the float64 definition at most k times a same-dtype eager computation's (the definition's
    dense math run in ``dtype``) plus a floor; the same for every gradient."""
    tensors, kw, same = _inputs(case)
    ref, _, ref_grads = _run(compressed_attention_reference, _leaves(tensors, same), kw,
                             torch.Generator().manual_seed(2))
    low = [None if t is None else t.to(dtype) for t in tensors]
    out, _, grads = _run(compressed_attention, _leaves(low, same), kw, torch.Generator().manual_seed(2))
    eager, _, eager_grads = _run(_eager_in_dtype, _leaves(low, same), kw, torch.Generator().manual_seed(2))
    floor = 1e-6 if dtype == torch.float32 else 1e-3
    assert out.dtype == dtype
    e_out, e_eager = (out.double() - ref).abs().max().item(), (eager.double() - ref).abs().max().item()
    assert e_out <= k * e_eager + floor, f"out error {e_out:.3g} vs eager {e_eager:.3g}"
    for i, (a, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        ea, ee = (a.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
        assert ea <= k * ee + floor * 10, f"gradient {i}: error {ea:.3g} vs eager {ee:.3g}"


def _eager_in_dtype(q, k, v, kc, vc, *, sinks, rate, window, selected, q_start, k_start, return_lse):
    """Dense masked attention in the inputs' dtype, under the mask :func:`_allowed` builds."""
    B, Hq, Nq, _ = q.shape
    G = Hq // k.shape[1]
    keys = torch.cat([k, kc], 2).repeat_interleave(G, 1)
    vals = torch.cat([v, vc], 2).repeat_interleave(G, 1)
    allowed = _allowed(B, Hq, Nq, k.shape[2], kc.shape[2], rate, window, selected, q_start, k_start)
    s = (q @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)], -1)
    lse = torch.logsumexp(s.float(), -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)[..., :keys.shape[2]]
    return p @ vals, lse


def _allowed(B, Hq, Nq, Nk, T, rate, window, selected, q_start, k_start):
    """The mask of the definition, built independently from HF's rules (sliding_window_overlay: kv > q - window;
    compressor: entry w hidden while w >= (q + 1) // rate; the indexer's list scattered)."""
    q_start = k_start + Nk - Nq if q_start is None else q_start
    p = (q_start + torch.arange(Nq)).view(Nq, 1)
    kp = (k_start + torch.arange(Nk)).view(1, Nk)
    win = (kp > p - window) & (kp <= p)
    cmp = ~(torch.arange(T).view(1, T) >= (p + 1) // rate)
    cmp = cmp.expand(B, Hq, Nq, T).clone()
    if selected is not None:
        hit = torch.zeros(B, selected.shape[1], Nq, T + 1, dtype=torch.bool)
        hit.scatter_(-1, selected.masked_fill(selected < 0, T), True)
        cmp &= hit[..., :T].repeat_interleave(Hq // selected.shape[1], 1)
    return torch.cat([win.expand(B, Hq, Nq, Nk), cmp], -1)


def test_empty_rows_give_zeros_and_minus_inf_or_the_sink():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(1, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    cmp = torch.randn(1, 1, 2, 8, dtype=torch.float64, requires_grad=True)
    out, lse = compressed_attention(q, kv, kv, cmp, cmp, rate=2, window=0, return_lse=True)
    assert torch.equal(out[:, :, 0], torch.zeros(1, 2, 8, dtype=torch.float64)), "position 0 sees nothing"
    assert torch.isneginf(lse[:, :, 0]).all() and torch.isfinite(lse[:, :, 1:]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[:, :, 0], torch.zeros(1, 2, 8, dtype=torch.float64))
    z = torch.tensor([0.5, -1.0], dtype=torch.float64)
    _, lse = compressed_attention(q, kv, kv, cmp, cmp, rate=2, window=0, sinks=z, return_lse=True)
    assert torch.equal(lse[0, :, 0], z), "an empty row's lse is its sink"


def test_equals_hf_deepseek_v4_eager_attention():
    """The definition against HF's own eager attention (sinks as an extra softmax column) under the masks HF's
    DeepseekV4Attention builds: its sliding-window causal mask and the CSA compressor's block bias."""
    M = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    import types
    g = torch.Generator().manual_seed(5)
    B, Hq, N, D, rate, window, T, K = 2, 4, 40, 16, 4, 8, 10, 3
    q = torch.randn(B, Hq, N, D, dtype=torch.float64, generator=g)
    kv = torch.randn(B, 1, N, D, dtype=torch.float64, generator=g)
    cmp = torch.randn(B, 1, T, D, dtype=torch.float64, generator=g)
    sinks = torch.randn(Hq, dtype=torch.float64, generator=g)
    scores = torch.randn(B, N, T, dtype=torch.float64, generator=g)
    thr = (torch.arange(N) + 1) // rate  # HF's indexer: future entries out, -1 where fewer than K remain
    scores = scores.masked_fill(torch.arange(T).view(1, 1, T) >= thr.view(1, N, 1), float("-inf"))
    top = scores.topk(K, -1).indices
    top = torch.where(top >= thr.view(1, N, 1), -1, top)  # (B, N, K)
    qi, ki = torch.arange(N).view(N, 1), torch.arange(N).view(1, N)
    sliding = torch.where((ki <= qi) & (ki > qi - window), 0.0, float("-inf")).double().expand(B, 1, N, N)
    bias = torch.full((B, 1, N, T + 1), float("-inf"), dtype=torch.float64)
    bias.scatter_(-1, torch.where(top >= 0, top, T).unsqueeze(1), 0.0)
    mask = torch.cat([sliding, bias[..., :T]], -1)
    module = types.SimpleNamespace(num_key_value_groups=Hq, sinks=sinks, training=False)
    keys = torch.cat([kv, cmp], 2)
    want, _ = M.eager_attention_forward(module, q, keys, keys, mask, scaling=D ** -0.5)
    for fn in (compressed_attention_reference, compressed_attention):
        got = fn(q, kv, kv, cmp, cmp, rate=rate, window=window, selected=top.unsqueeze(1), sinks=sinks)
        err = (got.transpose(1, 2) - want).abs().max().item()
        assert err < 1e-12, f"{fn.__name__} off HF's eager attention by {err:.3g}"


def _args():
    q = torch.zeros(1, 4, 8, 8)
    kv = torch.zeros(1, 1, 8, 8)
    cmp = torch.zeros(1, 1, 2, 8)
    return dict(q=q, k=kv, v=kv, k_cmp=cmp, v_cmp=cmp, rate=4, window=4)


@pytest.mark.parametrize("bad, match", [
    (dict(selected=torch.tensor([[[[2]]]]).expand(1, 1, 8, 1)), "there are 2 compressed entries"),
    (dict(selected=torch.full((1, 1, 8, 1), -2)), "valid ids 0 .. 1"),
    (dict(selected=torch.zeros(1, 1, 8, 1)), "selected must be an int64 tensor"),
    (dict(selected=torch.zeros(1, 3, 8, 1, dtype=torch.int64)), r"Hs in \(1, Hkv=1, Hq=4\)"),
    (dict(selected=torch.zeros(1, 1, 7, 1, dtype=torch.int64)), r"Nq=8"),
    (dict(rate=0), "rate must be an int >= 1"),
    (dict(rate=2.5), "rate must be an int >= 1"),
    (dict(window=-1), "window must be an int >= 0"),
    (dict(k_start=-1), "k_start must be an int >= 0"),
    (dict(q_start=-3), "q_start must be an int >= 0"),
    (dict(q=torch.zeros(1, 4, 9, 8)), "pass q_start"),
    (dict(q=torch.zeros(1, 3, 8, 8), k=torch.zeros(1, 2, 8, 8), v=torch.zeros(1, 2, 8, 8),
          k_cmp=torch.zeros(1, 2, 2, 8), v_cmp=torch.zeros(1, 2, 2, 8)), "multiple of the 2 KV heads"),
    (dict(k_cmp=torch.zeros(1, 1, 2, 6)), "k and k_cmp must have q's width"),
    (dict(v_cmp=torch.zeros(1, 1, 3, 8)), "v_cmp k_cmp's"),
    (dict(k_cmp=torch.zeros(1, 2, 2, 8)), "one KV head count"),
    (dict(v=torch.zeros(1, 1, 8, 8, dtype=torch.float64)), "cast them to one dtype"),
    (dict(q=torch.zeros(4, 8, 8)), r"q must be 4-D"),
    (dict(k=torch.zeros(1, 1, 8, 8, dtype=torch.int32)), "k must be a float tensor"),
    (dict(sinks=torch.zeros(3)), r"shape \(4,\)"),
    (dict(sinks=[0.0] * 4), "sinks must be a float"),
    (dict(scale="0.5"), "scale must be a float"),
], ids=["id-too-large", "id-below-minus-one", "float-ids", "list-heads", "list-rows", "rate0", "rate-float",
        "window-negative", "k-start-negative", "q-start-negative", "more-queries-than-keys", "gqa-heads",
        "cmp-width", "v-cmp-length", "cmp-heads", "mixed-dtype", "q-3d", "int-keys", "sinks-shape", "sinks-list",
        "scale-str"])
@pytest.mark.parametrize("fn", [compressed_attention, compressed_attention_reference], ids=["fast", "reference"])
def test_bad_inputs_are_refused(fn, bad, match):
    args = _args()
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        fn(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("k_cmp"), args.pop("v_cmp"), **args)


def test_rows_listing_nothing_visible_read_the_window_only():
    tensors, kw, same = _inputs(CASES[0])
    q, k, v, kc, vc, z = tensors
    kw["selected"] = torch.where(torch.arange(q.shape[2]).view(1, 1, -1, 1) < 20, -1, kw["selected"])
    out = compressed_attention(q, k, v, kc, vc, sinks=z, **kw)
    ref = compressed_attention_reference(q, k, v, kc, vc, sinks=z, **kw)
    none = compressed_attention(q, k, v, kc[:, :, :0], vc[:, :, :0], sinks=z, **dict(kw, selected=None))
    assert (out - ref).abs().max().item() < 1e-12
    assert (out[:, :, :20] - none[:, :, :20]).abs().max().item() < 1e-12


def test_nan_stays_in_its_row():
    tensors, kw, same = _inputs(CASES[7])
    q, k, v, kc, vc, z = tensors
    assert torch.isfinite(compressed_attention(q, k, v, kc, vc, sinks=z, **kw)).all()
    q_nan = q.clone()
    q_nan[0, 1, 17] = float("nan")
    out = compressed_attention(q_nan, k, v, kc, vc, sinks=z, **kw)
    assert torch.isnan(out[0, 1, 17]).all() and torch.isfinite(out[0, 0]).all(), "NaN in gives NaN out, in its row"
