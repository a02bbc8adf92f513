"""MLA decode: the absorbed path against the expanded path (and HF transformers' DeepseekV2Attention).

DeepSeek-AI 2024, "DeepSeek-V2" (arXiv:2405.04434), Section 2.1. The layer is DeepSeek-V2-Lite's
attention (hidden 2048, 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, no query LoRA), batch 1,
float32, one new token over a cache of ``N`` latents. A step is the whole module forward (projections,
cache append, attention, output projection), so each path pays for exactly what differs:

- expanded: ``kv_b_proj`` over all ``N`` cached latents every step (``2 N r H (dn + dv)`` FLOPs), then
  16-head attention over the decompressed K/V;
- absorbed: ``W_UK`` into the query and ``W_UV`` onto the output (``2 H r (dn + dv)`` FLOPs), then one
  multi-query attention over ``[c_kv | k_rope]`` (the 16 heads stacked as 16 query rows).

The HF peer runs the same weights through ``DeepseekV2Attention`` with a ``DynamicCache`` of latents
(HF expands the whole cache every step, as the expanded path does). After every step the caches are
cropped back to ``N`` so all repeats see the same context.

Floor: FLOPs over the measured GEMM rate, and bytes that must move over the measured copy bandwidth
(weights once, the latent cache once; the expanded path also writes and reads its per-head K/V).

Timing: the paths run round-robin (absorbed, expanded, HF), every repeat a set; each ratio is its median
and range over the paired repeats, and the target is met only when the slowest repeat meets it. The
agreement pass before timing is the warm-up.

Published configuration (the defaults): 1 thread, process CPU time (every path runs single-threaded),
5 repeats. Expected time on a quiet 2-core machine: about 2 minutes, most of it the expanded and HF
paths at N = 32768.

    python benchmarks/mla.py [--quick] [--repeat R] [--threads N] [--wall-time]
"""

from __future__ import annotations

import time

import torch

from _harness import Suite, gemm_rate, median_ms, parse_args, ratio, target, time_interleaved
from qkv.cache import KVCache
from qkv.costs import gqa_kv_bytes_per_token, mla_kv_bytes_per_token
from qkv.nn.latent import LatentAttention, LatentConfig, path_flops
from qkv.nn.norm import rms_norm

CONFIG = dict(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128)


def copy_bandwidth(n_bytes: int = 1 << 28) -> float:
    """Bytes per second moved (read + write) by a large ``clone``: the denominator of the memory floor."""
    src = torch.empty(n_bytes // 4, dtype=torch.float32).normal_()
    src.clone()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        src.clone()
        times.append(time.perf_counter() - t0)
    return 2 * n_bytes / sorted(times)[len(times) // 2]


def common_flops(c: LatentConfig) -> int:
    """Per token, both paths: q_proj, kv_a_proj_with_mqa, o_proj."""
    H, d = c.num_attention_heads, c.hidden_size
    return 2 * d * H * c.qk_head_dim + 2 * d * (c.kv_lora_rank + c.qk_rope_head_dim) + 2 * H * c.v_head_dim * d


def bytes_moved(c: LatentConfig, n: int, path: str, elem: int = 4) -> int:
    """Bytes a decode step must move at least: every weight once, the cached latents once; the expanded
    path also writes and reads back its decompressed per-head K/V."""
    H = c.num_attention_heads
    weights = sum((c.hidden_size * H * c.qk_head_dim, c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim),
                   c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim), H * c.v_head_dim * c.hidden_size))
    cache = n * (c.kv_lora_rank + c.qk_rope_head_dim)
    expanded_kv = 2 * n * H * (c.qk_head_dim + c.v_head_dim) if path == "expanded" else 0
    return (weights + cache + expanded_kv) * elem


