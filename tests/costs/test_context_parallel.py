"""The context-parallel cost model (pure arithmetic) and ``qkv plan-cp``."""

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from qkv.cli import _register, app
from qkv.costs import PRESETS, preset_from_hf_config
from qkv.costs.context_parallel import (
    H200,
    PARAMETERS,
    SCHEMES,
    Device,
    _memory_terms,
    layer_time,
    longest_context,
    plan,
    scheme_work,
)
from qkv.distributed.sharding import layout

LLAMA = PRESETS["llama-3-70b"]
runner = CliRunner()


def test_single_device_has_no_communication():
    t = layer_time(LLAMA, context=8192, world=1, scheme="ring", device=H200)
    assert t.comm_s == 0 and t.bytes_sent == 0 and t.total_s == t.compute_s


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ring_bytes_follow_the_formula(world):
    n = 65536
    chunk = n / world * LLAMA.config.num_key_value_heads * (128 + 128) * 2  # K and V, bf16
    fwd = layer_time(LLAMA, context=n, world=world, scheme="ring", device=H200, training=False)
    assert fwd.bytes_sent == pytest.approx((world - 1) * chunk)
    train = layer_time(LLAMA, context=n, world=world, scheme="zigzag", device=H200)
    # backward: K/V again W-1 times and float32 dK/dV W times
    assert train.bytes_sent == pytest.approx((world - 1) * chunk * 2 + world * 2 * chunk)
    ag = layer_time(LLAMA, context=n, world=world, scheme="allgather", device=H200, training=False)
    assert ag.bytes_sent == pytest.approx((world - 1) * chunk)


def test_causal_ring_is_unbalanced_and_zigzag_is_not():
    dev = dataclasses.replace(H200, block_overhead_s=0.0)
    ring = layer_time(LLAMA, context=131072, world=8, scheme="ring", device=dev)
    zig = layer_time(LLAMA, context=131072, world=8, scheme="zigzag", device=dev)
    # the last ring rank: 7 full blocks and half a diagonal of (N/8)^2; zigzag: 1/16 of the square on every rank
    assert ring.compute_s / zig.compute_s == pytest.approx((7 + 0.5) / 64 * 16)
    assert zig.total_s < ring.total_s


def _brute_work(scheme: str, world: int, n: int, *, causal: bool, dense: bool, ulysses: int = 1):
    """Per rank (score triples over B * Hq * N^2, blocks), counted from qkv's layouts token by token: the blocks
    of a rank are its (query segment, key segment) pairs, as qkv.distributed.plan walks them; a block counts when
    the causal mask leaves any pair, in full (``dense``) or by its allowed pairs."""
    N = n * world
    lay = layout(scheme, N, world)
    if scheme in ("ulysses", "usp"):  # a ring over R members holding U contiguous shards, for Hq/U heads
        heads = 1 / world if scheme == "ulysses" else 1 / ulysses
        members = world // ulysses if scheme == "usp" else 1
        per = N // members
        q_index = [torch.arange(i * per, (i + 1) * per) for i in range(members)]
        segs = [[slice(j * n, (j + 1) * n) for j in range(world)]] if scheme == "ulysses" else [[slice(0, per)]]
        segs = segs * members
        ranks = range(members)
    else:
        heads, q_index, segs, ranks = 1.0, list(lay.index), [lay.segments(r) for r in range(world)], range(world)
    out = []
    for r in ranks:
        work = blocks = 0
        owners = range(len(q_index))
        for qs in segs[r]:
            for owner in owners:
                for ks in segs[owner]:
                    qi, kj = q_index[r][qs].view(-1, 1), q_index[owner][ks].view(1, -1)
                    allowed = int((kj <= qi).sum()) if causal else qi.numel() * kj.numel()
                    if allowed == 0:
                        continue
                    blocks += 1
                    work += qi.numel() * kj.numel() if dense else allowed
        out.append((work * heads / N ** 2, blocks))
    return out


