"""Performer FAVOR+: random features, softmax approximation, causality, forms, the module's schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.linear import (
    LinearAttentionOutput,
    default_num_features,
    favor_key_features,
    favor_query_features,
    linear_attention_parallel,
    linear_attention_recurrent,
    orthogonal_gaussian,
    performer_attention,
    performer_attention_step,
)
from qkv.nn.performer import PerformerAttention
from qkv.testing import assert_within_budget


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv(B, H, N, D, Dv=None, *, seed=0, scale=1.0, dtype=torch.float64):
    g = _gen(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=dtype) * scale
    k = torch.randn(B, H, N, D, generator=g, dtype=dtype) * scale
    v = torch.randn(B, H, N, Dv or D, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("m, d", [(40, 16), (7, 16), (266, 64), (1, 1)], ids=["m40-d16", "m7-d16", "m266-d64", "m1-d1"])
def test_orthogonal_gaussian_blocks_are_orthogonal_with_chi_norms(m, d):
    W = orthogonal_gaussian(m, d, generator=_gen(0), dtype=torch.float64)
    assert W.shape == (m, d)
    norms = W.norm(dim=-1)
    for s in range(0, m, d):  # rows within a block are orthogonal
        block = W[s:s + d] / norms[s:s + d, None]
        torch.testing.assert_close(block @ block.T, torch.eye(block.shape[0], dtype=torch.float64))
    if m > 1:
        assert norms.std() > 0  # rescaled rows, not all sqrt(d)


def test_orthogonal_gaussian_seeding_and_statistics():
    a = orthogonal_gaussian(64, 8, generator=_gen(1))
    assert torch.equal(a, orthogonal_gaussian(64, 8, generator=_gen(1)))
    assert not torch.equal(a, orthogonal_gaussian(64, 8, generator=_gen(2)))
    # Row norms follow chi(d): E|w|^2 = d. Marginally each entry is N(0, 1).
    W = orthogonal_gaussian(8192, 16, generator=_gen(3), dtype=torch.float64)
    assert abs(float(W.square().sum(-1).mean()) / 16 - 1) < 0.03
    assert abs(float(W.std()) - 1) < 0.02
    assert default_num_features(64) == round(64 * math.log(64)) == 266
    assert default_num_features(1) == 1
    assert orthogonal_gaussian(None, 16, generator=_gen(0)).shape == (default_num_features(16), 16)


def test_feature_map_estimates_the_softmax_kernel():
    """phi(x)·phi(y) is an unbiased estimate of exp(x·y / sqrt(d)); with many features it is close."""
    d = 8
    W = orthogonal_gaussian(16384, d, generator=_gen(4), dtype=torch.float64)
    x = torch.randn(6, d, generator=_gen(5), dtype=torch.float64) * 0.7
    y = torch.randn(6, d, generator=_gen(6), dtype=torch.float64) * 0.7
    est = (favor_key_features(x, W) * favor_key_features(y, W)).sum(-1)
    exact = torch.exp((x * y).sum(-1) / math.sqrt(d))
    # Lemma 2 of the paper (iid features; orthogonal ones do better): the relative variance of the
    # estimate is (exp(|x' + y'|^2) - 1) / m with x' = x d^(-1/4). Allow 4 standard deviations.
    rel_std = ((torch.exp(((x + y) * d**-0.25).square().sum(-1)) - 1) / W.shape[0]).sqrt()
    assert ((est / exact - 1).abs() < 4 * rel_std).all(), (est / exact, rel_std)
    # Query features are the key map times a per-row constant: ratios across features agree.
    fq, fk = favor_query_features(x, W), favor_key_features(x, W)
    ratio = fq / fk
    torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))
    torch.testing.assert_close(fq.amax(-1), torch.full((6,), 16384**-0.5, dtype=torch.float64))


def test_approximation_error_falls_with_the_number_of_features():
    """Mean |FAVOR+ - softmax| over seeds for m in 16, 64, 256, 1024: decreasing, largest m >= 3x better."""
    d, N = 16, 48
    errors = []
    for m in (16, 64, 256, 1024):
        per_seed = []
        for seed in range(5):
            q, k, v = _qkv(1, 2, N, d, seed=seed, scale=0.5)
            W = orthogonal_gaussian(m, d, generator=_gen(100 + seed), dtype=torch.float64)
            for causal in (False, True):
                exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                per_seed.append(float((performer_attention(q, k, v, W, causal=causal).out - exact).abs().mean()))
        errors.append(sum(per_seed) / len(per_seed))
    msg = f"mean abs error for m = 16, 64, 256, 1024: {errors}"
    assert all(b < a * 1.05 for a, b in zip(errors, errors[1:])), msg
    assert errors[0] >= 3 * errors[-1], msg


@pytest.mark.parametrize("t", [0, 15, 16, 30, 48], ids=lambda t: f"t{t}")
def test_causal_output_ignores_future_tokens(t):
    """Changing every token after t (to much larger values) leaves outputs 0..t unchanged."""
    N, D = 49, 16
    W = orthogonal_gaussian(64, D, generator=_gen(0), dtype=torch.float64)
    q, k, v = _qkv(2, 2, N, D, seed=1)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    noise = _qkv(2, 2, N - t - 1, D, seed=2, scale=4.0)
    for x, n in zip((q2, k2, v2), noise):
        x[:, :, t + 1:] = n * 3
    a = performer_attention(q, k, v, W, causal=True, chunk_size=16).out
    b = performer_attention(q2, k2, v2, W, causal=True, chunk_size=16).out
    torch.testing.assert_close(a[:, :, :t + 1], b[:, :, :t + 1], rtol=0, atol=1e-12)
    if t + 1 < N:
        assert not torch.allclose(a[:, :, t + 1:], b[:, :, t + 1:])


def test_noncausal_stabilizers_cancel():
    """The stabilized result equals the textbook unstabilized FAVOR+ formula in float64."""
    q, k, v = _qkv(2, 3, 20, 8, 5, seed=3)
    W = orthogonal_gaussian(32, 8, generator=_gen(1), dtype=torch.float64)

    def phi(x):
        x = x * 8**-0.25
        return torch.exp(x @ W.T - x.square().sum(-1, keepdim=True) / 2) / math.sqrt(32)

    A = phi(q) @ phi(k).transpose(-1, -2)
    for causal in (False, True):
        Ac = A.tril() if causal else A
        want = (Ac @ v) / Ac.sum(-1, keepdim=True)
        torch.testing.assert_close(performer_attention(q, k, v, W, causal=causal).out, want, rtol=1e-10, atol=1e-12)


def test_large_norms_stay_finite():
    q, k, v = _qkv(1, 2, 40, 16, seed=4)
    W = orthogonal_gaussian(None, 16, generator=_gen(0))
    for sq, sk in ((50.0, 1.0), (1.0, 50.0), (20.0, 20.0)):
        out = performer_attention((q * sq).float(), (k * sk).float(), v.float(), W, causal=True).out
        assert torch.isfinite(out).all(), (sq, sk)
    # A key equal to a feature row (after scaling) has exponent |w|^2 / 2, about 128 at d = 256: exp
    # overflows float32 there without the clamp at 40.
    d = 256
    W = orthogonal_gaussian(16, d, generator=_gen(0))
    q, k, v = _qkv(1, 1, 4, d, seed=5, dtype=torch.float32)
    k[:, :, 2] = W[0] * d**0.25
    assert float(W[0].square().sum()) / 2 > 89
    fk = favor_key_features(k, W)
    assert torch.isfinite(fk).all() and float(fk.max()) == pytest.approx(math.exp(40) / 4, rel=1e-5)
    assert torch.isfinite(performer_attention(q, k, v, W, causal=True).out).all()


CASES = [(1, 1, 1, 8, 8), (2, 3, 63, 16, 16), (1, 2, 113, 8, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-N{c[2]}-D{c[3]}-Dv{c[4]}")
def test_causal_performer_matches_parallel_reference_fwd_bwd(case, dtype):
    """Chunked FAVOR+ against the quadratic form on the same features: outputs and gradients."""
    B, H, N, D, Dv = case
    q, k, v = _qkv(B, H, N, D, Dv, seed=5, scale=0.7)
    W = orthogonal_gaussian(32, D, generator=_gen(0), dtype=torch.float64)
    g_out = torch.randn(B, H, N, Dv, generator=_gen(6), dtype=torch.float64)

    def reference(q, k, v):
        fq, fk = favor_query_features(q, W), favor_key_features(k, W)
        return linear_attention_parallel(fq, fk, v.to(fq.dtype), feature_map=None, causal=True, eps=1e-12)

    def run(fn, q, k, v):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = fn(q, k, v).out
        return out, torch.autograd.grad(out, (q, k, v), g_out.to(out.dtype))

    lo = [x.to(dtype) for x in (q, k, v)]
    ref = run(reference, *(x.double() for x in lo))
    base = run(lambda *a: LinearAttentionOutput(reference(*a).out.to(dtype), None), *lo)
    cand = run(lambda q, k, v: performer_attention(q, k, v, W.float(), causal=True, chunk_size=16), *lo)
    assert cand[0].dtype == dtype
    assert_within_budget(cand[0], ref[0], base[0], what="out")
    for name, c, r, b in zip("qkv", cand[1], ref[1], base[1]):
        assert_within_budget(c, r, b, what=f"d{name}")


def test_causal_performer_forms_and_decode_agree():
    q, k, v = _qkv(2, 2, 37, 8, 6, seed=7)
    W = orthogonal_gaussian(None, 8, generator=_gen(2), dtype=torch.float64)
    full = performer_attention(q, k, v, W, causal=True, chunk_size=8)
    fq, fk = favor_query_features(q, W), favor_key_features(k, W)
    rec = linear_attention_recurrent(fq, fk, v, feature_map=None, eps=1e-12)
    torch.testing.assert_close(rec.out, full.out, rtol=1e-10, atol=1e-12)
    # Prefill 20 tokens in one call, 10 in a second with the carried state, then decode the rest.
    a = performer_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], W, causal=True, chunk_size=8)
    b = performer_attention(q[:, :, 20:30], k[:, :, 20:30], v[:, :, 20:30], W, causal=True, initial_state=a.state)
    outs, state = [a.out, b.out], b.state
    for t in range(30, 37):
        out, state = performer_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], W, state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 2), full.out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.S, full.state.S, rtol=1e-10, atol=1e-10)


def test_performer_bad_inputs():
    q, k, v = _qkv(1, 2, 5, 8)
    W = orthogonal_gaussian(16, 8, generator=_gen(0))
    with pytest.raises(ValueError, match=r"projection must have shape \(m, D\) with D = 8.*got \(16, 4\)"):
        performer_attention(q, k, v, W[:, :4])
    with pytest.raises(TypeError, match=r"projection must be a torch.Tensor"):
        performer_attention(q, k, v, W.tolist())
    with pytest.raises(ValueError, match=r"q must have rank 4"):
        performer_attention(q[0], k, v, W)
    with pytest.raises(ValueError, match=r"one token \(B, H, 1, D\)"):
        performer_attention_step(q, k, v, W, None)
    with pytest.raises(ValueError, match=r"num_features must be a positive int or None, got 0"):
        orthogonal_gaussian(0, 8)
    with pytest.raises(ValueError, match=r"dim must be a positive int"):
        orthogonal_gaussian(4, 0)


def test_module_redraw_schedule():
    attn = PerformerAttention(16, 2, num_features=8, redraw_every=2, seed=0)
    x = torch.randn(1, 4, 16)
    seen = [attn.projection.clone()]
    for _ in range(5):  # training steps 0..4: redraw before steps 2 and 4
        attn(x)
        seen.append(attn.projection.clone())
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    assert changed == [False, False, True, False, True]
    assert int(attn.training_steps) == 5

    attn.eval()
    before = attn.projection.clone()
    for _ in range(4):
        attn(x)
    assert torch.equal(attn.projection, before) and int(attn.training_steps) == 5

    attn.train()
    attn.freeze_features()
    for _ in range(4):
        attn(x)
    assert torch.equal(attn.projection, before)


def test_module_state_dict_reproduces_outputs_and_future_redraws():
    a = PerformerAttention(16, 2, causal=True, redraw_every=3, seed=1)
    x = torch.randn(2, 9, 16)
    for _ in range(4):
        a(x)
    b = PerformerAttention(16, 2, causal=True, redraw_every=3, seed=2)
    b.load_state_dict(a.state_dict())
    a.eval(), b.eval()
    assert torch.equal(a(x).out, b(x).out)
    a.train(), b.train()
    for _ in range(4):  # the next redraw comes from the saved generator state
        assert torch.equal(a(x).out, b(x).out)
    assert torch.equal(a.projection, b.projection)


def test_module_seeds_decode_and_gradients():
    torch.manual_seed(0)
    a = PerformerAttention(32, 4, causal=True)
    torch.manual_seed(0)
    b = PerformerAttention(32, 4, causal=True)
    c = PerformerAttention(32, 4, causal=True)
    assert torch.equal(a.projection, b.projection) and not torch.equal(a.projection, c.projection)
    assert a.projection.shape == (default_num_features(8), 8)

    a.eval()
    x = torch.randn(2, 12, 32)
    full = a(x)
    out, state = a(x[:, :9])
    steps = [out]
    for t in range(9, 12):
        y, state = a.step(x[:, t:t + 1], state)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), full.out, rtol=1e-4, atol=1e-5)

    a.train()
    a(x).out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in a.parameters())
    with pytest.raises(ValueError, match=r"redraw_every must be a positive int or None, got 0"):
        PerformerAttention(32, 4, redraw_every=0)
    with pytest.raises(ValueError, match=r"step decodes causally"):
        PerformerAttention(32, 4).step(x[:, :1], None)
