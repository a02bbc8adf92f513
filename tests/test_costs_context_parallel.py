"""The context-parallel cost model (pure arithmetic) and ``qkv plan-cp``."""

import json

import pytest
from typer.testing import CliRunner

from qkv.cli import _register, app
from qkv.costs import PRESETS
from qkv.costs.context_parallel import H200, PARAMETERS, _memory_terms, layer_time, longest_context, plan

LLAMA = PRESETS["llama-3-70b"]
runner = CliRunner()


def test_single_device_has_no_communication():
    t = layer_time(LLAMA, context=8192, world=1, scheme="ring", device=H200)
    assert t.comm_s == 0 and t.bytes_sent == 0 and t.total_s == t.compute_s


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ring_bytes_follow_the_formula(world):
    n = 65536
    chunk = n / world * LLAMA.num_key_value_heads * (128 + 128) * 2  # K and V, bf16
    fwd = layer_time(LLAMA, context=n, world=world, scheme="ring", device=H200, training=False)
    assert fwd.bytes_sent == pytest.approx((world - 1) * chunk)
    train = layer_time(LLAMA, context=n, world=world, scheme="zigzag", device=H200)
    # backward: K/V again W-1 times and float32 dK/dV W times
    assert train.bytes_sent == pytest.approx((world - 1) * chunk * 2 + world * 2 * chunk)
    ag = layer_time(LLAMA, context=n, world=world, scheme="allgather", device=H200, training=False)
    assert ag.bytes_sent == pytest.approx((world - 1) * chunk)


def test_causal_ring_is_unbalanced_and_zigzag_is_not():
    ring = layer_time(LLAMA, context=131072, world=8, scheme="ring", device=H200)
    zig = layer_time(LLAMA, context=131072, world=8, scheme="zigzag", device=H200)
    assert ring.compute_s / zig.compute_s == pytest.approx(2 * 8 / 9)
    assert zig.total_s < ring.total_s


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
    with pytest.raises(ValueError, match="no parameter count"):
        longest_context(PRESETS["gemma-3-27b"], world=8, device=H200)


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
    unknown = runner.invoke(app, ["plan-cp", "gemma-3-27b"])
    assert unknown.exit_code == 2 and "no parameter count" in unknown.output