@pytest.mark.parametrize("dense", [True, False], ids=["dense-blocks", "skips-tiles"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("scheme,world,ulysses",
                         [pytest.param(s, w, 1, id=f"{s}-W{w}") for s in SCHEMES if s != "usp" for w in (1, 2, 3, 4)]
                         + [pytest.param("usp", w, u, id=f"usp-W{w}-U{u}")
                            for w, u in ((4, 2), (8, 2), (8, 4), (4, 4))])
def test_scheme_work_counts_qkv_blocks(scheme, world, ulysses, causal, dense):
    n = 48  # tokens per rank: divides into 2W zigzag chunks for W <= 4
    per_rank = _brute_work(scheme, world, n, causal=causal, dense=dense, ulysses=ulysses)
    got = scheme_work(scheme, world, causal=causal, skips_masked_tiles=not dense, ulysses=ulysses)
    busiest = max(per_rank)
    mean_work = sum(w for w, _ in per_rank) / len(per_rank)
    mean_blocks = sum(b for _, b in per_rank) / len(per_rank)
    # allowed pairs count each diagonal's N/W extra pairs, which the model's fractions leave out: O(1/n)
    tol = 0 if dense else 1.0 / n
    msg = f"model {got}, counted per rank {per_rank}"
    assert got.fraction == pytest.approx(busiest[0], rel=tol, abs=1e-12), msg
    assert got.mean_fraction == pytest.approx(mean_work, rel=tol, abs=1e-12), msg
    assert got.blocks == max(b for _, b in per_rank), msg
    assert got.mean_blocks == pytest.approx(mean_blocks), msg


def _cpu(**kw):
    return Device("cpu", 0.0, 1e15, 1e10, 1e10, 1e9, 1e-4, skips_masked_tiles=False, **kw)


def test_block_overhead_and_backward_multiplier_add_up():
    small = PRESETS["llama-3-8b"]
    n, W = 8192, 4
    base = layer_time(small, context=n, world=W, scheme="allgather", device=_cpu(backward_multiplier=3.0))
    work = scheme_work("allgather", W, skips_masked_tiles=False)
    width = small.key_head_dim + small.value_head_dim
    flops = 2.0 * small.config.num_attention_heads * n ** 2 * width * work.fraction
    assert base.compute_s == pytest.approx(flops / 1e10 * (1 + 3.0))
    slow = layer_time(small, context=n, world=W, scheme="allgather", device=_cpu(backward_multiplier=3.0,
                                                                                block_overhead_s=1e-3))
    assert slow.compute_s - base.compute_s == pytest.approx(2 * work.blocks * 1e-3)  # forward and backward
    fwd = layer_time(small, context=n, world=W, scheme="allgather", training=False,
                     device=_cpu(block_overhead_s=1e-3))
    assert fwd.compute_s == pytest.approx(flops / 1e10 + work.blocks * 1e-3)


def test_ranks_that_share_cores_share_the_mean_work():
    n, W = 8192, 4
    full = {s: layer_time(LLAMA, context=n, world=W, scheme=s, device=_cpu()) for s in ("ring", "zigzag")}
    half = {s: layer_time(LLAMA, context=n, world=W, scheme=s, device=_cpu(compute_share=0.5)) for s in full}
    assert half["zigzag"].compute_s == pytest.approx(2 * full["zigzag"].compute_s)  # balanced: every rank busy
    # the causal ring's last rank does 4 blocks, the mean rank 2.5: sharing 2 cores costs it 2.5 / 4 * 2
    assert half["ring"].compute_s == pytest.approx(full["ring"].compute_s * 2.5 / 4 * 2)
    assert half["ring"].compute_s < half["zigzag"].compute_s * 4 / 2.25


def test_check_adds_two_all_gathers_of_latency():
    for scheme in SCHEMES:
        a = layer_time(LLAMA, context=8192, world=4, scheme=scheme, device=_cpu())
        b = layer_time(LLAMA, context=8192, world=4, scheme=scheme, device=_cpu(), check=True)
        assert b.total_s - a.total_s == pytest.approx(2 * 3 * 1e-4), scheme
        assert b.bytes_sent == a.bytes_sent


def test_h200_defaults():
    assert H200.backward_multiplier == 2.5 and H200.compute_share == 1 and H200.skips_masked_tiles
    assert 0 < H200.block_overhead_s < 1e-4


@pytest.mark.parametrize("field,value,error,match", [
    ("block_overhead_s", -1e-6, ValueError, "block_overhead_s must be >= 0"),
    ("latency_s", -1.0, ValueError, "latency_s must be >= 0"),
    ("backward_multiplier", -0.5, ValueError, "backward_multiplier must be >= 0"),
    ("compute_share", 0.0, ValueError, r"compute_share must be in \(0, 1\]"),
    ("compute_share", 1.5, ValueError, r"compute_share must be in \(0, 1\]"),
    ("attention_flops_per_s", 0.0, ValueError, "attention_flops_per_s must be > 0"),
    ("link_bytes_per_s", float("nan"), ValueError, "link_bytes_per_s must be finite"),
    ("hbm_bytes_per_s", float("inf"), ValueError, "hbm_bytes_per_s must be finite"),
    ("block_overhead_s", "1ms", TypeError, "block_overhead_s must be a number"),
    ("compute_share", True, TypeError, "compute_share must be a number"),
    ("skips_masked_tiles", 1, TypeError, "skips_masked_tiles must be a bool"),
], ids=lambda v: str(v)[:24])
def test_device_bad_input(field, value, error, match):
    with pytest.raises(error, match=match):
        dataclasses.replace(H200, **{field: value})


def test_scheme_work_bad_input():
    with pytest.raises(ValueError, match="unknown scheme 'spiral'"):
        scheme_work("spiral", 4)
    with pytest.raises(ValueError, match="world must be an int >= 1, got 0"):
        scheme_work("ring", 0)
    with pytest.raises(ValueError, match="ulysses must be an int >= 1 that divides world=4, got 3"):
        scheme_work("usp", 4, ulysses=3)
    with pytest.raises(TypeError, match="device must be a qkv.costs.context_parallel.Device, got dict"):
        layer_time(LLAMA, context=1024, world=2, scheme="ring", device={"name": "h200"})


def test_mla_passes_its_latent():
    ds = PRESETS["deepseek-v2"]
    t = layer_time(ds, context=65536, world=4, scheme="ring", device=H200, training=False)
    assert t.bytes_sent == pytest.approx(3 * 65536 / 4 * 576 * 2)


def test_longest_context_fits_and_the_next_does_not():
    for name in PARAMETERS:
        p = PRESETS[name]
        for world in (16, 64, 256):
            n = longest_context(p, world=world, device=H200)
            fixed, per_token = _memory_terms(p, world)
            if n == 0:
                assert fixed > 0.9 * H200.memory_bytes, (name, world)
                continue
            assert fixed + n / world * per_token <= 0.9 * H200.memory_bytes
            assert fixed + (n / world + 1024) * per_token > 0.9 * H200.memory_bytes - 2 * world * per_token
    assert longest_context(LLAMA, world=1, device=H200) == 0  # 16 bytes x 70.6B parameters > 141 GB


def test_plan_grows_with_world():
    rows = plan(LLAMA, max_world=1024)
    assert [r.world for r in rows] == [2 ** i for i in range(11)]
    contexts = [r.context for r in rows if r.context]
    assert contexts == sorted(contexts) and contexts[-1] > 50_000_000


def test_bad_input():
    with pytest.raises(ValueError, match="unknown scheme"):
        layer_time(LLAMA, context=1024, world=2, scheme="spiral", device=H200)
    with pytest.raises(ValueError, match="world <= context"):
        layer_time(LLAMA, context=4, world=8, scheme="ring", device=H200)
    bare = preset_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    with pytest.raises(ValueError, match="no parameter count .* none can be counted: .*missing vocab_size"):
        longest_context(bare, world=8, device=H200)
    counted = longest_context(PRESETS["gemma-3-27b"], world=8, device=H200)  # no model card: counted
    assert counted > 0


def test_cli_plan_cp():
    _register()
    res = runner.invoke(app, ["plan-cp", "--max-world", "64"])
    assert res.exit_code == 0, res.output
    assert "llama-3-70b" in res.output and "deepseek-v2" in res.output and "does not fit" in res.output
    res = runner.invoke(app, ["plan-cp", "llama-3-70b", "--json", "--max-world", "1024", "--scheme", "usp"])
    data = json.loads(res.output)
    assert data["models"]["llama-3-70b"][-1]["world"] == 1024 and data["models"]["llama-3-70b"][-1]["context"] > 0
    bad = runner.invoke(app, ["plan-cp", "--scheme", "spiral"])
    assert bad.exit_code == 2 and "--scheme must be one of" in bad.output
    counted = runner.invoke(app, ["plan-cp", "gemma-3-27b"])  # no model-card count: counted from the preset
    assert counted.exit_code == 0 and "gemma-3-27b" in counted.output, counted.output


def test_sparse_attention_models_are_refused_not_given_dense_numbers():
    """DeepSeek-V3.2 selects index_topk keys per query and ships indexer keys: the dense arithmetic refuses it
    (layer_time, longest_context, plan) with a reason; its dense base model still plans."""
    from qkv.costs import get_preset
    from qkv.costs.context_parallel import layer_time, longest_context, plan

    sparse = get_preset("deepseek-v3.2")
    for call in (lambda: layer_time(sparse, context=8192, world=2, scheme="ring", device=H200),
                 lambda: longest_context(sparse, world=8, device=H200), lambda: plan(sparse, max_world=2)):
        with pytest.raises(ValueError, match="index_topk=2048 selected keys per query"):
            call()
    assert plan(get_preset("deepseek-v3"), max_world=2)
