"""Property tests (hypothesis) of the operator contract, on every backend that accepts the request."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv

SETTINGS = settings(max_examples=25, deadline=None)
BACKENDS = ("reference", "sdpa")


def _inputs(seed, B, Hq, Hkv, Nq, Nk, D, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Nq, D, generator=g, dtype=dtype), torch.randn(B, Hkv, Nk, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, Nk, D, generator=g, dtype=dtype))


dims = st.tuples(st.integers(0, 10_000), st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (4, 2)]),
                 st.integers(1, 12), st.integers(1, 12), st.sampled_from([4, 8]))


@SETTINGS
@given(dims, st.sampled_from(BACKENDS))
def test_permutation_equivariance_without_mask(d, backend):
    seed, B, (Hq, Hkv), Nq, Nk, D = d
    q, k, v = _inputs(seed, B, Hq, Hkv, Nq, Nk, D)
    perm_q = torch.randperm(Nq, generator=torch.Generator().manual_seed(seed))
    perm_k = torch.randperm(Nk, generator=torch.Generator().manual_seed(seed + 1))
    out = qkv.attention(q, k, v, backend=backend)
    # Permuting queries permutes outputs; permuting keys and values together changes nothing.
    out_p = qkv.attention(q[:, :, perm_q], k[:, :, perm_k], v[:, :, perm_k], backend=backend)
    assert torch.allclose(out_p, out[:, :, perm_q], atol=1e-10)


@SETTINGS
@given(dims, st.sampled_from(BACKENDS), st.integers(0, 10_000))
def test_masked_out_keys_never_matter(d, backend, seed2):
    seed, B, (Hq, Hkv), Nq, Nk, D = d
    q, k, v = _inputs(seed, B, Hq, Hkv, Nq, Nk, D)
    g = torch.Generator().manual_seed(seed2)
    lengths = torch.randint(0, Nk + 1, (B,), generator=g)
    mask = qkv.masks.padding(lengths) & qkv.masks.causal()
    out = qkv.attention(q, k, v, mask=mask, backend=backend)
    dead = torch.arange(Nk).view(1, -1) >= lengths.view(-1, 1)  # (B, Nk) keys no query may see
    k2, v2 = k.clone(), v.clone()
    noise = torch.randn(k.shape, generator=g, dtype=k.dtype) * 100
    k2[dead[:, None, :, None].expand_as(k)] = noise[dead[:, None, :, None].expand_as(k)]
    v2[dead[:, None, :, None].expand_as(v)] = noise[dead[:, None, :, None].expand_as(v)]
    out2 = qkv.attention(q, k2, v2, mask=mask, backend=backend)
    assert torch.equal(out, out2) or torch.allclose(out, out2, atol=1e-12)


@SETTINGS
@given(dims, st.sampled_from(BACKENDS))
def test_fully_masked_rows_are_zero_forward_and_backward(d, backend):
    seed, B, (Hq, Hkv), Nq, Nk, D = d
    q, k, v = (t.requires_grad_(True) for t in _inputs(seed, B, Hq, Hkv, Nq, Nk, D))
    # Rows whose position is below the first allowed key see nothing: a window that looks ahead only.
    mask = qkv.masks.sliding_window(0, 0) & ~qkv.masks.sliding_window(0, 0)
    out = qkv.attention(q, k, v, mask=mask, backend=backend)
    out.sum().backward()
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all() and (t == 0).all()


@SETTINGS
@given(dims, st.sampled_from(BACKENDS))
def test_gqa_equals_repeated_kv(d, backend):
    seed, B, (Hq, Hkv), Nq, Nk, D = d
    q, k, v = _inputs(seed, B, Hq, Hkv, Nq, Nk, D)
    g = Hq // Hkv
    mask = qkv.masks.causal()
    a = qkv.attention(q, k, v, mask=mask, backend=backend)
    b = qkv.attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), mask=mask, backend=backend)
    assert torch.allclose(a, b, atol=1e-12)


@SETTINGS
@given(dims, st.lists(st.integers(0, 12), min_size=1, max_size=4))
def test_merge_states_over_any_split_equals_whole(d, cuts):
    seed, B, (Hq, Hkv), Nq, Nk, D = d
    q, k, v = _inputs(seed, B, Hq, Hkv, Nq, Nk, D)
    mask = qkv.masks.causal()
    bounds = sorted({0, Nk, *[min(c, Nk) for c in cuts]})
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        # Each part keeps the whole key axis layout by masking everything outside [lo, hi).
        part = mask & qkv.masks.from_fn(lambda b, h, qi, kj, lo=lo, hi=hi: (kj >= lo) & (kj < hi))
        r = qkv.attention(q, k, v, mask=part, return_lse=True, backend="reference")
        outs.append(r.out)
        lses.append(r.lse)
    merged = qkv.merge_states(outs, lses)
    whole = qkv.attention(q, k, v, mask=mask, return_lse=True, backend="reference")
    assert torch.allclose(merged.out, whole.out, atol=1e-6)
    assert torch.allclose(merged.lse, whole.lse, atol=1e-5)


@SETTINGS
@given(dims, st.lists(st.integers(1, 11), min_size=1, max_size=4))
def test_merge_states_over_physical_key_chunks(d, cuts):
    """Split-KV decoding: attend to disjoint slices of the cache and merge."""
    seed, B, (Hq, Hkv), Nq, Nk, D = d
    q, k, v = _inputs(seed, B, Hq, Hkv, Nq, Nk, D)
    bounds = sorted({0, Nk, *[c for c in cuts if c < Nk]})
    parts = [qkv.attention(q, k[:, :, lo:hi], v[:, :, lo:hi], return_lse=True)
             for lo, hi in zip(bounds[:-1], bounds[1:])]
    merged = qkv.merge_states([p.out for p in parts], [p.lse for p in parts])
    assert torch.allclose(merged.out, qkv.attention(q, k, v), atol=1e-12)  # float64 parts merge in float64
