"""qkv.sparse.select: each piece against a brute-force float64 definition written with loops here, QSA and MSA
against HF transformers' own indexer modules in float64 (Qwen4-exp's ``Qwen4ExpTextQSAIndexer``, MiniMax-M3's
``MiniMaxM3VLIndexer``), the selection served by qkv.attention equal to the dense masked reference, and bad
inputs refused."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from qkv import masks
from qkv.sparse import select

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rows(idx: torch.Tensor) -> list:
    """Each list as a set of its entries (the order is not part of the mask)."""
    return [[[sorted({int(v) for v in row if v >= 0}) for row in h] for h in b] for b in idx]


# ---------------------------------------------------------------- pieces against loops

def test_weighted_relu_scores_is_the_dsa_formula():
    g = _gen(0)
    q, k, w = torch.randn(2, 3, 5, 8, generator=g, dtype=F64), torch.randn(2, 1, 7, 8, generator=g, dtype=F64), \
        torch.randn(2, 5, 3, generator=g, dtype=F64)
    got = select.weighted_relu_scores(q, k, w)
    want = torch.zeros(2, 1, 5, 7, dtype=F64)
    for b in range(2):
        for i in range(5):
            for t in range(7):
                want[b, 0, i, t] = sum(w[b, i, h] * max(0.0, float(q[b, h, i] @ k[b, 0, t]) / math.sqrt(8))
                                       for h in range(3))
    assert got.dtype == F64 and (got - want).abs().max() < 1e-12
    plain = select.weighted_relu_scores(q, k)
    assert (plain - torch.relu(q @ k.transpose(-1, -2) / math.sqrt(8)).sum(1, keepdim=True)).abs().max() < 1e-12
    assert select.weighted_relu_scores(q.float(), k.float()).dtype == torch.float32


def test_dot_scores_reads_each_heads_key_group():
    g = _gen(1)
    q, k = torch.randn(1, 4, 3, 5, generator=g, dtype=F64), torch.randn(1, 2, 6, 5, generator=g, dtype=F64)
    got = select.dot_scores(q, k, scale=0.5)
    for h in range(4):
        assert torch.allclose(got[0, h], 0.5 * q[0, h] @ k[0, h // 2].T, atol=1e-13)


@pytest.mark.parametrize("complete", [False, True], ids=["partial", "complete"])
def test_pool_keys_by_position_blocks_ignores_padding(complete):
    g = _gen(2)
    k = torch.randn(2, 2, 11, 3, generator=g, dtype=F64)
    pos = torch.tensor([list(range(11)), [-1, -1, -1] + list(range(8))])
    got = select.pool_keys(k, 3, positions=pos, complete=complete)
    for b in range(2):
        top = int(pos[b].max()) + 1
        T = got.shape[2]
        assert T == (11 // 3 if complete else math.ceil(11 / 3))
        for t in range(T):
            slots = [j for j in range(11) if pos[b, j] >= 0 and pos[b, j] // 3 == t]
            if complete and (t + 1) * 3 > top or not slots:
                continue
            assert torch.allclose(got[b, :, t], k[b, :, slots].mean(1), atol=1e-13), (b, t)


def test_pool_scores_is_the_max_over_each_block():
    g = _gen(3)
    s = torch.randn(1, 2, 4, 10, generator=g, dtype=F64)
    s[0, 0, 0, 4:7] = float("-inf")  # block 1 (positions 3 .. 5, slots 4 .. 6) all masked: -inf
    pos = torch.tensor([[-1, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    got = select.pool_scores(s, 3, positions=pos)
    assert got.shape == (1, 2, 4, 3)
    for t in range(3):
        slots = [j for j in range(10) if pos[0, j] >= 0 and pos[0, j] // 3 == t]
        assert torch.equal(got[0, :, :, t], s[0, :, :, slots].amax(-1))
    assert got[0, 0, 0, 1] == float("-inf")


def test_visibility_forcing_and_topk_follow_their_definitions():
    qp = torch.tensor([[0, 3, 7, 8, -1]])
    vis = select.entry_visible(qp, 5, 2, complete=True)[0, 0]
    part = select.entry_visible(qp, 5, 2, complete=False)[0, 0]
    loc = select.local_entries(qp, 5, 2, 2)[0, 0]
    for i, p in enumerate(qp[0].tolist()):
        for t in range(5):
            assert bool(vis[i, t]) == (p >= 0 and (t + 1) * 2 <= p + 1)
            assert bool(part[i, t]) == (p >= 0 and t * 2 <= p)
            assert bool(loc[i, t]) == (p >= 0 and p // 2 - 2 < t <= p // 2)
    s = torch.tensor([[[[0.5, 0.5, 0.9, 0.1, 0.5]]]], dtype=F64)
    assert select.select_topk(s, 3).tolist() == [[[[2, 0, 1]]]], "ties go to the earlier entry"
    forced = torch.tensor([False, False, False, True, False])
    assert select.select_topk(s, 2, forced=forced).tolist() == [[[[3, 2]]]]
    hidden = torch.tensor([True, False, True, True, False])
    assert select.select_topk(s, 4, visible=hidden, forced=torch.tensor([0, 1, 0, 0, 0]).bool()).tolist() == \
        [[[[2, 0, 3, -1]]]], "a forced entry that is not visible stays out; -1 past the visible ones"
    assert select.select_topk(s, 9).shape[-1] == 5
    nan = s.clone()
    nan[..., 3] = float("nan")
    assert 3 in select.select_topk(nan, 2).flatten().tolist(), "a NaN score stays picked, so NaN reaches the output"


def test_blocks_and_tails_map_positions_to_slots_under_left_padding():
    kvp = torch.tensor([[-1, -1, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    ids = torch.tensor([[[[1, -1], [0, 2]]], [[[3, 0], [-1, -1]]]])  # (2, 1, 2, 2)
    qp = torch.tensor([[3, 6], [8, 8]])
    got = select.blocks_to_tokens(ids, 3, kvp, q_positions=qp)
    want = [[[[5]], [[2, 3, 4, 8]]], [[[0, 1, 2]], [[]]]]
    for b in range(2):
        for i in range(2):
            assert sorted(v for v in got[b, 0, i].tolist() if v >= 0) == want[b][i][0], (b, i, got[b, 0, i])
    tail = select.tail_tokens(torch.tensor([[0, 4, 5, -1], [2, 3, 7, 8]]), 3, kvp)
    assert tail.shape == (2, 1, 4, 2)
    assert [sorted(v for v in r if v >= 0) for r in tail[0, 0].tolist()] == [[2], [5, 6], [], []]
    assert [sorted(v for v in r if v >= 0) for r in tail[1, 0].tolist()] == [[], [3], [6, 7], []]


# ---------------------------------------------------------------- named points against HF's modules

def _rope(x, pos, dim, theta=10000.0):
    """Half-split RoPE on the first ``dim`` channels of x (..., N, D) at positions (B, N), in float64."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=F64) / dim)
    ang = pos.clamp_min(0).to(F64).unsqueeze(-1) * inv  # (B, N, dim/2)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    return cos, sin


