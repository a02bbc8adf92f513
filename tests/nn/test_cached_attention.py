"""Cached attention written once (qkv.nn.cached.cached_attention): the one path of MultiHeadAttention, the
decoder's SelfAttention and LatentAttention over a cache. A cache with only the base protocol works through all
three; a cache that declares in-place decoding (qkv.cache.DecodingCache) is offered plain single-query steps
and nothing else; caches that re-position keys get un-rotated keys and rope; score-ranked eviction is refused
where scores carry modifiers; generate and verify_cache test capabilities by protocol, not by class. The helper
itself is checked against an independent float64 attention with error budgets, forward and backward."""

from __future__ import annotations

import doctest

import pytest
import torch

import qkv
from qkv import masks, mods
from qkv.cache import (
    H2O,
    AttentionCache,
    CacheView,
    CroppableCache,
    DecodingCache,
    DeferredViewCache,
    ForkableCache,
    FullSpec,
    KVCache,
    LatentCache,
    LatentView,
    Paged,
    PrefixMatchingCache,
    ResettableCache,
)
from qkv.nn import DecoderConfig, DecoderLM, LatentAttention, LatentConfig, MultiHeadAttention, get_config
from qkv.nn.cached import (
    attention_mask,
    cache_capabilities,
    cached_attention,
    plain_decode_step,
    refuse_scoring_cache,
)
from qkv.pos import ALiBiBias, RotaryEmbedding
from qkv.testing import budget

_LATENT = LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=8)


class BaseCache:
    """The base protocol only (AttentionCache and LatentCache), written from scratch: every layer keeps every
    token, concatenated; no decode, match_prefix, crop, fork or reset."""

    def __init__(self, *, absolute: bool = True):
        self.absolute = absolute
        self.layers: dict[int, list[torch.Tensor]] = {}
        self.observed: list[tuple[int, torch.Tensor, float | None]] = []
        self.ropes: list[bool] = []

    def _store(self, layer_idx, a, b, positions, dim):
        if layer_idx in self.layers:
            old_a, old_b, old_pos = self.layers[layer_idx]
            a, b, positions = torch.cat([old_a, a], dim), torch.cat([old_b, b], dim), torch.cat([old_pos, positions], 1)
        self.layers[layer_idx] = [a, b, positions]
        return a, b, positions

    def update(self, layer_idx, k, v, *, positions, rope=None):
        self.ropes.append(rope is not None)
        if rope is not None:
            k = rope(k, positions.clamp_min(0))
        k_all, v_all, kv_pos = self._store(layer_idx, k, v, positions, 2)
        return CacheView(k_all, v_all, kv_pos, positions)

    def update_latent(self, layer_idx, c_kv, k_rope, *, positions, rope=None):
        if rope is not None:
            k_rope = rope(k_rope[:, None], positions.clamp_min(0))[:, 0]
        c_all, r_all, kv_pos = self._store(layer_idx, c_kv, k_rope, positions, 1)
        return LatentView(c_all, r_all, kv_pos, positions)

    def cross_kv(self, layer_idx, compute):
        raise AssertionError("no cross attention here")

    @property
    def seq_length(self):
        return 0 if not self.layers else self.layers[min(self.layers)][2].shape[1]

    def keeps_absolute_positions(self, layer_idx):
        return self.absolute

    def observe(self, layer_idx, q, *, scale=None):
        self.observed.append((layer_idx, q, scale))

    def scores_attention(self, layer_idx):
        return False

    def prepare(self, input_ids, positions):
        return None

    @property
    def prefix_caching(self):
        return False


