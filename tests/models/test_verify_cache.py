"""Cached decoding equals full recomputation: ``verify_cache`` over every lossless spec x storage, the
sliding-window boundary, chunked prefill, crop, fork and prefix-cache hits; lossy caches within their
stated bounds (a multiple of what the correct implementation measures); a heavy-hitter model on which H2O must beat
random eviction; and checks that a broken cache (lost bit, a neighbour group's scale, dropped residual, wrong
tokens kept, missing copy-on-write, wrong positions) is caught."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from _toy_lm import ToyLM, single_thread  # noqa: F401 (single_thread: autouse fixture)
from qkv.cache import H2O, KIVI, Dynamic, Int8, KVCache, Paged, SlidingWindowSpec, SnapKV, Static, StreamingLLM
from qkv.cache import policies as policies_mod
from qkv.cache import quant as quant_mod
from qkv.cache.paged import blocks as paged_mod
from qkv.cache.policies import HeadwiseStore, _H2ORule
from qkv.models.verify import verify_cache

W = 6
TOYS = {
    "gqa": ("full", "full"),
    "hybrid": (("window", W), ("window", W), "full"),  # Gemma-style local:global
    "mla-window": ("latent", ("window", W)),
}
STORAGES = {
    "dynamic": Dynamic(),
    "static": Static(40),
    "paged": Paged(block_size=4, num_blocks=96, prefix_caching=True),
}


def _toy(name):
    return ToyLM(layers=TOYS[name], seed=1).eval()


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("model", list(TOYS))
def test_lossless_toy(model, storage):
    m = _toy(model)
    report = verify_cache(m, lambda: KVCache(m, storage=STORAGES[storage], rollback=2), prompt_lengths=(11, 7),
                          prefill_chunk_size=3, crop=2)
    names = {c.name for c in report.checks}
    assert {"decode", "crop", "fork"} <= names
    assert ("prefix" in names) == (storage == "paged")


@pytest.mark.parametrize("chunk", [None, 1, W - 1, W, W + 1], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("storage", list(STORAGES))
def test_window_boundary(storage, chunk):
    """Rows of W+1, W and W-1 prompt tokens in one left-padded batch, decoded past the window."""
    m = _toy("hybrid")
    verify_cache(m, lambda: KVCache(m, storage=STORAGES[storage], rollback=3), prompt_lengths=(W + 1, W, W - 1),
                 max_new_tokens=W + 2, prefill_chunk_size=chunk, crop=3, fork=chunk is None, prefix=chunk is None)


def _decoder_lm(name):
    from qkv import nn

    torch.manual_seed(0)
    return nn.DecoderLM(nn.get_config(name)).eval()


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma"])
def test_lossless_decoder_lm(preset, storage):
    m = _decoder_lm(preset)
    verify_cache(m, lambda: KVCache(m, storage=STORAGES[storage], rollback=2), prompt_lengths=(13, 9),
                 prefill_chunk_size=5, max_new_tokens=5)


@pytest.mark.parametrize("storage", ["dynamic", "paged"])
def test_lossless_deepseek_mla(storage):
    """The real MLA layer (qkv.nn.latent) through ``update_latent``, in the DeepSeek-V2 model."""
    from qkv.models import family_deepseek as family  # qkv's own module: a broken import must fail, not skip
    cfg = dict(model_type="deepseek_v2", vocab_size=128, hidden_size=64, intermediate_size=128,
               moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16,
               q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
               n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, rms_norm_eps=1e-6,
               rope_theta=10000.0, max_position_embeddings=256)
    torch.manual_seed(0)
    m = family.build(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    assert all(s.kind == "latent" for s in m.cache_specs())
    verify_cache(m, lambda: KVCache(m, storage=STORAGES[storage], rollback=2), prefill_chunk_size=3)


# Lossy caches on the toy model (logits with a standard deviation of about 2.4), prompts of 16 and 12 tokens and 8
# new ones: each bound is MARGIN times the largest absolute logit error the correct implementation measures over
# every decode, crop and fork step (the number beside it). The errors are deterministic (fixed seeds, one thread),
# so the margin only absorbs a BLAS that sums in another order; a defect costs far more (tests below inject them).
#
# Expected size of the quantization errors: every element is rounded to a grid of step ``span / (2**bits - 1)``
# over its group (KIVI: keys per channel over 4 tokens, values per token over 4 channels; int8: per token over the
# 16 channels of a head), so it moves by at most half a step, and the logit error, first order in those moves,
# scales with the step: int2 over int4 is (15 / 3) = 5 times the step at the same groups (measured 6.5), and
# dropping one bit (a signed code range, qmax = 2**(bits-1) - 1) roughly doubles it (measured 2.3x, 3.3x, 2.2x).
# Reading a neighbour group's scale costs 5-40x (kivi4 0.90, kivi2 0.77). The eviction policies' errors have no
# such closed form on this model (diffuse attention): StreamingLLM keeping the wrong tokens measures 1.30 (1.47x),
# while H2O and SnapKV are checked on the heavy-hitter model further down, where a wrong choice costs 10-25x.
MARGIN = 1.25
LOSSY = {
    "kivi4-g4": (lambda m: KVCache(m, quant=KIVI(bits=4, group_size=4, residual=4)), 0.0222),
    "kivi2-g4": (lambda m: KVCache(m, quant=KIVI(bits=2, group_size=4, residual=4)), 0.145),
    "int8": (lambda m: KVCache(m, quant=Int8()), 0.0039),
    "streaming": (lambda m: KVCache(m, policy=StreamingLLM(n_sink=2, window=8)), 0.884),
    "h2o": (lambda m: KVCache(m, policy=H2O(heavy=5, recent=5)), 1.34),
    "snapkv": (lambda m: KVCache(m, policy=SnapKV(budget=10, window=3, kernel_size=3)), 0.527),
}


def _worst(m, make, **kw) -> float:
    """Largest absolute logit error of ``make``'s caches over decode, crop and fork (never raises)."""
    kw = {"prompt_lengths": (16, 12), **kw}
    report = verify_cache(m, make, max_new_tokens=8, tolerance=100.0, raise_on_failure=False, **kw)
    assert all(c.max_error < float("inf") for c in report.checks), str(report)
    return max(c.max_error for c in report.checks)


