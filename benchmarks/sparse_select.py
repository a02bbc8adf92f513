"""Sparse attention by selection: attention over K listed keys per query (``masks.topk`` on the gather
backend, as DeepSeek Sparse Attention and MoBA run it) against dense causal torch SDPA, forward, on the same
inputs, at N = 4K .. 32K.

Lists: every query at position ``p`` lists ``K`` distinct keys spread over ``0 .. p`` (one key drawn from each
of K equal slices; all ``p + 1`` keys when ``p + 1 <= K``), shared by the query heads as DSA's indexer picks
them. Two list lengths: ``K = 2048`` (DeepSeek-V3.2's ``index_topk``) and ``K = 64 * ceil(N / 1024)``.

Per row: the median time of each (paired round-robin repeats), the ratio dense/selected with its range,
peak resident-memory growth of one call (sampled every millisecond: the profiler's per-op records would
themselves fill the memory of a call that gathers one query row at a time), and the compute floor of the
selected forward: exactly ``2 * B * Hq * pairs * (D + Dv)`` FLOPs (:func:`qkv.costs.topk_attention_flops`) over
the measured GEMM rate. The crossover is the shortest N at which the selected forward beats dense in every repeat. The
decode table times one query over a context of N keys: the selected step reads K keys, so it stays flat in
the context once N > K, while dense SDPA grows with N.

Targets (judged on the slowest repeat): at N = 32768 with K = 2048 the selected forward at least 4x faster
than dense causal SDPA and within 2x of its FLOP floor.

HF's eager DeepSeek-V3.2 attention (``hf_eager``: transformers' own ``eager_attention_forward`` of ``deepseek_v32``
after the layer's scatter of the lists into an (N, N) mask, timed from the scatter on) runs on the ``K = 2048``
lists while its (Hq, N, N) float32 scores fit this machine; it materializes every score, so beyond that it is
not run and the table says so.

On CPU the selected forward runs qkv's compiled gather kernel (``qkv/cpu/csrc/gather_attention.cpp``: blocks of 64
query rows walk the keys window by window, reading each row's listed keys in place, the 16 query heads of a list in
vector lanes, an online softmax); the ``path`` column is what ``qkv.explain`` reports for the call (the kernel,
or the torch ops and why).

Published configuration (the defaults): B=1, Hq=16, Hkv=1 (lists shared, MQA as MLA's latent attention),
D=Dv=128, float32 on CPU (bfloat16 on CUDA), 1 thread, process CPU time, 3 repeats.

    python benchmarks/sparse_select.py [--quick] [--repeat R] [--threads N] [--wall-time]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import qkv
from _harness import Suite, gemm_rate, median_ms, parse_args, peak_rss_during, ratio, target, time_interleaved
from qkv.costs import topk_attention_flops, topk_pairs


def causal_lists(n: int, k: int, *, seed: int = 0, device="cpu") -> torch.Tensor:
    """(1, 1, n, k) distinct keys per row spread over 0 .. p (one per slice), -1 past p + 1 keys."""
    g = torch.Generator().manual_seed(seed)
    p = torch.arange(n, dtype=torch.float64).view(n, 1) + 1  # keys visible to row p: p + 1
    j = torch.arange(k, dtype=torch.float64).view(1, k)
    u = torch.rand(n, k, generator=g, dtype=torch.float64)
    spread = torch.floor((j + u) * p / k).to(torch.int64)  # slice j of width (p + 1) / k >= 1: distinct
    dense = torch.arange(k).view(1, k).expand(n, k)
    dense = torch.where(dense < p.to(torch.int64), dense, torch.full_like(dense, -1))  # rows with p + 1 <= k
    idx = torch.where(p >= k, spread, dense)
    return idx.view(1, 1, n, k).to(device)


#: HF's eager DSA runs while its (B, Hq, N, N) float32 scores stay under this (it holds them and their softmax).
HF_SCORES_BYTES = 5 << 30


def _hf_eager(q, k, v, idx):
    """HF DeepSeek-V3.2's eager path on these inputs: the layer's scatter of the top-k lists into a boolean mask
    over its causal float mask, then transformers' ``eager_attention_forward`` (None without transformers)."""
    try:
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import eager_attention_forward
    except ImportError:
        return None
    B, Hq, n, D = q.shape
    module = torch.nn.Module().eval()
    module.num_key_value_groups = Hq // k.shape[1]
    lists = idx.clamp_min(0)[:, 0].to(torch.int32)  # (B, N, K): HF's indexer gives int32 indices, no -1
    causal = torch.full((n, n), torch.finfo(q.dtype).min, dtype=q.dtype).triu_(1).expand(B, 1, n, n)

    def run():
        index_mask = lists.new_ones((B, n, n), dtype=torch.bool).scatter(-1, lists.long(), False).unsqueeze(1)
        mask = causal.masked_fill(index_mask, torch.finfo(q.dtype).min)
        return eager_attention_forward(module, q, k, v, mask, scaling=D ** -0.5)[0]

    return run


