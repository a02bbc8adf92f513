"""``generate``: left padding, greedy, sampling (temperature, top-k, top-p, seeded), stop tokens,
streaming, chunked prefill, prefix reuse, and its errors."""

from __future__ import annotations

import pytest
import torch

from _toy_lm import ToyLM, single_thread  # noqa: F401 (single_thread: autouse fixture)
from qkv.cache import KVCache, Paged
from qkv.models.generate import generate, prompt_positions, sample_next
from qkv.testing import max_error


@pytest.fixture(scope="module")
def model():
    return ToyLM(layers=("full", ("window", 5)), seed=2).eval()


def _batch(lengths, vocab=61, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), N), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, N - n:] = 1
    return ids * mask, mask


def test_prompt_positions():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert prompt_positions(mask).tolist() == [[-1, -1, 0, 1], [0, 1, 2, 3]]
    with pytest.raises(ValueError, match="left"):
        prompt_positions(torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="at least one"):
        prompt_positions(torch.tensor([[0, 0]]))


def test_left_padded_batch_equals_each_row_alone(model):
    ids, mask = _batch([9, 4, 6])
    batched = generate(model, ids, attention_mask=mask, max_new_tokens=7, return_logits=True)
    for b in range(3):
        row = ids[b][mask[b].bool()].view(1, -1)
        alone = generate(model, row, max_new_tokens=7, return_logits=True)
        assert torch.equal(alone.new_tokens[0], batched.new_tokens[b])
        assert max_error(alone.logits[0], batched.logits[b]) < 1e-4


def test_cache_equals_recompute_and_chunks(model):
    ids, mask = _batch([11, 8])
    full = generate(model, ids, attention_mask=mask, max_new_tokens=6, use_cache=False, return_logits=True)
    for chunk in (None, 1, 4):
        out = generate(model, ids, attention_mask=mask, max_new_tokens=6, prefill_chunk_size=chunk, return_logits=True)
        assert torch.equal(out.new_tokens, full.new_tokens), chunk
        assert max_error(out.logits, full.logits) < 1e-4, chunk
        assert out.sequences.shape == (2, 11 + 6)
        assert torch.equal(out.sequences[:, :11], ids)


def test_prefill_asks_for_last_column_logits_only(model):
    """A model whose forward takes ``logits_to_keep`` computes the prompt's last column only; the tokens
    are those of a model that returns every column."""
    seen = []

    class KeepsLast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, ids, *, positions=None, cache=None, logits_to_keep=0):
            seen.append((ids.shape[1], logits_to_keep))
            out = self.inner(ids, positions=positions, cache=cache)
            return out[:, -logits_to_keep:] if logits_to_keep else out

        def cache_specs(self):
            return self.inner.cache_specs()

    ids, mask = _batch([9, 6])
    for cache in (True, False):
        seen.clear()
        out = generate(KeepsLast(), ids, attention_mask=mask, max_new_tokens=4, use_cache=cache)
        ref = generate(model, ids, attention_mask=mask, max_new_tokens=4, use_cache=cache)
        assert torch.equal(out.new_tokens, ref.new_tokens)
        assert all(keep == 1 for n, keep in seen if n > 1) and seen[0] == (9, 1), seen


def test_greedy_is_argmax(model):
    ids, mask = _batch([7])
    out = generate(model, ids, max_new_tokens=5, return_logits=True)
    assert torch.equal(out.logits.argmax(-1), out.new_tokens)


def test_sampling_is_seeded(model):
    ids, mask = _batch([7, 5])
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=1.5, top_k=20, top_p=0.95)
    a = generate(model, ids, generator=torch.Generator().manual_seed(3), **kw).new_tokens
    b = generate(model, ids, generator=torch.Generator().manual_seed(3), **kw).new_tokens
    c = generate(model, ids, generator=torch.Generator().manual_seed(4), **kw).new_tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    ids, mask = _batch([7, 5])
    greedy = generate(model, ids, attention_mask=mask, max_new_tokens=6).new_tokens
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        out = generate(model, ids, attention_mask=mask, max_new_tokens=6, do_sample=True, temperature=2.0,
                       generator=torch.Generator().manual_seed(0), **kw)
        assert torch.equal(out.new_tokens, greedy), kw