def _lossy(name, m, **kw):
    factory, measured = LOSSY[name]
    kw = {"prompt_lengths": (16, 12), **kw}
    return verify_cache(m, lambda: factory(m), max_new_tokens=8, tolerance=MARGIN * measured, **kw)


@pytest.mark.parametrize("name", list(LOSSY))
def test_lossy_within_stated_bound(name):
    report = _lossy(name, _toy("gqa"))
    assert max(c.max_error for c in report.checks) > 1e-4, "a lossy cache that is exact tests nothing here"


def test_quantization_error_scales_with_the_step():
    """int2 and int4 KIVI at the same groups: the logit error ratio follows the step ratio (15 / 3 = 5) within a
    factor of 2, and every stored element lies within half a step of its original (the store's own record)."""
    m = _toy("gqa")
    caches = {2: [], 4: []}

    def make(bits):
        def factory():
            caches[bits].append(KVCache(m, quant=KIVI(bits=bits, group_size=4, residual=4)))
            return caches[bits][-1]
        return factory

    err = {bits: _worst(m, make(bits)) for bits in caches}
    step_ratio = (2**4 - 1) / (2**2 - 1)
    assert step_ratio / 2 <= err[2] / err[4] <= step_ratio * 2, \
        f"logit error int2 {err[2]:.4f} / int4 {err[4]:.4f} = {err[2] / err[4]:.2f}; the step ratio is {step_ratio}"
    for bits, made in caches.items():
        used = [e for c in made if (e := c.quant_error()).key_bound > 0]  # verify_cache also asks one for its kind
        assert len(used) >= 2, f"int{bits}: {len(used)} of {len(made)} caches quantized anything"
        for e in used:
            assert 0 < e.key_max_error <= e.key_bound and 0 < e.value_max_error <= e.value_bound, f"int{bits}: {e}"


def test_kivi_exact_while_tokens_fit_the_residual():
    """With a residual of 32, the 24 tokens of each row stay in full precision: cached decoding is exact."""
    m = _toy("gqa")
    verify_cache(m, lambda: KVCache(m, quant=KIVI(bits=2, group_size=4, residual=32)), prompt_lengths=(16, 12),
                 max_new_tokens=8)


def _over_bound(report) -> None:
    """The report fails because a finite logit error exceeds what is allowed (not because the defect crashed)."""
    bad = [c for c in report.checks if not c.ok]
    assert bad, f"the injected defect went unnoticed:\n{report}"
    assert all(c.allowed < c.max_error < float("inf") for c in bad), f"failed for another reason:\n{report}"


def _signed_range(orig):
    """Defect: codes in the signed range ``[0, 2**(bits-1) - 1]``, one bit lost."""
    return lambda x, bits, dim: orig(x, bits - 1, dim)


def _no_residual(orig):
    """Defect: the full-precision residual window is dropped (every token quantized as it arrives)."""
    def store_for(self, spec, *, layer):
        store = orig(self, spec, layer=layer)
        store.residual = 0
        return store
    return store_for


def _neighbour_scale(orig):
    """Defect: each group is stored with the scale and zero-point of the group before it (an index off by one)."""
    def quantize(x, bits, dim):
        codes, scale, zero = orig(x, bits, dim)
        return codes, scale.roll(1, dims=dim - 1), zero.roll(1, dims=dim - 1)
    return quantize


