"""Packed variable-length attention (``qkv.varlen``) against each sequence run alone, and padding-free training.

The reference is each sequence on its own through the reference backend in float64, with the mask written
out by the definition (FlashAttention's bottom-right alignment within a sequence); the baseline is the same
per-sequence eager computation in the candidate's dtype. Forward and backward.
"""

from __future__ import annotations

import copy

import pytest
import torch

import qkv
from _helpers import eager_same_dtype
from qkv import masks as M
from qkv import varlen
from qkv.nn import packed_documents
from qkv.testing import assert_within_budget

# id -> (q lengths, k lengths (None: the same), Hq, Hkv, causal, window)
CASES = {
    "self-causal-S4": ([5, 1, 13, 7], None, 4, 2, True, (-1, -1)),
    "self-window3-causal": ([9, 17, 4], None, 2, 2, True, (3, -1)),
    "self-bidirectional-window2-2": ([6, 11, 0, 8], None, 4, 1, False, (2, 2)),
    "self-right1-only": ([7, 5], None, 2, 1, False, (-1, 1)),
    "self-full-noncausal": ([3, 10, 6], None, 2, 2, False, (-1, -1)),
    "cross-sq-lt-sk-causal": ([2, 5, 3], [6, 5, 9], 4, 2, True, (-1, -1)),
    "cross-sq-gt-sk-causal": ([7, 4], [3, 4], 2, 2, True, (-1, -1)),
    "cross-window1-1": ([4, 6], [9, 6], 2, 1, False, (1, 1)),
}


def _allowed(sq: int, sk: int, causal: bool, window) -> torch.Tensor:
    """The per-sequence mask by the definition: query i at p = i + sk - sq."""
    p = torch.arange(sq).view(-1, 1) + (sk - sq)
    j = torch.arange(sk).view(1, -1)
    ok = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        ok &= j <= p
    if left >= 0:
        ok &= j >= p - left
    if right >= 0 and not causal:
        ok &= j <= p + right
    return ok


def _inputs(case: str, dtype, D: int = 16, seed: int = 0):
    lq, lk, Hq, Hkv, _, _ = CASES[case]
    lk = lq if lk is None else lk
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lq), sum(lk)
    master = [torch.randn(tq, Hq, D, generator=g, dtype=torch.float64),
              torch.randn(tk, Hkv, D, generator=g, dtype=torch.float64),
              torch.randn(tk, Hkv, D + 4, generator=g, dtype=torch.float64)]
    master = [t.to(dtype).to(torch.float64).requires_grad_() for t in master]
    cast = [t.detach().to(dtype).requires_grad_() for t in master]
    return master, cast, varlen.cu_seqlens_from_lengths(lq), varlen.cu_seqlens_from_lengths(lk)


def _per_sequence(case: str, q, k, v, cq, ck, fn):
    """Run ``fn(q, k, v, mask)`` on each sequence alone (as (1, H, n, D)); concatenate (total_q, Hq, Dv)."""
    _, _, _, _, causal, window = CASES[case]
    outs = []
    for s in range(cq.numel() - 1):
        qs, ks, vs = (t[int(c[s]):int(c[s + 1])].transpose(0, 1)[None] for t, c in ((q, cq), (k, ck), (v, ck)))
        mask = M.dense(_allowed(qs.shape[2], ks.shape[2], causal, window))
        outs.append(fn(qs, ks, vs, mask)[0].transpose(0, 1))
    return torch.cat(outs)


def _grads(out, leaves, seed=3):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), leaves)


@pytest.mark.parametrize("backend", ["auto", "tiled", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_equals_each_sequence_alone(case, dtype, backend):
    master, cast, cq, ck = _inputs(case, dtype)
    causal, window = CASES[case][4], CASES[case][5]
    ref = _per_sequence(case, *master, cq, ck, lambda q, k, v, m: qkv.attention(q, k, v, mask=m, backend="reference"))
    base = _per_sequence(case, *[t.detach().requires_grad_() for t in cast], cq, ck,
                         lambda q, k, v, m: eager_same_dtype(q, k, v, mask=m))
    out = qkv.varlen_attention(*cast, cq, ck, causal=causal, window=window, backend=backend)
    assert out.shape == ref.shape and out.dtype == dtype
    assert_within_budget(out.detach(), ref.detach(), base.detach(), what=f"{case} out")
    base_leaves = [t.detach().requires_grad_() for t in cast]
    base = _per_sequence(case, *base_leaves, cq, ck, lambda q, k, v, m: eager_same_dtype(q, k, v, mask=m))
    for name, g, r, b in zip("qkv", _grads(out, cast), _grads(ref, master), _grads(base, base_leaves)):
        assert_within_budget(g, r, b, what=f"{case} d{name}")


def test_lse_is_per_sequence_in_flash_layout():
    master, _, cq, ck = _inputs("cross-sq-lt-sk-causal", torch.float64)
    res = qkv.varlen_attention(*master, cq, ck, causal=True, return_lse=True)
    assert res.lse.shape == (4, int(cq[-1])) and res.lse.dtype == torch.float64  # float64 in, float64 lse
    lses = _per_sequence("cross-sq-lt-sk-causal", *master, cq, ck, lambda q, k, v, m: qkv.attention(
        q, k, v, mask=m, return_lse=True, backend="reference").lse.unsqueeze(-1))  # (total_q, Hq, 1)
    assert torch.allclose(res.lse, lses[..., 0].T, atol=1e-12)


def test_tiled_skips_the_tiles_between_sequences():
    lengths = [128] * 4
    cu = varlen.cu_seqlens_from_lengths(lengths)
    q = k = v = torch.randn(512, 2, 16)
    tiled = qkv.backends.get("tiled")
    qkv.varlen_attention(q, k, v, cu, cu, causal=True, backend="tiled")
    stats = tiled.last_stats
    assert stats.tiles * 3 <= stats.grid_tiles, f"visited {stats.tiles} of {stats.grid_tiles} tiles"


def test_pack_unpack_roundtrip_any_padding_side():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1], [1] * 7])
    p = varlen.pack(x, mask)
    assert p.cu_seqlens.tolist() == [0, 4, 9, 16] and p.max_seqlen == 7 and p.values.shape == (16, 5)
    assert p.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, *range(7)]
    assert torch.equal(p.values[4], x[1, 2])
    back = varlen.unpack(p.values, p)
    assert torch.equal(back, x * mask.unsqueeze(-1))


