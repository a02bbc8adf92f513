"""Layer specs: what each kind keeps and what it costs; hybrid savings come from specs alone."""

from __future__ import annotations

import pytest
import torch

from _toy_lm import single_thread  # noqa: F401 (autouse fixture)
from qkv.cache import CrossSpec, FullSpec, KVCache, LatentSpec, SinkSpec, SlidingWindowSpec, element_bytes


def test_bytes_per_token_and_fixed_bytes():
    bf16 = torch.bfloat16
    assert FullSpec(8, 128).bytes_per_token(bf16) == 2 * 8 * 128 * 2
    assert FullSpec(8, 128).fixed_bytes(bf16) == 0
    assert FullSpec(2, 64, v_head_dim=32).bytes_per_token(torch.float32) == 2 * (64 + 32) * 4
    s = SlidingWindowSpec(4096, 8, 128)
    assert s.bytes_per_token(bf16) == 0 and s.fixed_bytes(bf16) == 4096 * 4096
    assert s.bytes_for(100, bf16) == 100 * 4096 and s.bytes_for(10**6, bf16) == 4096 * 4096
    sink = SinkSpec(4, 1020, 8, 128)
    assert sink.fixed_bytes(bf16) == 1024 * 4096 and sink.bytes_per_token(bf16) == 0
    mla = LatentSpec(512, 64)  # DeepSeek-V2: 576 elements per token, shared by all heads
    assert mla.bytes_per_token(bf16) == 1152 and mla.fixed_bytes(bf16) == 0
    cross = CrossSpec(8, 64, source_len=1500)
    assert cross.bytes_per_token(bf16) == 0 and cross.fixed_bytes(bf16) == 1500 * 2 * 8 * 64 * 2
    assert FullSpec(8, 128).bytes_per_token("int4") == 1024
    assert element_bytes("int2") == 0.25


def test_specs_validate():
    with pytest.raises(ValueError, match="window"):
        SlidingWindowSpec(0, 8, 128)
    with pytest.raises(ValueError, match="n_kv_heads"):
        FullSpec(0, 128)
    with pytest.raises(ValueError, match="dtype"):
        FullSpec(1, 8).bytes_per_token("int3")
    with pytest.raises(AttributeError):
        FullSpec(1, 8).head_dim = 4  # frozen


def test_hybrid_savings_from_specs_alone():
    """Gemma 3's 5 local : 1 global at 32k context: the cache object is the same class."""
    local, glob = SlidingWindowSpec(16, 2, 8), FullSpec(2, 8)
    hybrid = KVCache([local] * 5 + [glob])
    dense = KVCache([glob] * 6)
    for cache in (hybrid, dense):
        for t in range(0, 256, 32):
            for i in range(6):
                cache.update(i, torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8),
                             positions=torch.arange(t, t + 32).view(1, -1))
    h, d = hybrid.memory().used_bytes, dense.memory().used_bytes
    assert h == (5 * 16 + 256) * 2 * 2 * 8 * 4 and d == 6 * 256 * 2 * 2 * 8 * 4
    assert h < 0.25 * d