class DecodingBaseCache(BaseCache):
    """Adds in-place decoding: attends over the step just stored by its own float64 computation (or returns
    ``answer`` when set, to show the module uses what decode returns)."""

    def __init__(self, *, answer=None):
        super().__init__()
        self.calls: list[tuple[int, tuple, float, int | None]] = []
        self.answer = answer

    def decode(self, layer_idx, q, *, scale, window=None):
        self.calls.append((layer_idx, tuple(q.shape), scale, window))
        if self.answer is not None:
            return self.answer(q)
        k, v, kv_pos = self.layers[layer_idx]
        q_pos = kv_pos[:, -q.shape[2]:]  # the step's queries: the last tokens stored
        return _naive(q.double(), k.double(), v.double(), q_pos, kv_pos, causal=True, window=window,
                      scale=scale).to(q.dtype)


class ScoringCache(BaseCache):
    def scores_attention(self, layer_idx):
        return True


def _naive(q, k, v, q_pos, kv_pos, *, causal=True, window=None, scale=None, softcap=None, sinks=None, gate=None):
    """Attention written out: scores, modifiers, a mask by positions, softmax (with sinks), values, gates."""
    B, H, Nq, D = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qp, kp = q_pos[:, None, :, None], kv_pos[:, None, None, :]
    allowed = (kp >= 0) & (qp >= 0)
    if causal:
        allowed = allowed & (kp <= qp)
    if window is not None:
        allowed = allowed & (kp > qp - window)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, H, 1, 1).expand(B, H, Nq, 1)], -1)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    if sinks is not None:
        p = p[..., :-1]
    out = p @ v
    return out if gate is None else out * gate.to(out.dtype).view(1, H, 1, 1)