def hf_peer(module: LatentAttention, c_kv: torch.Tensor, k_rope: torch.Tensor):
    """HF's DeepseekV2Attention with ``module``'s weights and a DynamicCache holding the same latents, or
    None when transformers is not installed."""
    try:
        from transformers import DeepseekV2Config, DynamicCache
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf
    except ImportError:
        return None
    cfg = DeepseekV2Config(**CONFIG, num_key_value_heads=16, num_hidden_layers=1, vocab_size=16, intermediate_size=64,
                           moe_intermediate_size=32, n_routed_experts=2, max_position_embeddings=1 << 17,
                           attn_implementation="sdpa")
    attn = hf.DeepseekV2Attention(cfg, layer_idx=0).eval()
    attn.load_state_dict(module.state_dict())
    rotary = hf.DeepseekV2RotaryEmbedding(cfg)
    cache = DynamicCache()
    cache.update(c_kv.unsqueeze(1), k_rope.unsqueeze(1), 0)

    def step(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = attn(x, attention_mask=None, cache=cache, position_embeddings=rotary(x, position))[0]
        cache.crop(-1)  # transformers 5: a negative count of tokens to drop
        return out

    return step


def measure(module: LatentAttention, n: int, *, rate: float, bandwidth: float, repeat: int, cpu: bool) -> dict:
    """One row: every path's per-token time over a cache of ``n`` latents, FLOPs, floors, agreement."""
    cfg = module.config
    c_kv = rms_norm(torch.randn(1, n, cfg.kv_lora_rank))
    k_rope = torch.randn(1, n, cfg.qk_rope_head_dim)
    cache = KVCache([module.cache_spec()])
    cache.update_latent(0, c_kv, k_rope, positions=torch.arange(n).view(1, n))  # keys taken as already rotated
    x = torch.randn(1, 1, cfg.hidden_size)
    position = torch.tensor([[n]])

    def step(path: str) -> torch.Tensor:
        out = module(x, positions=position, cache=cache, path=path).out
        cache.crop(n)
        return out

    fns = {"absorbed": lambda: step("absorbed"), "expanded": lambda: step("expanded")}
    hf = hf_peer(module, c_kv, k_rope)
    if hf is not None:
        fns["hf"] = lambda: hf(x, position)
    outs = {name: fn() for name, fn in fns.items()}
    diff = max(float((o - outs["expanded"]).abs().max()) for o in outs.values())
    t = time_interleaved(fns, warmup=0, repeat=repeat, cpu=cpu, samples=True)  # the pass above warmed up
    ms = {name: median_ms(s) for name, s in t.items()}
    expanded_flops, absorbed_flops = (f + common_flops(cfg) for f in path_flops(cfg, 1, n + 1))
    floors = {p: max(f / rate, bytes_moved(cfg, n, p) / bandwidth)
              for p, f in (("absorbed", absorbed_flops), ("expanded", expanded_flops))}
    speedup = ratio(t["expanded"], t["absorbed"])
    row = {"N": n, "auto": module.explain_path(1, n + 1).path, "absorbed_ms": ms["absorbed"],
           "expanded_ms": ms["expanded"], "hf_ms": ms.get("hf", float("nan")),
           "expanded/absorbed": speedup, "hf/absorbed": ratio(t["hf"], t["absorbed"]) if "hf" in t else "-",
           "absorbed_GFLOP": absorbed_flops / 1e9, "expanded_GFLOP": expanded_flops / 1e9,
           "absorbed_floor_ms": floors["absorbed"] * 1e3, "expanded_floor_ms": floors["expanded"] * 1e3,
           "absorbed/floor": ms["absorbed"] / 1e3 / floors["absorbed"],
           "expanded/floor": ms["expanded"] / 1e3 / floors["expanded"],
           "max_abs_diff": diff, "target": target(speedup, ">=", 2.0) if n >= 32768 else "-"}
    return row


def main(argv=None) -> None:
    args = parse_args(__doc__, argv, threads=1, cpu_time=True)  # the published configuration
    contexts = [256] if args.quick else [4096, 32768]
    repeat = args.repeat or (2 if args.quick else 5)
    torch.manual_seed(0)
    cfg = LatentConfig(**CONFIG)
    rate, bandwidth = gemm_rate(cpu=args.cpu_time), copy_bandwidth()
    suite = Suite("mla", "MLA decode per token: absorbed vs expanded (and HF DeepseekV2Attention), float32",
                  gemm_gflops=round(rate / 1e9, 1), copy_gbps=round(bandwidth / 1e9, 1), B=1, Nq=1, dtype="float32",
                  **CONFIG, cache="qkv.cache.KVCache(LatentSpec), Dynamic", repeats=repeat,
                  clock="process CPU time" if args.cpu_time else "wall")
    with torch.no_grad():
        module = LatentAttention(cfg).eval()
        for n in contexts:
            suite.add({}, measure(module, n, rate=rate, bandwidth=bandwidth, repeat=repeat, cpu=args.cpu_time))
    suite.note("Target: absorbed >= 2x faster per token than expanded at N = 32768, in every paired repeat "
               "(ratios: the median, then the lowest and highest repeat). Floor = max(FLOPs / GEMM "
               "rate, bytes / copy bandwidth); max_abs_diff compares every path's output with the expanded one.")
    suite.finish()

    width = Suite("mla_cache", "KV-cache bytes per token per layer, same model width (2048 = 16 x 128)",
                  dtype="bf16 (costs) and float32 (measured)")
    mla_bf16 = mla_kv_bytes_per_token(cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype="bf16")
    measured = KVCache([module.cache_spec()])
    measured.update_latent(0, torch.randn(1, 64, cfg.kv_lora_rank), torch.randn(1, 64, cfg.qk_rope_head_dim),
                           positions=torch.arange(64).view(1, 64))
    measured_fp32 = measured.memory().layers[0].used_bytes / 64
    rows = [("MLA latent + rope key (r=512, dr=64)", mla_bf16, measured_fp32),
            ("MHA, 16 kv heads x 128", gqa_kv_bytes_per_token(16, 128, dtype="bf16"), None),
            ("GQA, 8 kv heads x 128", gqa_kv_bytes_per_token(8, 128, dtype="bf16"), None),
            ("MQA, 1 kv head x 128", gqa_kv_bytes_per_token(1, 128, dtype="bf16"), None),
            ("MLA decompressed K/V, 16 x (192 + 128)", gqa_kv_bytes_per_token(16, 192, v_head_dim=128, dtype="bf16"),
             None)]
    for name, bf16, fp32 in rows:
        width.add({"layout": name}, {"bf16_bytes": int(bf16), "vs_MLA": bf16 / mla_bf16,
                                     "measured_fp32_bytes": "-" if fp32 is None else int(fp32)})
    width.finish()


if __name__ == "__main__":
    main()