def _decoder():
    from qkv.nn import DecoderConfig, DecoderLM

    cfg = DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=48, sliding_window=6,
                        layer_types=("sliding_attention", "full_attention"), backend="tiled")
    torch.manual_seed(0)
    return DecoderLM(cfg)


def _loss_padded(model, ids, mask):
    pos = (mask.cumsum(1) - 1).masked_fill(mask == 0, -1)
    logits = model(ids, positions=pos).logits  # (B, N, V)
    valid = (mask[:, :-1] & mask[:, 1:]).bool()
    return torch.nn.functional.cross_entropy(logits[:, :-1][valid].double(), ids[:, 1:][valid], reduction="sum")


def _loss_packed(model, ids, mask):
    p = varlen.pack(ids, mask)
    with packed_documents(model, p.cu_seqlens):
        logits = model(p.values[None], positions=p.positions[None]).logits[0]  # (total, V)
    nxt = torch.ones(p.values.shape[0], dtype=torch.bool)
    nxt[p.cu_seqlens[1:].long() - 1] = False  # the last token of each sequence predicts nothing
    return torch.nn.functional.cross_entropy(logits[:-1][nxt[:-1]].double(), p.values[1:][nxt[:-1]],
                                             reduction="sum")


def test_padding_free_training_equals_the_padded_batch():
    """Same loss and gradients: packed float32 (the candidate) and padded float32 (the baseline) against the
    padded batch in float64 (the reference); windows and full layers, right and left padding."""
    model = _decoder()
    ref_model = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (3, 20), generator=g)
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[0, 11:] = 0
    mask[1, :6] = 0
    results = {}
    for name, m, fn in (("ref", ref_model, _loss_padded), ("base", model, _loss_padded), ("cand", model, _loss_packed)):
        m.zero_grad()
        loss = fn(m, ids, mask)
        loss.backward()
        results[name] = (loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()})
    assert_within_budget(results["cand"][0], results["ref"][0], results["base"][0], what="loss")
    for n, g_ref in results["ref"][1].items():
        assert_within_budget(results["cand"][1][n], g_ref, results["base"][1][n], what=f"grad {n}")
    assert all(not callable(getattr(m, "attention_fn", None)) or m.attention_fn is qkv.attention
               for m in model.modules()), "packed_documents must restore every hook"


@pytest.mark.parametrize("call,match", [
    (lambda q, cu: qkv.varlen_attention(q[None], q, q, cu, cu), "packed \\(total, H, D\\)"),
    (lambda q, cu: qkv.varlen_attention(q, q, q, cu.float(), cu), "1-D integer"),
    (lambda q, cu: qkv.varlen_attention(q, q, q, torch.tensor([1, 8]), cu), "start at 0"),
    (lambda q, cu: qkv.varlen_attention(q, q, q, torch.tensor([0, 5, 3, 8]), cu), "non-decreasing"),
    (lambda q, cu: qkv.varlen_attention(q, q, q, torch.tensor([0, 7]), torch.tensor([0, 7])), "last entry"),
    (lambda q, cu: qkv.varlen_attention(q, q, q, cu, torch.tensor([0, 8])), "sequences"),
    (lambda q, cu: qkv.varlen_attention(q, q, q, cu, cu, max_seqlen_q=3), "longest sequence"),
    (lambda q, cu: qkv.varlen_attention(q, q, q, cu, cu, window=(2,)), "window"),
    (lambda q, cu: qkv.varlen_attention(q, q, q, cu, cu, window=(-2, 0)), "window"),
    (lambda q, cu: varlen.pack(q, torch.ones(3, 3)), "shape \\(B, N\\)"),
    (lambda q, cu: varlen.pack(q, torch.full((8, 2), 2)), "0/1"),
    (lambda q, cu: varlen.unpack(q, (q, cu)), "Packed"),
    (lambda q, cu: varlen.cu_seqlens_from_lengths([3, -1]), "non-negative"),
    (lambda q, cu: packed_documents(torch.nn.Linear(2, 2), cu).__enter__(), "attention_fn"),
], ids=["rank", "cu-dtype", "cu-start", "cu-order", "cu-total", "cu-count", "max-seqlen", "window-len",
        "window-value", "pack-shape", "pack-values", "unpack-type", "lengths", "no-hook"])
def test_bad_input_is_named(call, match):
    q = torch.randn(8, 2, 4)
    cu = torch.tensor([0, 3, 8])
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, cu)
