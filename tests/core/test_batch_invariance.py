"""attention(batch_invariant=True): a row's out and lse are bitwise the same whatever the batch around it,
however its prompt was chunked, whatever the tiled configuration; other backends decline."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.backends.tiled import TiledBackend, TiledConfig
from qkv.testing import check_batch_invariance


def _fn(backend):
    def fn(q, k, v, *, causal=False, return_lse=False):
        return qkv.attention(q, k, v, mask=qkv.masks.causal() if causal else None, return_lse=return_lse,
                             backend=backend, batch_invariant=True)
    return fn


@pytest.mark.parametrize("backend", ["tiled", "reference"])
def test_rows_are_bitwise_invariant(backend):
    r = check_batch_invariance(_fn(backend), B=8, N=40, chunk=7)
    assert r.ok, r.describe()


def test_matmul_is_not_row_invariant_here():
    """Why the mode exists: a CPU GEMM's row changes with the number of rows (if this ever stops failing,
    the mode is still correct, only no longer needed on this machine)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(64, 300, 64, generator=g), torch.randn(64, 1000, 64, generator=g)
    full = q @ k.transpose(-1, -2)
    one = q[:, 1:2] @ k.transpose(-1, -2)
    exact = q[:, 1:2].double() @ k.double().transpose(-1, -2)
    for got in (full[:, 1:2], one):  # both are the same product up to float32 rounding of 64-term sums
        torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=1e-5)
    if torch.equal(full[:, 1:2], one):
        pytest.skip("this machine's GEMM happens to be row invariant")
    assert (full[:, 1:2] != one).any()


def test_matches_the_reference_and_config_does_not_change_bits():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 4, 33, 16, generator=g), torch.randn(3, 2, 300, 16, generator=g),
               torch.randn(3, 2, 300, 16, generator=g))
    m = qkv.masks.sliding_window(40)
    out, lse = qkv.attention(q, k, v, mask=m, backend="tiled", batch_invariant=True, return_lse=True)
    ref, ref_lse = qkv.attention(q.double(), k.double(), v.double(), mask=m, backend="reference", return_lse=True)
    assert (out.double() - ref).abs().max() < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-5
    other = TiledBackend(TiledConfig(16, 16, 1))
    qkv.backends.register(other)
    try:
        out2, lse2 = qkv.attention(q, k, v, mask=m, backend="tiled", batch_invariant=True, return_lse=True)
    finally:
        qkv.backends.register(TiledBackend())
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_other_backends_decline_with_a_reason():
    x = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="batch_invariant"):
        qkv.attention(x, x, x, backend="sdpa", batch_invariant=True)
    e = qkv.explain(x, x, x, batch_invariant=True)
    assert e.chosen in ("tiled", "reference") and "batch_invariant" in e.declined["sdpa"]
    with pytest.raises(TypeError, match="batch_invariant"):
        qkv.attention(x, x, x, batch_invariant=1)
    with pytest.raises(ValueError, match="dropout"):
        qkv.attention(x, x, x, backend="tiled", batch_invariant=True, dropout_p=0.1)


def test_generate_row_is_bitwise_the_same_alone_and_in_a_batch_of_8():
    from _toy_lm import ToyLM
    from qkv.models.generate import generate
    model = ToyLM(layers=("full", ("window", 5)), seed=2).eval()
    g = torch.Generator().manual_seed(0)
    lengths = [9, 4, 6, 11, 3, 7, 5, 8]
    N = max(lengths)
    ids = torch.randint(1, 61, (8, N), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, N - n:] = 1
    ids = ids * mask
    batched = generate(model, ids, attention_mask=mask, max_new_tokens=5, return_logits=True, batch_invariant=True)
    for b in (0, 3):
        row = ids[b][mask[b].bool()].view(1, -1)
        alone = generate(model, row, max_new_tokens=5, return_logits=True, batch_invariant=True)
        assert torch.equal(alone.new_tokens[0], batched.new_tokens[b])
        assert torch.equal(alone.logits[0], batched.logits[b])
    other = ids.flip(0), mask.flip(0)  # the same row among the others in another order
    flipped = generate(model, other[0], attention_mask=other[1], max_new_tokens=5, return_logits=True,
                       batch_invariant=True)
    assert torch.equal(flipped.logits[7 - 3], batched.logits[3])
    assert torch.equal(batched.sequences[:, :N], ids)


def test_generate_batch_invariant_bad_inputs():
    from _toy_lm import ToyLM
    from qkv.models.generate import generate
    model = ToyLM(layers=("full",), seed=2).eval()
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="greedy"):
        generate(model, ids, max_new_tokens=2, do_sample=True, batch_invariant=True)
    with pytest.raises(ValueError, match="streamer"):
        generate(model, ids, max_new_tokens=2, streamer=print, batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant"):
        generate(model, ids, max_new_tokens=2, batch_invariant="yes")


@pytest.mark.parametrize("heads", [(32, 8), (4, 2), (8, 8)])
def test_a_row_is_the_same_whether_its_keys_end_mid_tile_or_inside_a_longer_padded_cache(heads):
    """Keys 0..299 end inside the second 256-key tile; the same row over a cache of 301, 512 or 700 keys with
    the rest padded out, or as one row of a batch of longer rows, reads whole tiles in place where the short
    call pads its last one: the bits must not change, and the value is the float64 reference's."""
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, Hq, 2, 32, generator=g), torch.randn(3, Hkv, 700, 32, generator=g), \
        torch.randn(3, Hkv, 700, 32, generator=g)
    alone = qkv.attention(q, k[1:2, :, :300], v[1:2, :, :300], batch_invariant=True, return_lse=True)
    for n in (301, 512, 700):
        padded = qkv.attention(q, k[1:2, :, :n], v[1:2, :, :n], mask=qkv.masks.padding(torch.tensor([300])),
                               batch_invariant=True, return_lse=True)
        assert torch.equal(padded.out, alone.out) and torch.equal(padded.lse, alone.lse), n
    qb = torch.cat([torch.randn(1, Hq, 2, 32, generator=g), q, torch.randn(1, Hq, 2, 32, generator=g)])
    batch = qkv.attention(qb, k, v, mask=qkv.masks.padding(torch.tensor([700, 300, 512])), batch_invariant=True)
    assert torch.equal(batch[1:2], alone.out)
    ref = qkv.attention(q.double(), k[1:2, :, :300].double(), v[1:2, :, :300].double(), backend="reference")
    torch.testing.assert_close(alone.out.double(), ref, rtol=0, atol=2e-6)