def _qsa_case(seed, lengths, N):
    """HF's QSA indexer in float64 with random weights, and its picks for a batch of left-padded rows."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    cfg = transformers.Qwen4ExpTextConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        indexer_n_heads=3, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=6, indexer_compress_ratio=3,
        vocab_size=64, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    idx = hf.Qwen4ExpTextQSAIndexer(cfg, 0).to(F64)
    with torch.no_grad():
        for p in idx.parameters():
            p.normal_(0, 0.3 if p.dim() == 1 else 1 / math.sqrt(p.shape[-1]))
    B = len(lengths)
    g = _gen(seed)
    x = torch.randn(B, N, 32, generator=g, dtype=F64)
    pos = torch.stack([torch.arange(N) - (N - n) for n in lengths])  # left padding: -1, -2 ... before 0
    pos = torch.where(pos >= 0, pos, torch.full_like(pos, -1))
    cos, sin = _rope(x, pos, 16)
    allowed = (pos.unsqueeze(1) >= 0) & (pos.unsqueeze(1) <= pos.unsqueeze(2)) & (pos.unsqueeze(2) >= 0)
    eye = torch.eye(N, dtype=torch.bool).unsqueeze(0)
    allowed = allowed | (eye & (pos.unsqueeze(2) < 0))  # HF's padded query rows see themselves
    with torch.no_grad():
        picked = idx(x, (cos, sin), allowed.unsqueeze(1), None)  # (B, 1, N, N) bool
    return idx, hf, x, pos, cos, sin, picked


@pytest.mark.parametrize("lengths", [(13,), (13, 8)], ids=["B1-N13", "B2-N13-leftpad"])
def test_qsa_selects_what_hf_qwen4_exp_selects(lengths):
    N = 13
    idx, hf, x, pos, cos, sin, picked = _qsa_case(4, lengths, N)
    B, D, r = len(lengths), 16, 3
    with torch.no_grad():
        q, raw = idx.index_qk_proj(x).split([3 * D, D], dim=-1)
        q = hf.apply_rotary_pos_emb(idx.q_layernorm(q.view(B, N, 3, D)), cos=cos, sin=sin, unsqueeze_dim=2)
        pooled = select.pool_keys(raw.unsqueeze(1), r, positions=pos, complete=True)  # (B, 1, T, D)
        T = pooled.shape[2]
        starts = (torch.arange(T) * r).expand(B, T)
        c0, s0 = _rope(x, starts, D)
        keys = hf.apply_rotary_pos_emb(idx.k_layernorm(pooled.squeeze(1)).unsqueeze(1), cos=c0, sin=s0)
        ours = select.qsa_select(q.transpose(1, 2), keys, budget=6, block=r, q_positions=pos, kv_positions=pos)
    assert ours.shape == (B, 1, N, 6 + r - 1)
    dense = masks.topk(ours).dense(B, 1, N, N)[:, 0]
    for b in range(B):
        real = pos[b] >= 0
        assert torch.equal(dense[b][real], picked[b, 0][real]), f"row {b}: {dense[b].int()} vs {picked[b, 0].int()}"


def _msa_case(seed, N, Nq):
    transformers = pytest.importorskip("transformers")
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf

    cfg = transformers.MiniMaxM3VLTextConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=3, index_local_blocks=2,
        vocab_size=64, layer_types=["minimax_m3_sparse"])
    torch.manual_seed(seed)
    idx = hf.MiniMaxM3VLIndexer(cfg, 0).to(F64)
    with torch.no_grad():
        for p in idx.parameters():
            p.normal_(0, 0.3 if p.dim() == 1 else 1 / math.sqrt(p.shape[-1]))
    return idx, hf


@pytest.mark.parametrize("N,Nq", [(23, 23), (23, 5), (16, 1)], ids=["N23-prefill", "N23-Nq5", "N16-decode"])
def test_msa_selects_what_hf_minimax_m3_selects(N, Nq):
    idx, hf = _msa_case(5, N, Nq)
    B, D = 2, 8
    g = _gen(N + Nq)
    x = torch.randn(B, N, 32, generator=g, dtype=F64)
    kpos = torch.arange(N).expand(B, N)
    qpos = kpos[:, N - Nq:]
    cos, sin = _rope(x, kpos, D)
    with torch.no_grad():
        qk, kk = idx.q_norm(idx.q_proj(x).view(B, N, 2, D)).transpose(1, 2), idx.k_norm(idx.k_proj(x))
        qr, kr = hf.apply_rotary_pos_emb(qk, kk.unsqueeze(1), cos, sin)
        # HF scores the new queries against every key: run its module on the queries' rows with the keys'
        # history given as a cache layer (what its decode does).
        cache = hf.MiniMaxM3VLSparseCacheLayer()
        if N > Nq:
            cache.update_index(kr[:, :, :N - Nq])

        class _Cache:
            layers = [cache]
        theirs = idx(x[:, N - Nq:], (cos[:, N - Nq:], sin[:, N - Nq:]), _Cache() if N > Nq else None, qpos)
        blocks, slots = select.msa_select(qr[:, :, N - Nq:], kr, block=4, topk_blocks=3, local_blocks=2,
                                          q_positions=qpos, kv_positions=kpos)
    assert blocks.shape == theirs.shape, (blocks.shape, theirs.shape)
    assert _rows(blocks) == _rows(theirs)
    mask = idx.build_block_mask(theirs, None, N, F64, x.device, qpos) == 0  # (B, 4, Nq, N)
    ours = masks.topk(slots.repeat_interleave(2, 1)).dense(B, 4, Nq, N)
    assert torch.equal(ours, mask)


def test_moba_and_dsa_are_points_of_the_space():
    g = _gen(6)
    q, k = torch.randn(1, 2, 9, 4, generator=g), torch.randn(1, 1, 9, 4, generator=g)
    from qkv.sparse import moba_blocks

    assert torch.equal(moba_blocks(q, k, block_size=3, topk=2), select.moba_select(q, k, block=3, topk=2))
    spec = select.SelectSpec.moba(block=3, topk=2)
    assert (spec.scorer, spec.granularity, spec.sharing, spec.local) == ("mean_key", "block", "head", 1)
    assert select.SelectSpec.dsa(topk=2048).keys_per_query(10**6) == 2048
    assert select.SelectSpec.qsa(budget=2048, ratio=4).keys_per_query(10**6) == 2051
    assert select.SelectSpec.dsa(topk=2048).keys_per_query(100) == 100


@pytest.mark.parametrize("which", ["dsa", "qsa", "msa"])
def test_attention_over_a_selection_equals_the_dense_masked_reference(which):
    """The index list is a masks.topk mask that qkv.attention serves on the gather backend."""
    g = _gen(7)
    B, H, Hkv, N, D = 2, 4, 2, 19, 8
    q, k, v = (torch.randn(B, h, N, D, generator=g, dtype=F64) for h in (H, Hkv, Hkv))
    qi, ki, w = torch.randn(B, 2, N, 8, generator=g, dtype=F64), torch.randn(B, 1, N, 8, generator=g, dtype=F64), \
        torch.randn(B, N, 2, generator=g, dtype=F64)
    pos = torch.arange(N).expand(B, N)
    if which == "dsa":
        idx = select.dsa_select(qi, ki, w, budget=5, q_positions=pos, kv_positions=pos)
    elif which == "qsa":
        keys = select.pool_keys(ki, 3, complete=True)
        idx = select.qsa_select(qi, keys, budget=6, block=3, q_positions=pos, kv_positions=pos)
    else:
        idx = select.msa_select(qi, ki, block=4, topk_blocks=2, local_blocks=1, q_positions=pos,
                                kv_positions=pos)[1]
        idx = select.expand_heads(idx, H)
    mask = masks.topk(idx) & masks.causal()
    out = qkv.attention(q, k, v, mask=mask, backend="gather")
    ref = qkv.attention(q, k, v, mask=mask, backend="reference")
    assert bool((idx >= 0).any(-1).all()), "every row keeps at least one key"
    assert (out - ref).abs().max() < 1e-12


# ---------------------------------------------------------------- bad inputs

def test_bad_inputs_are_refused_with_the_fix():
    q, k, w = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 4, 2)
    pos = torch.arange(4).view(1, 4)
    with pytest.raises(ValueError, match="one key head"):
        select.weighted_relu_scores(q, torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match="weights must be"):
        select.weighted_relu_scores(q, k, torch.randn(1, 4, 3))  # indexer heads that do not match
    with pytest.raises(ValueError, match="multiple of Hk"):
        select.dot_scores(torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        select.dsa_select(q, k, w, budget=0, q_positions=pos, kv_positions=pos)
    with pytest.raises(ValueError, match="multiple of block"):
        select.qsa_select(q, k, budget=5, block=2, q_positions=pos, kv_positions=pos)
    with pytest.raises(ValueError, match="do not fit"):
        select.msa_select(q, k, block=2, topk_blocks=1, local_blocks=2, q_positions=pos, kv_positions=pos)
    with pytest.raises(ValueError, match="q_positions must be"):
        select.dsa_select(q, k, w, budget=2, q_positions=pos[:, :3], kv_positions=pos)
    with pytest.raises(ValueError, match="contiguous"):
        select.blocks_to_tokens(torch.zeros(1, 1, 1, 1, dtype=torch.long), 2, torch.tensor([[0, 2, 1, 3]]))
    with pytest.raises(ValueError, match="scorer must be one of"):
        select.SelectSpec(scorer="cosine", granularity="token", sharing="head", block=1, budget=1)
    with pytest.raises(ValueError, match="multiple of ratio"):
        select.SelectSpec.qsa(budget=10, ratio=4)
    with pytest.raises(ValueError, match="do not fit a budget"):
        select.SelectSpec.msa(block=4, topk_blocks=1, local_blocks=2)
    with pytest.raises(ValueError, match="do not divide num_heads"):
        select.expand_heads(torch.zeros(1, 3, 2, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="block must be an int"):
        select.pool_keys(k, 0)
    with pytest.raises(ValueError, match="k must be a"):
        select.msa_select(q, "k", block=2, topk_blocks=1, local_blocks=1, q_positions=pos, kv_positions=pos)
    with pytest.raises(ValueError, match="kv_positions must be"):
        select.blocks_to_tokens(torch.zeros(1, 1, 1, 1, dtype=torch.long), 2, [0, 1])