def test_top_k_and_top_p_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    k = sample_next(logits, do_sample=True, top_k=3, temperature=5.0, generator=g)
    assert set(k.tolist()) == {0, 1, 2}
    p = torch.softmax(logits[0], -1)  # 0.64, 0.23, 0.09, ...: top_p=0.8 keeps tokens 0 and 1
    assert float(p[:1].sum()) < 0.8 <= float(p[:2].sum())
    t = sample_next(logits, do_sample=True, top_p=0.8, generator=g)
    assert set(t.tolist()) == {0, 1}
    share = (t == 0).float().mean().item()  # renormalized: 0.64 / (0.64 + 0.23)
    assert abs(share - float(p[0] / p[:2].sum())) < 0.03


def test_stop_tokens_and_streamer(model):
    ids, mask = _batch([7, 5])
    free = generate(model, ids, attention_mask=mask, max_new_tokens=8).new_tokens
    eos = int(free[0, 2])
    seen = []
    out = generate(model, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[eos], pad_token_id=60,
                   streamer=lambda t: seen.append(t.clone()))
    first = (free[0] == eos).nonzero()[0].item()
    assert out.finished[0]
    assert torch.equal(out.new_tokens[0, :first + 1], free[0, :first + 1])
    assert (out.new_tokens[0, first + 1:] == 60).all()
    assert len(seen) == out.new_tokens.shape[1]
    assert torch.equal(torch.stack(seen, 1), out.new_tokens)
    if not out.finished[1]:
        row1 = free[1][:out.new_tokens.shape[1]]
        assert torch.equal(out.new_tokens[1], row1)


def test_stops_early_when_all_rows_finish(model):
    ids, _ = _batch([6])
    free = generate(model, ids, max_new_tokens=6).new_tokens
    out = generate(model, ids, max_new_tokens=6, eos_token_id=int(free[0, 1]))
    assert out.new_tokens.shape[1] <= 2 and out.finished.all()


def test_prefix_reuse_through_generate(model):
    ids, mask = _batch([13, 10])
    cache = KVCache(model, storage=Paged(block_size=4, num_blocks=64, prefix_caching=True))
    first = generate(model, ids, attention_mask=mask, max_new_tokens=5, cache=cache, return_logits=True)
    assert first.prefix_hits.tolist() == [0, 0]
    cache.reset()
    again = generate(model, ids, attention_mask=mask, max_new_tokens=5, cache=cache, return_logits=True)
    assert again.prefix_hits.tolist() == [12, 8]  # whole blocks, never the last prompt token
    assert torch.equal(again.new_tokens, first.new_tokens)
    assert max_error(again.logits, first.logits) < 1e-4
    cache.reset()
    other = generate(model, ids, attention_mask=mask, max_new_tokens=5, cache=cache, salt="tenant-b")
    assert other.prefix_hits.tolist() == [0, 0]


def test_errors(model):
    ids, mask = _batch([5, 3])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, max_new_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, ids, max_new_tokens=2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, ids, max_new_tokens=2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="attention_mask must match"):
        generate(model, ids, attention_mask=mask[:, 1:], max_new_tokens=2)
    used = generate(model, ids, attention_mask=mask, max_new_tokens=2).cache
    with pytest.raises(ValueError, match="fresh cache"):
        generate(model, ids, attention_mask=mask, max_new_tokens=2, cache=used)


@pytest.mark.parametrize("V", [7, 1024, 1031, 32000, 50257])
def test_greedy_equals_argmax_with_ties_infinities_and_nans(V):
    """generate's greedy pick (block maxima, then one block) is torch's argmax: the first index of the
    maximum, ties across and inside blocks, rows of -inf, a larger value in the tail past the last whole block,
    NaN rows (torch's argmax answers those)."""
    from qkv.models.generate import greedy

    g = torch.Generator().manual_seed(V)
    x = torch.randn(9, V, generator=g)
    x[1] = 0.0  # all tied: index 0
    x[2] = float("-inf")
    x[3, V // 2] = x[3, V - 1] = 50.0  # tie: the earlier one
    x[4, V - 1] = 60.0  # the tail (or last block) alone
    x[5, V // 3] = float("nan")
    x[6, -1] = float("nan")
    x[7] = torch.randint(0, 3, (V,), generator=g).float()  # many ties
    x[8, 0] = x[8].max() + 1
    assert torch.equal(greedy(x), x.argmax(-1))
    assert torch.equal(greedy(x.t().contiguous().t()), x.argmax(-1))  # non-contiguous: torch's argmax itself
