"""qkv.costs.select: the keys each query attends under DSA, QSA, MSA and MoBA equal what qkv.sparse.select's
selections actually list (counted on random scores), the FLOP sums follow, and bad arguments are refused."""

from __future__ import annotations

import pytest
import torch

from qkv.config.select import SelectSpec
from qkv.costs.select import keys_at, scorer_flops, select_flops, select_pairs
from qkv.sparse import select

N = 23


def _listed(idx: torch.Tensor) -> list[int]:
    """Distinct listed keys per query row of (1, Hs, N, K) lists (head 0)."""
    return [len({int(v) for v in row if v >= 0}) for row in idx[0, 0]]


def _selections():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, N, 8, generator=g, dtype=torch.float64), torch.randn(1, 1, N, 8, generator=g,
                                                                                   dtype=torch.float64)
    w = torch.randn(1, N, 2, generator=g, dtype=torch.float64).abs()
    pos = torch.arange(N).view(1, N)
    yield SelectSpec.dsa(topk=5, heads=2, head_dim=8), select.dsa_select(q, k, w, budget=5, q_positions=pos,
                                                                           kv_positions=pos)
    keys = select.pool_keys(k, 3, complete=True)
    yield SelectSpec.qsa(budget=6, ratio=3, heads=2, head_dim=8), select.qsa_select(
        q, keys, budget=6, block=3, q_positions=pos, kv_positions=pos)
    yield SelectSpec.msa(block=4, topk_blocks=3, local_blocks=2, heads=2, head_dim=8), select.msa_select(
        q, k, block=4, topk_blocks=3, local_blocks=2, q_positions=pos, kv_positions=pos)[1]
    blocks = select.moba_select(q, k, block=4, topk=2)
    toks = select.blocks_to_tokens(blocks, 4, pos, q_positions=pos)
    yield SelectSpec.moba(block=4, topk=2), toks


@pytest.mark.parametrize("which", range(4), ids=["dsa", "qsa", "msa", "moba"])
def test_keys_at_counts_what_the_selection_lists(which):
    spec, idx = list(_selections())[which]
    counted = _listed(idx)
    # DSA's ReLU scores may rank a key at exactly 0 (still listed); every scheme lists exactly keys_at(p) keys
    assert counted == [keys_at(spec, p) for p in range(N)], (spec, counted)
    assert select_pairs(spec, N) == sum(counted)
    assert select_pairs(spec, N, decode=True) == counted[-1]


def test_flops_add_up():
    dsa = SelectSpec.dsa(topk=4, heads=3, head_dim=8)
    assert scorer_flops(dsa, 5) == (2 * 3 * 8 + 2 * 3) * (1 + 2 + 3 + 4 + 5)
    qsa = SelectSpec.qsa(budget=4, ratio=2, heads=3, head_dim=8)
    assert scorer_flops(qsa, 5, decode=True) == 2 * 3 * 8 * 2  # the query at 4 scores its 2 complete blocks
    f = select_flops(dsa, 6, num_heads=2, head_dim=8, v_head_dim=4, batch=3)
    assert f.pairs == 3 * (1 + 2 + 3 + 4 + 4 + 4) and f.attention == 2 * 2 * 12 * f.pairs
    assert f.dense == 3 * 2 * 2 * 12 * 21
    long = select_flops(SelectSpec.msa(block=128, topk_blocks=16, local_blocks=1, heads=4, head_dim=128), 32768,
                        num_heads=64, head_dim=128)
    assert long.attention < long.dense / 8  # 2048 keys per query against 16384 on average


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="SelectSpec"):
        select_pairs("dsa", 4)
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        select_pairs(SelectSpec.dsa(topk=2), -1)
    with pytest.raises(ValueError, match="local >= 1"):
        keys_at(SelectSpec(scorer="max_dot", granularity="block", sharing="kv_group", block=4, budget=2), 3)
    with pytest.raises(ValueError, match="compressed entries"):
        keys_at(SelectSpec(scorer="weighted_relu", granularity="compressed", sharing="all_heads", block=4,
                           budget=2), 3)
    with pytest.raises(ValueError, match="num_heads must be"):
        select_flops(SelectSpec.dsa(topk=2), 4, num_heads=0, head_dim=8)
