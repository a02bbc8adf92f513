"""Issue 29 item 14: generation with a tight paged pool, sliding-window layers whose blocks are released and
recycled between rows of different lengths, against dynamic storage (greedy tokens and logits)."""

import pytest
import torch

from _toy_lm import ToyLM, single_thread  # noqa: F401 (single_thread: autouse fixture)
from qkv.cache import Dynamic, KVCache, Paged
from qkv.models.generate import generate


def _batch(lengths, n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 61, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        mask[b, n - length:] = 1  # left padding
    return ids * mask, mask


@pytest.mark.parametrize("block", [2, 3], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("window", [3, 5], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("lengths", [(9, 2, 5), (3, 11)], ids=lambda ls: "len" + "-".join(map(str, ls)))
def test_tight_paged_pool_with_recycled_window_blocks_matches_dynamic(block, window, lengths):
    model = ToyLM(layers=(("window", window), ("window", window)), seed=7).eval()
    n, new = max(lengths), 10
    ids, mask = _batch(lengths, n, seed=block * 10 + window)
    # tight: the prompts' blocks plus one spare per row, so released window blocks are recycled at once
    tight = sum(-(-length // block) for length in lengths) + len(lengths)
    full_blocks = sum(-(-(length + new) // block) for length in lengths)
    paged = KVCache(model, storage=Paged(block_size=block, num_blocks=tight))
    out = generate(model, ids, attention_mask=mask, max_new_tokens=new, cache=paged, return_logits=True)
    ref = generate(model, ids, attention_mask=mask, max_new_tokens=new, cache=KVCache(model, storage=Dynamic()),
                   return_logits=True)
    assert torch.equal(out.new_tokens, ref.new_tokens), (out.new_tokens, ref.new_tokens)
    err = (out.logits - ref.logits).abs().max().item()
    assert err < 1e-4, f"logits off by {err:.3g}"
    windows = paged.pool_stats()[f"sliding_window_{window}"]
    assert windows.blocks_in_use < full_blocks, "the window layers should have released blocks for reuse"