def main(argv=None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv, threads=1, cpu_time=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    B, Hq, Hkv, D = 1, 16, 1, 128
    lengths = [1024, 2048] if args.quick else [4096, 8192, 16384, 32768]
    big_k = 256 if args.quick else 2048
    repeat = args.repeat or (2 if args.quick else 3)
    rate = gemm_rate(dtype, device, cpu=args.cpu_time and device == "cpu")
    suite = Suite("sparse_select", "attention over K listed keys (gather) vs dense causal SDPA, forward",
                  B=B, Hq=Hq, Hkv=Hkv, D=D, dtype=str(dtype).replace("torch.", ""), backend="gather",
                  kernel="qkv gather (compiled CPU kernel where explain says so) / torch SDPA is_causal", cache=False,
                  gemm_gflops=round(rate / 1e9, 1),
                  clock="process CPU time" if args.cpu_time else "wall")
    torch.manual_seed(0)
    wins: dict[str, list[tuple[int, bool]]] = {}
    for n in lengths:
        q = torch.randn(B, Hq, n, D, device=device, dtype=dtype)
        k, v = (torch.randn(B, Hkv, n, D, device=device, dtype=dtype) for _ in range(2))
        for rule, K in ((f"K={big_k}", big_k), ("K=64*ceil(N/1024)", 64 * math.ceil(n / 1024))):
            idx = causal_lists(n, K, device=device)
            mask = qkv.masks.topk(idx) & qkv.masks.causal()
            with torch.no_grad():
                sel = lambda: qkv.attention(q, k, v, mask=mask, backend="gather")  # noqa: E731
                dense = lambda: F.scaled_dot_product_attention(  # noqa: E731
                    q, k, v, is_causal=True, enable_gqa=True)
                tail = qkv.masks.topk(idx[:, :, -64:]) & qkv.masks.causal()  # the last 64 rows, by the reference
                ref = qkv.attention(q[:, :, -64:], k, v, mask=tail, backend="reference")
                err = float((sel()[:, :, -64:].float() - ref.float()).abs().max())
                fns = {"sel": sel, "dense": dense}
                hf = _hf_eager(q, k, v, idx) if K == big_k and B * Hq * n * n * 4 <= HF_SCORES_BYTES else None
                if hf is not None:
                    fns["hf_eager"] = hf
                t = time_interleaved(fns, warmup=1, repeat=repeat, cpu=args.cpu_time, samples=True)
                mem_sel, mem_dense = peak_rss_during(sel), peak_rss_during(dense)
                hf_cols = ({"hf_eager_ms": median_ms(t["hf_eager"]), "hf_eager/sel": ratio(t["hf_eager"], t["sel"]),
                            "hf_eager_peak_MB": peak_rss_during(hf) / 1e6} if hf is not None else
                           {"hf_eager_ms": "not run" if K == big_k else "-"})
                why = str(qkv.explain(q, k, v, mask=mask).estimates["gather"])
            path = "compiled kernel" if "compiled CPU kernel" in why else why[why.find("as torch ops"):]
            flops = topk_attention_flops(B, Hq, n, n, K, D)
            floor_ms = flops / rate * 1e3
            speedup = ratio(t["dense"], t["sel"])
            over_floor = {key: val / floor_ms for key, val in
                          {"median": median_ms(t["sel"]), "min": min(t["sel"]) * 1e3,
                           "max": max(t["sel"]) * 1e3}.items()} | {"n": len(t["sel"])}
            judged = n == 32768 and K == 2048
            met = "met" if target(speedup, ">=", 4.0) == "met" and target(over_floor, "<=", 2.0) == "met" else "missed"
            wins.setdefault(rule, []).append((n, speedup["min"] > 1.0))
            suite.add({"N": n, "lists": rule, "K": K},
                      {"sel_ms": median_ms(t["sel"]), "dense_ms": median_ms(t["dense"]), "dense/sel": speedup,
                       "floor_ms": floor_ms, "sel/floor": over_floor, "pairs/N": topk_pairs(n, n, K) / n,
                       "sel_peak_MB": mem_sel / 1e6, "dense_peak_MB": mem_dense / 1e6,
                       **hf_cols, "max|tail err|": err, "path": path, "target": met if judged else ""})
    for rule, seen in wins.items():
        cross = next((n for n, win in seen if win), None)
        suite.note(f"crossover ({rule}): " + (f"selected beats dense in every repeat from N = {cross}" if cross
                                              else "not reached in the measured lengths"))
    suite.note("Targets at N=32768, K=2048: dense/sel >= 4 and sel/floor <= 2, on the slowest repeat. 'max|tail "
               "err|' compares the last 64 rows with the reference backend.")
    suite.finish()
    decode_table(args, device, dtype, B, Hq, Hkv, D, big_k, lengths, repeat)


def decode_table(args, device, dtype, B, Hq, Hkv, D, K, lengths, repeat) -> None:
    """One query over N cached keys: the selected step reads K keys whatever N is."""
    suite = Suite("sparse_select_decode", "decode step: one query over N keys, K listed vs dense SDPA", B=B, Hq=Hq,
                  Hkv=Hkv, D=D, K=K, dtype=str(dtype).replace("torch.", ""), backend="gather", cache=True,
                  clock="process CPU time" if args.cpu_time else "wall")
    first = None
    for n in [K // 2, *lengths]:
        q = torch.randn(B, Hq, 1, D, device=device, dtype=dtype)
        k, v = (torch.randn(B, Hkv, n, D, device=device, dtype=dtype) for _ in range(2))
        idx = causal_lists(n, K, device=device)[:, :, -1:]
        mask = qkv.masks.topk(idx) & qkv.masks.causal()
        with torch.no_grad():
            t = time_interleaved({
                "sel": lambda: qkv.attention(q, k, v, mask=mask, backend="gather"),
                "dense": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            }, warmup=2, repeat=max(repeat, 3), cpu=args.cpu_time, number=5, samples=True)
        sel_ms = median_ms(t["sel"])
        first = sel_ms if n >= K and first is None else first
        suite.add({"context": n}, {"sel_ms": sel_ms, "dense_ms": median_ms(t["dense"]),
                                   "dense/sel": ratio(t["dense"], t["sel"]),
                                   "sel / sel at first N >= K": sel_ms / first if first else float("nan")})
    suite.note("Flat in context: beyond N = K the selected step reads K keys, so its time stays near the first "
               "N >= K row while dense SDPA grows with N.")
    suite.finish()


if __name__ == "__main__":
    main()
