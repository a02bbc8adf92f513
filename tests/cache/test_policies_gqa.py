"""Issue 29 item 13: H2O and SnapKV with grouped-query attention sum each KV head's votes over the query heads
of its own group (query head ``h`` reads KV head ``h // group``), with a different target token per group."""

import pytest
import torch

from qkv.cache import H2O, FullSpec, KVCache, SnapKV

HQ, HKV, D, N = 4, 2, 8, 8
A, B = 0, 1  # the tokens group 0 (query heads 0, 1) and group 1 (query heads 2, 3) attend to


def _prompt():
    g = torch.Generator().manual_seed(0)
    k = 0.05 * torch.randn(1, HKV, N, D, generator=g)
    v = torch.randn(1, HKV, N, D, generator=g)
    k[:, :, A, 0] = 4.0  # key A points along e0, key B along e1, in both KV heads
    k[:, :, B, 1] = 4.0
    q = torch.zeros(1, HQ, N, D)
    q[:, :2, :, 0] = 3.0  # group 0 looks for A, softly (about 0.9 of its weight)
    q[:, 2:, :, 1] = 6.0  # group 1 looks for B, sharply: a wrong grouping would let B win group 0's vote
    return k, v, q


@pytest.mark.parametrize("policy", [H2O(heavy=1, recent=1), SnapKV(budget=3, window=2, kernel_size=1)],
                         ids=["h2o", "snapkv"])
def test_gqa_votes_go_to_each_query_heads_own_kv_head(policy):
    k, v, q = _prompt()
    cache = KVCache([FullSpec(HKV, D)], policy=policy)
    cache.update(0, k, v, positions=torch.arange(N)[None])
    cache.observe(0, q, scale=1.0)
    step = cache.update(0, 0.05 * torch.randn(1, HKV, 1, D), torch.randn(1, HKV, 1, D),
                        positions=torch.tensor([[N]]))
    kept_a = (step.k[0, 0] == k[0, 0, A]).all(-1).any().item()
    kept_b = (step.k[0, 1] == k[0, 1, B]).all(-1).any().item()
    lost_b = (step.k[0, 0] == k[0, 0, B]).all(-1).any().item()
    assert kept_a and kept_b and not lost_b, (
        f"KV head 0 should keep token {A} (its group's target), KV head 1 token {B}; kept: head 0 {kept_a}, "
        f"head 1 {kept_b}, head 0 keeps {B}: {lost_b}")
