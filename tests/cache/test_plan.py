"""plan_memory: the arithmetic matches what the storages actually allocate, and says whether it fits."""

from __future__ import annotations

import pytest
import torch

from _toy_lm import ToyLM, single_thread  # noqa: F401 (single_thread: autouse fixture)
from qkv.cache import (
    H2O,
    KIVI,
    Dynamic,
    FullSpec,
    Int8,
    KVCache,
    Paged,
    SlidingWindowSpec,
    SnapKV,
    Static,
    StreamingLLM,
    plan_memory,
)
from qkv.cache.policies import HeadwiseStore
from qkv.costs import PRESETS
from qkv.models.generate import generate

SPECS = [FullSpec(2, 16), SlidingWindowSpec(5, 2, 16)]


def _run(storage, lengths, new=4):
    m = ToyLM(layers=("full", ("window", 5)), seed=0).eval()
    N = max(lengths)
    ids = torch.randint(0, 61, (len(lengths), N))
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, N - n:] = 1
    cache = KVCache(m, storage=storage)
    generate(m, ids, attention_mask=mask, max_new_tokens=new + 1, cache=cache)
    return cache


def test_plan_matches_paged_and_static_allocation():
    lengths = [3, 17, 9]
    ctx = [n + 4 for n in lengths]  # the last generated token is never fed
    paged = Paged(block_size=4, num_blocks=64)
    cache = _run(paged, lengths)
    plan = plan_memory(SPECS, context=ctx, dtype=torch.float32, storage=paged)
    mem = cache.memory()
    assert plan.needed_bytes == mem.used_bytes
    stats = cache.pool_stats()
    assert plan.blocks[None] == stats["full_attention"].blocks_in_use
    assert plan.blocks[5] == stats["sliding_window_5"].blocks_in_use
    static = _run(Static(32), lengths)
    splan = plan_memory(SPECS, context=ctx, dtype=torch.float32, storage=Static(32))
    # keys, values and an int64 position per slot: the plan counts what the cache allocates
    assert splan.allocated_bytes == static.memory().allocated_bytes


def test_paged_wastes_less_than_static_for_mixed_lengths():
    ctx = [100, 900, 4000, 8000]
    static = plan_memory([FullSpec(8, 128)] * 4, context=ctx, storage=Static(8192))
    paged = plan_memory([FullSpec(8, 128)] * 4, context=ctx, storage=Paged(block_size=16, num_blocks=1024))
    assert static.needed_bytes == paged.needed_bytes
    assert static.wasted_fraction > 0.55 and paged.wasted_fraction < 0.01


def test_fits_and_breakdown():
    gemma = PRESETS["gemma-3-27b"]
    plan = plan_memory(gemma, batch=1, context=128 * 1024, dtype="bf16", budget_bytes=80 * 10**9)
    assert plan.fits
    held = {kind: sum(lay.needed_bytes for lay in plan.layers if lay.kind == kind) for kind in plan.by_kind}
    assert held["full"] > held["sliding"]  # 10 global layers hold more than 52 local ones at 128k
    dense = plan_memory(gemma.mha_equivalent(), batch=8, context=128 * 1024, dtype="bf16", budget_bytes=80 * 10**9)
    assert dense.fits is False
    pool = plan_memory([FullSpec(8, 128)], batch=2, context=2048, storage=Paged(block_size=16, num_blocks=200))
    assert pool.blocks[None] == 256 and plan_memory(
        [FullSpec(8, 128)], batch=2, context=2048, storage=Paged(block_size=16, num_blocks=200),
        budget_bytes=10**12).fits is False
    assert "KV cache plan" in str(plan)
    dyn = plan_memory(SPECS, context=10, storage=Dynamic())
    assert dyn.allocated_bytes >= dyn.needed_bytes