QUANT_DEFECTS = {"lost-bit": _signed_range, "neighbour-group-scale": _neighbour_scale}


@pytest.mark.parametrize("name, defect", [(n, d) for d in QUANT_DEFECTS for n in ("kivi4-g4", "kivi2-g4", "int8")
                                          if not (n == "int8" and d == "neighbour-group-scale")])  # int8: one group
def test_bound_catches_a_broken_quantizer(name, defect, monkeypatch):
    monkeypatch.setattr(quant_mod, "quantize_groups", QUANT_DEFECTS[defect](quant_mod.quantize_groups))
    _over_bound(_lossy(name, _toy("gqa"), raise_on_failure=False))


def test_residual_check_catches_a_dropped_residual(monkeypatch):
    monkeypatch.setattr(KIVI, "store_for", _no_residual(KIVI.store_for))
    m = _toy("gqa")
    _over_bound(verify_cache(m, lambda: KVCache(m, quant=KIVI(bits=2, group_size=4, residual=32)),
                             prompt_lengths=(16, 12), max_new_tokens=8, raise_on_failure=False))


def _evict_the_most_important(monkeypatch):
    """Defect: every policy's selection keeps the lowest-ranked slots instead of the highest."""
    monkeypatch.setattr(policies_mod, "_topk_sorted",
                        lambda score, k: (-score).topk(k, dim=-1).indices.sort(dim=-1).values)


def test_bound_catches_streaming_keeping_the_wrong_tokens(monkeypatch):
    _evict_the_most_important(monkeypatch)
    _over_bound(_lossy("streaming", _toy("gqa"), raise_on_failure=False))


class _RandomRule(_H2ORule):
    """H2O's budget and recent window, with the "heavy" tokens drawn at random: the control."""

    def __init__(self, heavy: int, recent: int, seed: int) -> None:
        super().__init__(heavy, recent)
        self.gen = torch.Generator().manual_seed(seed)

    def observe(self, st, q, view, scale) -> None:
        st.score.copy_(torch.rand(st.score.shape, generator=self.gen))


@dataclass(frozen=True)
class _RandomEviction(H2O):
    seed: int = 0

    def store_for(self, spec, *, layer):
        return HeadwiseStore(_RandomRule(self.heavy, self.recent, self.seed))


@pytest.mark.parametrize("name", ["streaming", "snapkv"])
def test_policy_beats_random_eviction(name):
    """A policy that keeps the tokens that matter errs less than keeping a random set of the same size with
    the same recent window (10 tokens of 24 here), in every one of several random draws. H2O is not in this
    list: on this random-weight toy model attention is diffuse and no token is a heavy hitter (it measures 1.34
    against random's 1.06-1.18); the heavy-hitter model below is its control."""
    m = _toy("gqa")
    factory, _ = LOSSY[name]
    ours = _worst(m, lambda: factory(m))
    controls = [_worst(m, lambda s=s: KVCache(m, policy=_RandomEviction(heavy=5, recent=5, seed=s))) for s in range(3)]
    assert ours < min(controls), f"{name}: max logit error {ours:.3f} vs random eviction {controls}"


HEAVY = 0  # the token whose key dominates attention in the heavy-hitter model


def _heavy_hitter_toy():
    """The toy model made to have a heavy hitter, with prompts that open with it (as a BOS token would).

    Residual channel 0 is 4 for every token and channel 1 is 8 for token ``HEAVY`` only (0 elsewhere); in every
    layer, channel 0 feeds each query's dimension 7 and channel 1 each key's dimension 7 (keys ignore channel 0).
    Dimensions 7 and 15 are the slowest RoPE pair (3e-4 rad per position), so that score is about the same at
    every distance, and ``HEAVY``'s key takes about 87% of every query's attention. Eviction that keeps the
    tokens attention reached keeps it; a random choice loses it.
    """
    m = _toy("gqa")
    with torch.no_grad():
        E = m.embed.weight
        E[:, 0], E[:, 1] = 4.0, 0.0
        E[HEAVY, 1] = 8.0
        for block in m.blocks:
            a = block.attn
            slow = a.D // 2 - 1
            a.k.weight[:, :2] = 0.0
            a.k.weight[slow::a.D, 1] = 1.0
            a.q.weight[slow::a.D, 0] = 1.0
    lengths = (16, 12)
    N = max(lengths)
    ids = torch.randint(HEAVY + 1, m.vocab, (len(lengths), N), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, N - n:] = 1
        ids[row, N - n] = HEAVY
    return m, ids, mask


# On the heavy-hitter model: the correct implementation's largest logit error (the bound is MARGIN times it).
HEAVY_LOSSY = {"h2o": 0.290, "snapkv": 0.154, "streaming": 0.307}