CASES = {
    "causal": dict(),
    "window3": dict(window=3),
    "softcap-sinks": dict(softcap=20.0, sinks=True),
    "gate-window": dict(gate=True, window=4),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_helper_matches_attention_written_out(case, dtype):
    opts = CASES[case]
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, N, D = 2, 4, 2, 13, 16
    q64, k64, v64 = (torch.randn(B, h, N, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    q64, k64, v64 = (t.to(dtype).double() for t in (q64, k64, v64))
    pos = torch.arange(N).expand(B, N).clone()
    pos[1, :3] = -1  # left padding on row 1
    pos[1, 3:] -= 3
    sinks = torch.randn(Hq, generator=g, dtype=torch.float64) if opts.get("sinks") else None
    gate = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float64) if opts.get("gate") else None
    kw = dict(positions=pos, window=opts.get("window"),
              score_mod=mods.softcap(opts["softcap"]) if "softcap" in opts else None)
    ref = _naive(q64, k64, v64, pos, pos, window=kw["window"], softcap=opts.get("softcap"), sinks=sinks, gate=gate)
    leaves = [t.to(dtype).requires_grad_() for t in (q64, k64, v64)]
    cand = cached_attention(*leaves, sinks=None if sinks is None else sinks.float(),
                            head_gate=None if gate is None else gate.float(), **kw).out
    base = _naive(*(t.to(dtype) for t in (q64, k64, v64)), pos, pos, window=kw["window"],
                  softcap=opts.get("softcap"), sinks=None if sinks is None else sinks.to(dtype),
                  gate=None if gate is None else gate.to(dtype))
    b = budget(cand, ref, base)
    assert b.ok, b
    up = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    masters = [t.detach().clone().requires_grad_() for t in (q64, k64, v64)]
    grads64 = torch.autograd.grad((_naive(*masters, pos, pos, window=kw["window"], softcap=opts.get("softcap"),
                                          sinks=sinks, gate=gate) * up).sum(), masters)
    grads = torch.autograd.grad((cand * up.to(dtype)).sum(), leaves)
    lows = [t.to(dtype).requires_grad_() for t in (q64, k64, v64)]
    base_out = _naive(*lows, pos, pos, window=kw["window"], softcap=opts.get("softcap"),
                      sinks=None if sinks is None else sinks.to(dtype), gate=None if gate is None else gate.to(dtype))
    base_grads = torch.autograd.grad((base_out * up.to(dtype)).sum(), lows)
    for name, c, r, bl in zip("qkv", grads, grads64, base_grads):
        gb = budget(c, r, bl)
        assert gb.ok, (name, gb)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_helper_over_a_cache_equals_one_call(window):
    """Prefill in two chunks and three single-query steps over a KVCache and over the base-protocol cache: the
    same rows as one call over the whole sequence (rotated by RoPE at absolute positions)."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, N, D = 2, 4, 1, 11, 8
    q, k, v = (torch.randn(B, h, N, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    pos = torch.arange(N).expand(B, N)
    rope = RotaryEmbedding(D)
    whole = cached_attention(q, k, v, positions=pos, rope=rope, window=window).out
    for cache in (KVCache([FullSpec(Hkv, D)]), BaseCache()):
        parts = []
        for a, b in ((0, 5), (5, 8), (8, 9), (9, 10), (10, 11)):
            parts.append(cached_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], cache=cache,
                                          positions=pos[:, a:b], rope=rope, window=window).out)
        torch.testing.assert_close(torch.cat(parts, 2), whole, atol=1e-12, rtol=1e-12)


def test_observe_sees_the_rotated_queries():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    rope, cache = RotaryEmbedding(8), BaseCache()
    pos = torch.arange(4)[None]
    cached_attention(q, k, v, cache=cache, positions=pos, rope=rope, scale=0.3, layer_idx=0)
    (layer, seen, scale), = cache.observed
    assert layer == 0 and scale == 0.3
    torch.testing.assert_close(seen, rope(q, pos))



def _mha():
    torch.manual_seed(0)
    return MultiHeadAttention(32, 4, n_kv_heads=2, rope=RotaryEmbedding(8), causal=True, layer_idx=0).eval()


def _run_mha(m, x, cache, chunks):
    outs = [m(x[:, a:b], positions=torch.arange(a, b), cache=cache).out for a, b in chunks]
    return torch.cat(outs, 1)


CHUNKS = ((0, 6), (6, 7), (7, 8), (8, 9))


@pytest.mark.parametrize("absolute", [True, False], ids=["absolute", "re-positioning"])
def test_base_protocol_cache_through_multi_head_attention(absolute):
    m = _mha()
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = m(x, positions=torch.arange(9)).out
        cache = BaseCache(absolute=absolute)
        got = _run_mha(m, x, cache, CHUNKS)
        kv = _run_mha(m, x, KVCache([FullSpec(2, 8)]), CHUNKS)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, kv, atol=1e-6, rtol=1e-6)
    assert cache.ropes == [not absolute] * len(CHUNKS), "rope goes to the cache only when it re-positions keys"
    assert len(cache.observed) == len(CHUNKS)


def _lm(name="tiny-llama", **kw):
    torch.manual_seed(0)
    return DecoderLM(get_config(name, **kw)).eval()


def _decode(lm, cache, ids, n_prefill):
    with torch.no_grad():
        logits = [lm(ids[:, :n_prefill], cache=cache).logits]
        for t in range(n_prefill, ids.shape[1]):
            logits.append(lm(ids[:, t:t + 1], cache=cache).logits)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-bloom"])
@pytest.mark.parametrize("absolute", [True, False], ids=["absolute", "re-positioning"])
def test_base_protocol_cache_through_the_decoder(name, absolute):
    lm = _lm(name)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    cache = BaseCache(absolute=absolute)
    got = _decode(lm, cache, ids, 6)
    lm64 = _lm(name).double()
    with torch.no_grad():
        ref, base = lm64(ids).logits, lm(ids).logits
    b = budget(got, ref, base)
    assert b.ok, b
    assert not isinstance(cache, DecodingCache) and cache.seq_length == 10
    if lm.ropes:
        assert set(cache.ropes) == {not absolute}


def test_base_protocol_cache_through_latent_attention():
    torch.manual_seed(0)
    attn = LatentAttention(_LATENT).eval()
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
    cache = BaseCache()
    with torch.no_grad():
        want = attn(x, positions=torch.arange(9)).out
        parts = [attn(x[:, a:b], positions=torch.arange(a, b), cache=cache) for a, b in CHUNKS]
    assert [p.path for p in parts] == ["expanded", "absorbed", "absorbed", "absorbed"]
    torch.testing.assert_close(torch.cat([p.out for p in parts], 1), want, atol=1e-5, rtol=1e-5)
    assert cache.observed == [], "a cache that does not score latents is shown nothing"
    mla = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, latent=_LATENT)).eval()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(_decode(mla, BaseCache(), ids, 5), mla(ids).logits, atol=1e-5, rtol=1e-5)


def test_latent_observe_gets_queries_whose_products_are_the_scores():
    """A cache that ranks a latent layer's tokens by attention sees [W_UK^T q_nope | q_rope]: its dot products with
    the cached [c_kv | k_rope], times the scale, equal the expanded scores q_nope . k_nope + q_rope . k_rope."""
    torch.manual_seed(0)
    attn = LatentAttention(_LATENT).double().eval()
    c = _LATENT
    H, r, dn, dr = c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    cache = ScoringCache()
    pos = torch.arange(5)[None]
    with torch.no_grad():
        attn(x, positions=pos, cache=cache)
        (_, q_obs, scale), = cache.observed
        c_kv, k_rope, _ = cache.layers[0]
        got = scale * q_obs @ torch.cat([c_kv, k_rope], -1).transpose(-1, -2)[:, None]  # (1, H, 5, 5)
        q = attn.q_proj(x).view(1, 5, H, dn + dr).transpose(1, 2)
        q_nope, q_rope = q[..., :dn], attn.rope(q[..., dn:], pos)
        k_nope = attn.kv_b_proj(c_kv).view(1, 5, H, -1)[..., :dn].transpose(1, 2)
        want = c.softmax_scale * (q_nope @ k_nope.transpose(-1, -2) + q_rope @ k_rope[:, None].transpose(-1, -2))
    assert q_obs.shape == (1, H, 5, r + dr)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)



def test_a_decoding_cache_gets_exactly_the_plain_steps_of_multi_head_attention():
    m = _mha()
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        plain = _run_mha(m, x, BaseCache(), CHUNKS)
        cache = DecodingBaseCache()
        got = _run_mha(m, x, cache, CHUNKS)
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    assert [c[1] for c in cache.calls] == [(2, 4, 6, 8)] + [(2, 4, 1, 8)] * 3, "one call per plain step, prompt too"
    assert cache.calls[0][2] == 8 ** -0.5 and cache.calls[0][3] is None
    with torch.no_grad():  # what decode returns is what the module attends with
        zero = DecodingBaseCache(answer=torch.zeros_like)
        _run_mha(m, x[:, :6], zero, [(0, 6)])
        out = m(x[:, 6:7], positions=torch.tensor([6]), cache=zero).out
    torch.testing.assert_close(out, m.o_proj.bias.expand_as(out))
    for change in ("score_mod", "need_lse", "attention_fn", "training"):
        m2 = _mha()
        if change == "score_mod":
            m2.score_mod = mods.softcap(30.0)
        elif change == "attention_fn":
            m2.attention_fn = lambda *a, **kw: qkv.attention(*a, **kw)
        elif change == "training":
            m2.dropout = 0.1
            m2.train()
        cache = DecodingBaseCache()
        with torch.no_grad():
            _run_mha(m2, x, cache, [(0, 6)])
            m2(x[:, 6:7], positions=torch.tensor([6]), cache=cache, need_lse=change == "need_lse")
        prompt = [(2, 4, 6, 8)] if change == "need_lse" else []  # need_lse asks it of the last step only
        assert [c[1] for c in cache.calls] == prompt, f"{change}: the step is not plain; the cache must not be asked"


def test_a_decoder_offers_each_layer_its_decode_step_with_its_window():
    lm = _lm("tiny-gemma", attn_logit_softcapping=50.0)  # softcapped scores: not plain
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(7))
    cache = DecodingBaseCache()
    _decode(lm, cache, ids, 6)
    assert cache.calls == [], "softcapped scores are not a plain decode step"
    lm = _lm("tiny-gemma")  # sliding and global layers
    cache = DecodingBaseCache()
    got = _decode(lm, cache, ids, 6)
    windows = [lm.config.window_for(i) for i in range(4)]
    assert [(c[0], c[3]) for c in cache.calls] == [(i, windows[i]) for i in range(4)] * 3  # prompt + 2 steps
    with torch.no_grad():
        torch.testing.assert_close(got, lm(ids).logits, atol=1e-4, rtol=1e-4)
    returns_none = DecodingBaseCache(answer=lambda q: None)  # no kernel for this layer: attend over the view
    torch.testing.assert_close(_decode(lm, returns_none, ids, 6), got, atol=1e-5, rtol=1e-5)
    assert len(returns_none.calls) == 12



def test_score_ranked_eviction_is_refused_before_anything_is_written():
    x = torch.randn(1, 3, 32)
    for module in (MultiHeadAttention(32, 4, score_mod=mods.softcap(20.0), causal=True),
                   MultiHeadAttention(32, 4, position_bias=ALiBiBias(4), causal=True)):
        cache = ScoringCache()
        with pytest.raises(ValueError, match="evicts by observed attention.*(softcap|ALiBiBias)"):
            module(x, positions=torch.arange(3), cache=cache)
        assert cache.layers == {}
    plain = ScoringCache()
    assert MultiHeadAttention(32, 4, causal=True)(x, positions=torch.arange(3), cache=plain).out.shape == (1, 3, 32)
    cache = KVCache([FullSpec(1, 4)], policy=H2O(heavy=2, recent=2))
    with pytest.raises(ValueError, match=r"demo: layer 0's cache evicts.*\(softcap\(1\), ALiBi\)"):
        refuse_scoring_cache(cache, 0, owner="demo", modifiers=[mods.softcap(1.0), None, "ALiBi"])
    refuse_scoring_cache(KVCache([FullSpec(1, 4)]), 0, owner="demo", modifiers=["anything"])  # does not score



def test_kv_cache_declares_every_capability_and_the_base_cache_none():
    cache = KVCache([FullSpec(1, 4)])
    for proto in (AttentionCache, LatentCache, DecodingCache, DeferredViewCache, PrefixMatchingCache, CroppableCache,
                  ForkableCache, ResettableCache):
        assert isinstance(cache, proto), proto.__name__
    base = BaseCache()
    assert isinstance(base, AttentionCache) and isinstance(base, LatentCache)
    for proto in (DecodingCache, DeferredViewCache, PrefixMatchingCache, CroppableCache, ForkableCache,
                  ResettableCache):
        assert not isinstance(base, proto), proto.__name__
    assert cache_capabilities(base) == (True, True, False, False, False)
    assert cache_capabilities(DecodingBaseCache()) == (True, True, True, False, False)  # always builds its view
    assert cache_capabilities(cache) == (True, True, True, True, True)  # K = V layers may store values only
    assert cache_capabilities(object()) == (False, False, False, False, False)


def test_verify_cache_runs_what_the_cache_declares():
    from qkv.models.verify import verify_cache

    lm = _lm()
    report = verify_cache(lm, BaseCache, raise_on_failure=False, prompt_lengths=(6, 4), max_new_tokens=3)
    checks = {c.name: c for c in report.checks}
    assert checks["decode"].ok, report
    assert not checks["crop"].ok and "CroppableCache" in checks["crop"].detail and "crop=0" in checks["crop"].detail
    assert not checks["fork"].ok and "ForkableCache" in checks["fork"].detail
    assert verify_cache(lm, BaseCache, crop=0, fork=False, prompt_lengths=(6, 4), max_new_tokens=3).ok


def test_generate_uses_prefix_matching_by_protocol():
    from qkv.models.generate import generate

    class ClaimsPrefixes(BaseCache):
        prefix_caching = True

    lm = _lm()
    ids = torch.randint(0, 256, (1, 5))
    with pytest.raises(TypeError, match="prefix_caching=True but has no match_prefix.*PrefixMatchingCache"):
        generate(lm, ids, max_new_tokens=2, cache=ClaimsPrefixes())
    out = generate(lm, ids, max_new_tokens=2, cache=BaseCache())
    assert out.new_tokens.shape == (1, 2)
    paged = KVCache(lm.cache_specs(), storage=Paged(block_size=4, num_blocks=16, prefix_caching=True))
    assert generate(lm, ids, max_new_tokens=2, cache=paged).prefix_hits.tolist() == [0]


def test_no_module_and_no_generate_tests_for_the_concrete_cache_class():
    import pathlib

    import qkv as package

    root = pathlib.Path(package.__file__).parent
    for sub in ("nn", "models", "interpret", "distributed", "integrations"):
        for path in (root / sub).rglob("*.py"):
            text = path.read_text()
            assert "isinstance(cache, KVCache)" not in text and "type(cache) is KVCache" not in text, path



def test_cached_attention_bad_input():
    q = k = v = torch.randn(1, 2, 3, 4)
    pos = torch.arange(3)[None]
    with pytest.raises(ValueError, match=r"cached_attention: q must be a \(B, H, N, D\) tensor, got \(2, 3, 4\)"):
        cached_attention(q[0], k, v)
    with pytest.raises(ValueError, match="v must be a .* got list"):
        cached_attention(q, k, [1])
    with pytest.raises(ValueError, match=r"positions must be a \(B, N\) = \(1, 3\).*batch_positions.*got \(3,\)"):
        cached_attention(q, k, v, positions=torch.arange(3))
    with pytest.raises(ValueError, match="window must be a positive int.*causal=True, got window=0"):
        cached_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="window=2, causal=False"):
        cached_attention(q, k, v, window=2, causal=False)
    with pytest.raises(TypeError, match="position_bias must be a qkv.pos.PositionalBias.*score_mod"):
        cached_attention(q, k, v, position_bias=mods.softcap(3.0))
    with pytest.raises(ValueError, match="rotate needs rope"):
        cached_attention(q, k, v, rotate=lambda a, b: (a, b))
    with pytest.raises(TypeError, match="MyOwner: cache must follow qkv.cache.AttentionCache.*got dict"):
        cached_attention(q, k, v, cache={}, positions=pos, owner="MyOwner")
    with pytest.raises(ValueError, match="a cache needs positions"):
        cached_attention(q, k, v, cache=KVCache([FullSpec(2, 4)]))
    with pytest.raises(ValueError, match="step_mask is the mask of a call without a cache"):
        cached_attention(q, k, v, cache=KVCache([FullSpec(2, 4)]), positions=pos, step_mask=masks.causal())
    with pytest.raises(ValueError, match=r"head_gate must be a \(2,\) tensor"):
        cached_attention(q, k, v, head_gate=torch.ones(3))


def test_attention_mask_and_plain_decode_step():
    pos = torch.arange(4)[None]
    allowed = attention_mask(pos, pos, causal=True, window=2).materialize(1, 1, 4, 4)
    assert allowed[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                      [False, True, True, False], [False, False, True, True]]
    assert attention_mask(None, None, causal=False) is None
    assert attention_mask(None, None, causal=False, mask=masks.causal()) is not None
    with pytest.raises(ValueError, match="pass both q_positions and kv_positions"):
        attention_mask(pos, None, causal=True)
    with pytest.raises(ValueError, match="window=3 needs causal=True"):
        attention_mask(None, None, causal=False, window=3)
    assert plain_decode_step(1, attention_fn=qkv.attention, backend="auto")
    for kw in (dict(backend="sdpa"), dict(causal=False), dict(mask=masks.causal()), dict(sinks=torch.zeros(2)),
               dict(dropout_p=0.1), dict(score_mod=mods.softcap(2.0))):
        assert not plain_decode_step(1, **{"attention_fn": qkv.attention, "backend": "auto", **kw}), kw
    assert not plain_decode_step(2, attention_fn=qkv.attention, backend="auto")
    assert not plain_decode_step(1, attention_fn=lambda *a, **k: None, backend="auto")


def test_docstring_examples_run():
    import qkv.nn.cached as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result


def test_single_query_step_defers_the_paged_view_only_for_the_default_decode_backend(monkeypatch):
    """A plain one-query step over a paged cache asks for no view (``defer_view``) and offers the step to
    ``cache.decode``; with another single-query backend (``decode_backend="tiled"``) the cache builds the view
    eagerly and the operator runs on that backend. Both give the same attention."""
    from qkv.cache import Paged

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    outs, seen = {}, []
    real_update, real_decode = KVCache.update, KVCache.decode

    def update(self, *a, **kw):
        seen.append(("update", kw.get("defer_view", False)))
        return real_update(self, *a, **kw)

    def decode(self, *a, **kw):
        seen.append(("decode", None))
        return real_decode(self, *a, **kw)

    monkeypatch.setattr(KVCache, "update", update)
    monkeypatch.setattr(KVCache, "decode", decode)
    for backend in ("sdpa", "tiled"):
        cache = KVCache([FullSpec(2, 8)], storage=Paged(block_size=4, num_blocks=16))
        cached_attention(q.expand(2, 4, 5, 8), k[:, :, :5], v[:, :, :5], cache=cache,
                         positions=torch.arange(5).expand(2, 5), decode_backend=backend)
        seen.clear()
        outs[backend] = cached_attention(q, k[:, :, 5:], v[:, :, 5:], cache=cache,
                                         positions=torch.full((2, 1), 5), decode_backend=backend).out
        want = [("update", True), ("decode", None)] if backend == "sdpa" else [("update", False)]
        assert seen == want, (backend, seen)
    assert torch.allclose(outs["sdpa"], outs["tiled"], atol=1e-6)


def _keep_caches():
    """Every kind of cache the last-queries path meets: none, contiguous, paged (in-place kernels), the
    base protocol, a decoding base cache (its own float64 decode), a scoring cache (H2O: sees every query)."""
    return {
        "none": lambda: None,
        "kvcache": lambda: KVCache([FullSpec(2, 8)]),
        "paged": lambda: KVCache([FullSpec(2, 8)], storage=Paged(block_size=4, num_blocks=16)),
        "base": BaseCache,
        "decoding-base": DecodingBaseCache,
        "h2o": lambda: KVCache([FullSpec(2, 8)], policy=H2O(heavy=16, recent=16)),
    }


@pytest.mark.parametrize("window", [None, 4], ids=["full", "window4"])
@pytest.mark.parametrize("store", sorted(_keep_caches()))
def test_queries_to_keep_are_the_last_rows_of_the_full_call(store, window):
    """``queries_to_keep=n``: the last n rows of the full call's output (and log-sum-exp), every key still stored,
    so the next single-query step equals the full path's; left padding on one row; RoPE at absolute positions."""
    make = _keep_caches()[store]
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, N, D = 2, 4, 2, 9, 8
    q, k, v = (torch.randn(B, h, N + 1, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    pos = torch.arange(N + 1).expand(B, N + 1).clone()
    pos[1, :2] = -1
    pos[1, 2:] -= 2
    rope = RotaryEmbedding(D)

    def prefill(cache, keep):
        return cached_attention(q[:, :, :N], k[:, :, :N], v[:, :, :N], cache=cache, positions=pos[:, :N], rope=rope,
                                window=window, return_lse=store != "paged", queries_to_keep=keep)

    def step(cache):
        return cached_attention(q[:, :, N:], k[:, :, N:], v[:, :, N:], cache=cache, positions=pos[:, N:], rope=rope,
                                window=window).out

    for keep in (1, 3, N, N + 4):
        full_cache, cache = make(), make()
        full, res = prefill(full_cache, 0), prefill(cache, keep)
        n = min(keep, N)
        assert res.out.shape == (B, Hq, n, D)
        torch.testing.assert_close(res.out, full.out[:, :, N - n:], atol=1e-12, rtol=0)
        if res.lse is not None:
            torch.testing.assert_close(res.lse, full.lse[:, :, N - n:], atol=1e-12, rtol=0)
        if cache is None:
            continue
        if store == "base":
            assert cache.observed[-1][1].shape[2] == N, "observe sees every query of the step"
        torch.testing.assert_close(step(cache), step(full_cache), atol=1e-12, rtol=0)  # every key was stored


def test_queries_to_keep_on_a_scoring_cache_shows_every_query():
    """H2O ranks tokens by the attention every query paid: the cache observes all N queries and keeps what the
    full call keeps; only the last rows are returned."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, h, 12, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    pos = torch.arange(12)[None]
    caches = [KVCache([FullSpec(2, 8)], policy=H2O(heavy=3, recent=3)) for _ in range(2)]
    full = cached_attention(q, k, v, cache=caches[0], positions=pos)
    kept = cached_attention(q, k, v, cache=caches[1], positions=pos, queries_to_keep=2)
    torch.testing.assert_close(kept.out, full.out[:, :, -2:], atol=1e-12, rtol=0)
    nxt = [cached_attention(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], cache=c, positions=torch.tensor([[12]])).out
           for c in caches]
    torch.testing.assert_close(nxt[1], nxt[0], atol=1e-12, rtol=0)
    views = [c.view(0) for c in caches]
    assert torch.equal(views[0].kv_positions, views[1].kv_positions)  # the same tokens evicted


def test_queries_to_keep_reach_the_decode_kernel_as_a_single_query():
    """On a paged cache the last query of a prompt chunk goes to the single-query kernel with that column's
    position; the decoding base cache gets the kept queries only."""
    cache = DecodingBaseCache()
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 6, 8, dtype=torch.float64), torch.randn(2, 2, 6, 8, dtype=torch.float64)
    cached_attention(q, k, v, cache=cache, positions=torch.arange(6).expand(2, 6), queries_to_keep=1)
    assert [shape for _, shape, _, _ in cache.calls] == [(2, 4, 1, 8)]


@pytest.mark.parametrize("bad", [-1, 1.5, True, None, "1"])
def test_queries_to_keep_refuses_bad_values(bad):
    q = k = v = torch.randn(1, 2, 3, 4)
    cache = KVCache([FullSpec(2, 4)])
    with pytest.raises(ValueError, match=r"queries_to_keep must be an int >= 0 .* got"):
        cached_attention(q, k, v, cache=cache, positions=torch.arange(3)[None], queries_to_keep=bad)
    assert cache.seq_length == 0  # refused before anything is stored


def test_kv_cache_decode_refuses_more_queries_than_the_step():
    cache = KVCache([FullSpec(2, 8)], storage=Paged(block_size=4, num_blocks=16))
    k = v = torch.randn(1, 2, 3, 8)
    cache.update(0, k, v, positions=torch.arange(3)[None])
    with pytest.raises(ValueError, match=r"decode: q must be \(B, Hq, n, D\) with B = 1 and 1 <= n <= 3"):
        cache.decode(0, torch.randn(1, 4, 4, 8), scale=0.3)