class _Recent:
    """A policy defined here only: every full-attention layer keeps its ``cap`` newest tokens (per row and
    head), through qkv's HeadwiseStore. KVCache, generate and plan_memory must honour it unchanged."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def apply_spec(self, spec):
        return spec

    def store_for(self, spec, *, layer):
        return HeadwiseStore(self) if type(spec) is FullSpec else None

    def token_cap(self, spec, new_tokens=0):
        return self.cap if type(spec) is FullSpec else None

    # the HeadwiseStore rule
    def evict(self, st, n):
        if st.end + n > self.cap:
            B, H = st.k.shape[:2]
            keep = max(self.cap - n, 0)
            st.keep(torch.arange(st.end - keep, st.end).expand(B, H, keep))

    def observe(self, st, q, view, scale):
        self.observed = True


def _decoder():
    from qkv.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=48, layer_types=("full_attention",
                                                                                  "sliding_attention"),
                        sliding_window=5)
    return DecoderLM(cfg).eval()


COMBOS = ([(s, None, None) for s in ("dynamic", "static", "paged")]
          + [("dynamic", q, None) for q in ("kivi", "int8")]
          + [("dynamic", None, p) for p in ("streaming", "h2o", "snapkv", "recent")])


@pytest.mark.parametrize("storage,quant,policy", COMBOS, ids=["-".join(str(x) for x in c) for c in COMBOS])
@pytest.mark.parametrize("prompt,new", [(23, 6), (3, 2)], ids=["P23-new6", "P3-new2"])
def test_plan_equals_measured_memory(storage, quant, policy, prompt, new):
    """plan_memory(model, ...) (dtype: the model's) equals cache.memory() after generate filled the cache:
    the bytes held and the bytes allocated, for every storage, quantizer and policy."""
    model = _decoder()
    storages = {"dynamic": Dynamic(), "static": Static(64), "paged": Paged(block_size=4, num_blocks=64)}
    quants = {None: None, "kivi": KIVI(bits=4, group_size=4, residual=4), "int8": Int8()}
    policies = {None: None, "streaming": StreamingLLM(n_sink=2, window=6), "h2o": H2O(heavy=3, recent=5),
                "snapkv": SnapKV(budget=8, window=2, kernel_size=3), "recent": _Recent(7)}
    kw = dict(storage=storages[storage], quant=quants[quant], policy=policies[policy])
    cache = KVCache(model, **kw)
    ids = torch.randint(1, 61, (2, prompt), generator=torch.Generator().manual_seed(1))
    out = generate(model, ids, max_new_tokens=new + 1, cache=cache)  # the last token is never fed
    assert out.cache.seq_length == prompt + new
    mem = cache.memory()
    plan = plan_memory(model, batch=2, context=prompt + new, new_tokens=new, **kw)
    assert plan.needed_bytes == mem.used_bytes, (plan, mem)
    assert plan.allocated_bytes == mem.allocated_bytes, (plan, mem)
    if policy == "recent":
        assert policies["recent"].observed  # the decoder showed it the queries


def test_plan_memory_inputs_and_default_dtype():
    from qkv.nn import get_config

    model = _decoder()
    cfg = model.config
    want = plan_memory(model.cache_specs(), context=100, dtype=torch.float32)
    assert plan_memory(model, context=100) == want  # the model's float32, not bf16
    assert plan_memory(cfg, context=100) == want  # a model config (qkv.nn.DecoderConfig)
    assert plan_memory(model.double(), context=100).needed_bytes == 2 * want.needed_bytes
    hf = {"model_type": "mistral", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32,
          "num_key_value_heads": 2, "sliding_window": 5}
    assert plan_memory(hf, context=100).needed_bytes == plan_memory(  # no declared dtype: bf16, as a preset
        [SlidingWindowSpec(5, 2, 8)] * 2, context=100, dtype=torch.bfloat16).needed_bytes
    assert plan_memory({**hf, "torch_dtype": "float32"}, context=100).needed_bytes == plan_memory(
        [SlidingWindowSpec(5, 2, 8)] * 2, context=100, dtype=torch.float32).needed_bytes
    by_name = plan_memory("llama-3-8b", context=1000)
    assert by_name.needed_bytes == 32 * 1000 * 2 * 8 * 128 * 2  # bf16 for a published preset
    assert plan_memory(get_config("tiny-gemma"), context=10).layers[0].kind == "sliding"
    with pytest.raises(TypeError, match="expected layer specs"):
        plan_memory(3.5, context=10)
    with pytest.raises(TypeError, match="CachePolicy"):
        plan_memory(model, context=10, policy=object())
    with pytest.raises(TypeError, match="Quantizer"):
        plan_memory(model, context=10, quant="int4")
    with pytest.raises(ValueError, match="new_tokens"):
        plan_memory(model, context=10, new_tokens=11)
    with pytest.raises(ValueError, match="context"):
        plan_memory(model, context=-1)
    with pytest.raises(TypeError, match="CachePolicy"):
        KVCache(model, policy=object())
