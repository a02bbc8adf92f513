"""Issue 29 item 15: crop, append, then reuse the prefix. After ``crop`` a row's last block may be held only by
the prefix index; appending must copy it first, so a later prefix hit reads the tokens that were indexed."""

import torch

from qkv.cache import FullSpec, KVCache, Paged

T, H, D = 4, 1, 4


def _step(cache, ids, start, seed):
    n = ids.shape[1]
    pos = torch.arange(start, start + n)[None]
    g = torch.Generator().manual_seed(seed)
    k, _v = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)
    cache.prepare(ids, pos)
    return k, cache.update(0, k, torch.randn(1, H, n, D), positions=pos)


def _keys_by_position(view):
    p = view.kv_positions[0]
    keep = (p >= 0).nonzero().flatten()
    return {int(p[j]): view.k[0, :, j] for j in keep}


def test_crop_then_append_does_not_overwrite_an_indexed_block():
    cache = KVCache([FullSpec(H, D)], storage=Paged(block_size=T, num_blocks=16, prefix_caching=True))
    prompt = torch.arange(1, 10)[None]  # 9 tokens: blocks 0..3 and 4..7 full (indexed), one token more
    k_prompt, _ = _step(cache, prompt, 0, seed=0)
    cache.crop(6)  # positions 0..5 stay: the second block is now partial in the row, still indexed as full
    _step(cache, torch.tensor([[50, 51]]), 6, seed=1)  # a different continuation at positions 6, 7
    cache.reset()
    hits = cache.match_prefix(prompt, torch.arange(9)[None])
    assert int(hits[0]) == 8, hits
    _, view = _step(cache, prompt[:, 8:], 8, seed=2)
    keys = _keys_by_position(view)
    for p in range(8):
        assert torch.equal(keys[p], k_prompt[0, :, p]), f"position {p}: the prefix hit reads another token's key"