def _heavy(name, **kw):
    m, ids, mask = _heavy_hitter_toy()
    factory, _ = LOSSY[name]
    return verify_cache(m, lambda: factory(m), input_ids=ids, attention_mask=mask, max_new_tokens=8,
                        tolerance=MARGIN * HEAVY_LOSSY[name], **kw)


@pytest.mark.parametrize("name", list(HEAVY_LOSSY))
def test_heavy_hitter_within_stated_bound(name):
    report = _heavy(name)
    assert max(c.max_error for c in report.checks) > 1e-4, "a lossy cache that is exact tests nothing here"


def test_heavy_hitter_is_one():
    """The construction works: the key of ``HEAVY`` takes most of the last query's attention in every layer."""
    from _toy_lm import rope

    m, ids, mask = _heavy_hitter_toy()
    pos = torch.arange(ids.shape[1]) - (ids.shape[1] - mask.sum(1, keepdim=True))  # (B, N), -k for padding
    first = ids.shape[1] - mask.sum(1)
    with torch.no_grad():
        x = m.embed(ids)
        for block in m.blocks:
            a, h = block.attn, block.n1(x)
            B, N, _ = h.shape
            q = rope(a.q(h).view(B, N, a.H, a.D).transpose(1, 2), pos)
            k = rope(a.k(h).view(B, N, a.Hkv, a.D).transpose(1, 2), pos).repeat_interleave(a.H // a.Hkv, 1)
            scores = torch.einsum("bhd,bhnd->bhn", q[:, :, -1], k) * a.D**-0.5  # the last query's scores
            scores = scores.masked_fill((pos < 0).view(B, 1, N), float("-inf"))
            share = scores.softmax(-1)[torch.arange(B), :, first]  # (B, H)
            assert share.min() > 0.5, f"HEAVY's share of attention per row and head: {share}"
            x = block(x, pos, None)


def test_h2o_beats_random_eviction_when_one_key_dominates():
    """H2O keeps the heavy hitter; random choices of the same budget (3 seeds) lose it in some head and step."""
    m, ids, mask = _heavy_hitter_toy()
    kw = dict(input_ids=ids, attention_mask=mask)
    ours = _worst(m, lambda: KVCache(m, policy=H2O(heavy=5, recent=5)), **kw)
    controls = [_worst(m, lambda s=s: KVCache(m, policy=_RandomEviction(heavy=5, recent=5, seed=s)), **kw)
                for s in range(3)]
    assert 3 * ours < min(controls), f"H2O max logit error {ours:.3f} vs random eviction {controls}"


@pytest.mark.parametrize("name", list(HEAVY_LOSSY))
def test_heavy_hitter_bound_catches_evicting_the_most_important(name, monkeypatch):
    _evict_the_most_important(monkeypatch)
    _over_bound(_heavy(name, raise_on_failure=False))


@pytest.mark.parametrize("factory", [
    lambda m: KVCache(m, policy=StreamingLLM(n_sink=2, window=64)),
    lambda m: KVCache(m, policy=H2O(heavy=32, recent=32)),
    lambda m: KVCache(m, policy=SnapKV(budget=64, window=4)),
], ids=["streaming", "h2o", "snapkv"])
def test_policies_exact_under_budget(factory):
    m = _toy("gqa")
    verify_cache(m, lambda: factory(m), prompt_lengths=(16, 12), max_new_tokens=8)


def test_catches_missing_copy_on_write(monkeypatch):
    m = _toy("gqa")
    monkeypatch.setattr(paged_mod.BlockGroup, "shared", lambda self, b: False)
    report = verify_cache(m, lambda: KVCache(m, storage=Paged(block_size=4, num_blocks=64)), prompt_lengths=(9, 6),
                          raise_on_failure=False)
    bad = {c.name for c in report.checks if not c.ok}
    assert "fork" in bad, str(report)


def test_catches_too_small_window():
    m = _toy("hybrid")
    specs = [SlidingWindowSpec(W - 2, 2, 16) if isinstance(s, SlidingWindowSpec) else s for s in m.cache_specs()]
    with pytest.raises(AssertionError, match="decode"):
        verify_cache(m, lambda: KVCache(specs, storage=Static(40)), prompt_lengths=(11, 7), fork=False)


def test_catches_wrong_padding_positions():
    m = _toy("gqa")

    class Shifted(KVCache):
        def update(self, layer_idx, k, v, *, positions, rope=None):
            return super().update(layer_idx, k, v, positions=positions.clamp_min(0), rope=rope)

    with pytest.raises(AssertionError, match="decode"):
        verify_cache(m, lambda: Shifted(m), prompt_lengths=(11, 5), fork=False, crop=0)
