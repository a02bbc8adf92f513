"""Decoding with KV caches on a small decoder (``qkv.nn.DecoderLM``, Llama shape, width 256, 4 layers).

Five tables:

1. ``decode``: single-token decode tokens/s with a cache (dynamic, static, paged) against full
   recomputation of the whole sequence per token, at context 256, 1024, 4096 (target: >= 10x at 1024).
2. ``decode_memory``: a batch of mixed prompt lengths; bytes allocated against bytes the real tokens
   need, for static max-length buffers, dynamic lockstep buffers (left padding) and paged blocks.
3. ``decode_prefix``: a batch sharing a long system prompt; prefill time and blocks with and without
   prefix caching.
4. ``decode_quant``: KIVI int4/int2 and int8 caches; stored bytes per token and logit error against a
   bf16 cache (same model, same tokens, teacher-forced).
5. ``paged_cpu``: one attention call of a decode step over a paged pool (16-token blocks, 8 query / 2 KV heads,
   head dim 64, blocks shuffled in a 4096-block pool), the CPU paths side by side: the padded view (every
   row's blocks gathered to the longest row's count, then SDPA), the torch-op block path (each row's live blocks
   only, in spans) and the compiled kernel (:func:`qkv.backends.paged.paged_decode_blocks` where qkv's CPU kernels
   are built: each row's visible slots read in place), over rows of one length and rows of mixed lengths;
   ``fill`` is the live share of the padded view, which decides between the first two where the kernel is not
   built (``qkv.backends.paged.BLOCKS_BELOW_FILL``).
6. ``decode_keqv``: a Gemma-4-31B-like layer pattern scaled down (5 local layers of 64-wide heads with a 512-token
   window, 1 global layer of 256-wide heads whose one projection gives keys and values), decode step time and cache
   bytes with the K = V layer's values stored alone (``values_only``, the default: keys derived each step) against
   keys and values stored apart (``model.cache_specs(values_only=False)``), same model and tokens; the control row
   for the derivation's cost, which grows with the context the global layer holds.

Timing: cached decode and recomputation (table 1), prefix caching on and off (table 3) run round-robin,
every repeat a pair; each ratio is its median and range over the paired repeats, and the target is met
only when the slowest repeat meets it.

Published configuration (the defaults): 1 thread, process CPU time (everything runs single-threaded), 7
paired repeats for decode speed and 5 for prefix caching. Expected time on a quiet 2-core machine: about
1.5 minutes.

    python benchmarks/decode.py [--quick] [--repeat R] [--threads N] [--wall-time]
"""

from __future__ import annotations

import time

import torch

from _harness import Suite, median_ms, parse_args, ratio, target, time_interleaved
from qkv.backends.paged import BLOCKS_BELOW_FILL, BLOCKS_MIN_SLOTS
from qkv.cache import KIVI, Dynamic, Int8, KVCache, Paged, Static
from qkv.models.generate import forward_step, generate, prefill


def _model(dtype=torch.float32, max_pos=8192):
    from qkv.nn import DecoderLM, get_config

    torch.manual_seed(0)
    cfg = get_config("tiny-llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                     intermediate_size=688, vocab_size=512, max_position_embeddings=max_pos)
    return DecoderLM(cfg).to(dtype).eval(), cfg


def _ids(B, N, vocab=512, seed=0):
    return torch.randint(0, vocab, (B, N), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def decode_speed(suite: Suite, contexts, repeat: int, cpu: bool, steps: int = 8) -> None:
    model, cfg = _model()
    for ctx in contexts:
        ids = _ids(1, ctx + steps)
        pos = torch.arange(ctx + steps).view(1, -1)
        fns = {}
        for name, storage in (("dynamic", Dynamic()), ("static", Static(ctx + steps)),
                              ("paged", Paged(block_size=16, num_blocks=(ctx + steps) // 16 + 2))):
            cache = KVCache(model, storage=storage)
            prefill(model, cache, ids[:, :ctx], pos[:, :ctx], 512)

            def run(cache=cache):  # `steps` single-token steps, then roll them back for the next repeat
                for t in range(ctx, ctx + steps):
                    forward_step(model, cache, ids[:, t:t + 1], pos[:, t:t + 1])
                cache.crop(-steps)

            fns[name] = run
        fns["recompute"] = lambda: model(ids[:, :ctx + 1], positions=pos[:, :ctx + 1], cache=None)
        t = time_interleaved(fns, warmup=1, repeat=repeat, cpu=cpu, samples=True)
        row = {"recompute_tok_s": 1e3 / median_ms(t["recompute"])}
        for name in ("dynamic", "static", "paged"):
            row[f"{name}_tok_s"] = steps * 1e3 / median_ms(t[name])
        speedup = ratio([steps * r for r in t["recompute"]], t["dynamic"])  # per-token time, paired repeats
        row["speedup_dynamic"] = speedup
        row["target"] = target(speedup, ">=", 10.0) if ctx == 1024 else "-"
        suite.add({"context": ctx, "B": 1, "d_model": cfg.hidden_size, "layers": cfg.num_hidden_layers}, row)


@torch.no_grad()
def memory_waste(suite: Suite, lengths: list[int], new: int) -> None:
    model, _ = _model()
    N = max(lengths)
    ids = _ids(len(lengths), N, seed=1)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, N - n:] = 1
    for name, storage in (("static max-length", Static(N + new)), ("dynamic (lockstep)", Dynamic()),
                          ("paged block 16", Paged(block_size=16, num_blocks=4096))):
        cache = KVCache(model, storage=storage)
        generate(model, ids, attention_mask=mask, max_new_tokens=new + 1, cache=cache, prefill_chunk_size=512)
        mem = cache.memory()
        suite.add({"storage": name, "rows": len(lengths), "lengths": f"{min(lengths)}..{max(lengths)}"},
                  {"allocated_MiB": mem.allocated_bytes / 2**20, "needed_MiB": mem.used_bytes / 2**20,
                   "wasted_pct": 100 * mem.wasted_fraction})


@torch.no_grad()
def shared_prefix(suite: Suite, system_len: int, users: int, user_len: int, repeat: int, cpu: bool) -> None:
    model, _ = _model()
    clock = time.process_time if cpu else time.perf_counter
    system = _ids(1, system_len, seed=2)
    batch = torch.cat([system.expand(users, system_len), _ids(users, user_len, seed=3)], dim=1)
    times: dict[bool, list[float]] = {False: [], True: []}
    blocks, hits = {}, {}
    for r in range(repeat + 1):  # round 0 warms up; then paired repeats, caching off and on in turn
        for caching in (False, True):
            cache = KVCache(model, storage=Paged(block_size=16, num_blocks=2048, prefix_caching=caching))
            if caching:  # an earlier request that carried the same system prompt
                generate(model, torch.cat([system, _ids(1, user_len, seed=9)], 1), max_new_tokens=1, cache=cache)
                cache.reset()
            t0 = clock()
            out = generate(model, batch, max_new_tokens=1, cache=cache)
            if r:
                times[caching].append(clock() - t0)
            blocks[caching] = cache.pool_stats()["full_attention"].blocks_in_use
            hits[caching] = int(out.prefix_hits.sum())
    for caching in (False, True):
        suite.add({"prefix_caching": caching, "rows": users, "system_tokens": system_len, "user_tokens": user_len},
                  {"prefill_ms": median_ms(times[caching]), "speedup": ratio(times[False], times[caching]),
                   "blocks_in_use": blocks[caching], "memory_saved_pct": 100 * (1 - blocks[caching] / blocks[False]),
                   "reused_tokens": hits[caching]})


@torch.no_grad()
def paged_cpu(suite: Suite, repeat: int, cpu: bool, quick: bool) -> None:
    from qkv import attention
    from qkv import masks as M
    from qkv.backends.paged import _blocks, gather_head_major, paged_decode_blocks
    from qkv.cpu import kernels

    has_kernel = kernels.unavailable_reason() is None

    T, Hq, Hkv, D, P = 16, 8, 2, 64, 4096
    g = torch.Generator().manual_seed(7)
    kp, vp = torch.randn(P, Hkv, T, D, generator=g), torch.randn(P, Hkv, T, D, generator=g)
    top = 128 if quick else 640
    cases = [("one length", 32, top, 1.0), ("one long row", 1, 8 * top, 1.0),
             ("mixed, 0.6..1 of the longest", 32, top, 0.6), ("mixed, 0.03..1 (a request stream)", 32, top, 0.03),
             ("a short stream", 32, top // 4, 0.03),
             ("a long stream", 8, 2 * top, 0.03)]
    for name, B, longest, lo in cases:
        lens = [longest] + torch.randint(int(lo * longest), longest + 1, (B - 1,), generator=g).tolist()
        B, nb = len(lens), -(-max(lens) // T)
        order = torch.randperm(P, generator=g)
        tables, kpos, used = torch.zeros(B, nb, dtype=torch.int64), torch.full((B, nb * T), -1), 0
        for b, n in enumerate(lens):
            tables[b, :-(-n // T)] = order[used:used - (-n // T)]
            used += -(-n // T)
            kpos[b, :n] = torch.arange(n)
        qpos = torch.tensor(lens) - 1
        q = torch.randn(B, Hq, D, generator=g)

        def padded():
            k, v = gather_head_major(kp, tables), gather_head_major(vp, tables)
            return attention(q[:, :, None], k, v, mask=M.positions(qpos[:, None], kpos))[:, :, 0]

        def blocks():  # the torch-op block path
            return _blocks(q, kp, vp, tables, kpos, qpos, None, None)[0]

        def compiled():  # what paged_decode_blocks runs where qkv's CPU kernels are built
            return paged_decode_blocks(q, kp, vp, tables, kpos, qpos)[0]

        err = max(float((padded() - f()).abs().max()) for f in (blocks, compiled))
        fns = {"padded": padded, "blocks": blocks} | ({"compiled": compiled} if has_kernel else {})
        t = time_interleaved(fns, repeat=repeat, cpu=cpu, samples=True)
        fill = sum(lens) / (B * nb * T)
        ragged = fill <= BLOCKS_BELOW_FILL and B * nb * T >= BLOCKS_MIN_SLOTS
        taken = "compiled" if has_kernel else "blocks" if ragged else "padded"
        row = {"padded_ms": median_ms(t["padded"]), "blocks_ms": median_ms(t["blocks"]),
               "padded/blocks": ratio(t["padded"], t["blocks"])}
        if has_kernel:
            row |= {"compiled_ms": median_ms(t["compiled"]), "padded/compiled": ratio(t["padded"], t["compiled"]),
                    "blocks/compiled": ratio(t["blocks"], t["compiled"])}
        suite.add({"rows": name, "B": B, "longest": max(lens), "fill": round(fill, 3), "slots": B * nb * T},
                  row | {"path taken": taken, "max_abs_diff": err})


@torch.no_grad()
def quantized(suite: Suite, prompt: int, steps: int) -> None:
    model, cfg = _model(torch.bfloat16)
    ids = _ids(1, prompt)
    ref_cache = KVCache(model)
    out = generate(model, ids, max_new_tokens=steps, cache=ref_cache, return_logits=True, prefill_chunk_size=512)
    seq = out.sequences
    pos = torch.arange(seq.shape[1]).view(1, -1)
    tokens = ref_cache.seq_length
    layers = len(cfg.layer_types)

    def teacher_forced(cache):
        logits = [prefill(model, cache, seq[:, :prompt], pos[:, :prompt], 512)]
        for t in range(prompt, prompt + steps - 1):
            logits.append(forward_step(model, cache, seq[:, t:t + 1], pos[:, t:t + 1])[:, -1])
        return torch.stack(logits, 1).float()

    base = teacher_forced(KVCache(model))
    bf16_bpt = ref_cache.memory().used_bytes / tokens / layers
    for name, quant in (("bf16", None), ("int8 per token", Int8()), ("KIVI int4 g32 r128", KIVI(4, 32, 128)),
                        ("KIVI int2 g32 r128", KIVI(2, 32, 128))):
        cache = KVCache(model, quant=quant)
        logits = teacher_forced(cache)
        bpt = cache.memory().used_bytes / cache.seq_length / layers
        err = cache.quant_error()
        suite.add({"cache": name, "context": tokens},
                  {"bytes_per_token_layer": bpt, "vs_bf16": bpt / bf16_bpt,
                   "long_context_vs_bf16": quant.bytes_per_element(cfg.head_dim) / 2 if quant else 1.0,
                   "max_logit_err": float((logits - base).abs().max()),
                   "mean_logit_err": float((logits - base).abs().mean()),
                   "argmax_agree_pct": 100 * float((logits.argmax(-1) == base.argmax(-1)).float().mean()),
                   "key_err<=bound": f"{err.key_max_error:.3g}<={err.key_bound:.3g}" if quant else "-",
                   "value_err<=bound": f"{err.value_max_error:.3g}<={err.value_bound:.3g}" if quant else "-"})
    suite.note(f"logit std of the bf16 run: {float(base.std()):.3f}; errors are against the bf16 cache. "
               "long_context_vs_bf16: packed codes + fp16 scales/zeros per element once the full-precision "
               "residual is negligible.")


def _keqv_model():
    from qkv.config.rope import RopeParams
    from qkv.nn import DecoderConfig, DecoderLM

    S, F = "sliding_attention", "full_attention"
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=512, hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1024, hidden_act="gelu_pytorch_tanh", sandwich_norms=True, qk_norm=True,
        attention_scale=1.0, value_norm=True, sliding_window=512, layer_types=(S,) * 5 + (F,),
        rope={S: RopeParams(theta=10000.0),
              F: RopeParams(theta=1e6, scaling={"rope_type": "proportional"}, partial_rotary_factor=0.25)},
        head_dim_by_type={F: 256}, kv_heads_by_type={F: 2}, k_eq_v_types=(F,), max_position_embeddings=32768)
    return DecoderLM(cfg).eval(), cfg


@torch.no_grad()
def keqv_cache(suite: Suite, contexts, repeat: int, cpu: bool, steps: int = 8) -> None:
    from qkv.cpu import optimize

    model, cfg = _keqv_model()
    optimize(model)
    for ctx in contexts:
        ids = _ids(1, ctx + steps)
        pos = torch.arange(ctx + steps).view(1, -1)
        fns, nbytes, logits = {}, {}, {}
        for name, values_only in (("values_only", True), ("keys_and_values", False)):
            cache = KVCache(model.cache_specs(values_only=values_only), rollback=steps)
            prefill(model, cache, ids[:, :ctx], pos[:, :ctx], 512)
            nbytes[name] = cache.memory().used_bytes
            logits[name] = forward_step(model, cache, ids[:, ctx:ctx + 1], pos[:, ctx:ctx + 1])
            cache.crop(-1)

            def run(cache=cache):  # `steps` single-token steps, then roll them back for the next repeat
                for t in range(ctx, ctx + steps):
                    forward_step(model, cache, ids[:, t:t + 1], pos[:, t:t + 1])
                cache.crop(-steps)

            fns[name] = run
        t = time_interleaved(fns, warmup=1, repeat=repeat, cpu=cpu, samples=True)
        suite.add({"context": ctx, "B": 1},
                  {"values_only_step_ms": median_ms(t["values_only"]) / steps,
                   "both_step_ms": median_ms(t["keys_and_values"]) / steps,
                   "time_values_only/both": ratio(t["values_only"], t["keys_and_values"]),
                   "cache_MiB_values_only": nbytes["values_only"] / 2**20,
                   "cache_MiB_both": nbytes["keys_and_values"] / 2**20,
                   "bytes_values_only/both": nbytes["values_only"] / nbytes["keys_and_values"],
                   "max_logit_diff": float((logits["values_only"] - logits["keys_and_values"]).abs().max())})


def main(argv=None) -> None:
    args = parse_args(__doc__, argv, threads=1, cpu_time=True)  # the published configuration
    quick = args.quick
    repeat = args.repeat or (2 if quick else 7)
    ctx = dict(model="DecoderLM tiny-llama d256 L4 H4 KV2", dtype="float32", threads=torch.get_num_threads(),
               clock="process CPU time" if args.cpu_time else "wall")

    s1 = Suite("decode", "single-token decode, cache vs full recomputation (B=1)", **ctx, backend="auto")
    decode_speed(s1, [128] if quick else [256, 1024, 4096], repeat, args.cpu_time)
    s1.note("target: cached decode >= 10x full recomputation at context 1024, in every paired repeat "
            "(speedup_dynamic: the median, then the lowest and highest repeat)")
    s1.finish()

    s2 = Suite("decode_memory", "mixed-length batch: allocated vs needed KV bytes", **ctx)
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(32, 256 if quick else 2048, (8,), generator=g).tolist()
    memory_waste(s2, lengths, new=16)
    s2.finish()

    s3 = Suite("decode_prefix", "shared system prompt, prefix caching on/off (paged, block 16)", **ctx)
    shared_prefix(s3, 128 if quick else 1024, 8, 32, args.repeat or (2 if quick else 5), args.cpu_time)
    s3.finish()

    s4 = Suite("decode_quant", "quantized caches: bytes per token and logit error vs a bf16 cache",
               **{**ctx, "dtype": "bfloat16"})
    quantized(s4, 128 if quick else 1024, 16 if quick else 32)
    s4.finish()

    s5 = Suite("paged_cpu", "paged decode attention on CPU: the padded view vs the block path, one call",
               **{**ctx, "model": "none: one attention call, 8 query / 2 KV heads, head dim 64, 16-token blocks"})
    paged_cpu(s5, repeat, args.cpu_time, quick)
    s5.note("Where qkv's compiled CPU kernels are built (qkv.cpu.kernels), every CPU decode step takes the compiled "
            "kernel (compiled: paged_decode_blocks reading each row's visible slots in place). Without them the cache "
            f"takes the torch-op block path (blocks) when fill <= {BLOCKS_BELOW_FILL} and the padded view holds at "
            f"least {BLOCKS_MIN_SLOTS} slots (qkv.backends.paged.BLOCKS_BELOW_FILL, BLOCKS_MIN_SLOTS), else the padded "
            "view. Ratios: the first path's time over the second's, median and range over paired repeats.")
    s5.finish()

    s6 = Suite("decode_keqv", "K = V layers cached once (values_only) vs keys and values stored apart",
               **{**ctx, "model": "DecoderLM Gemma-4-like d512 L6 (5 local H8/KV4 x64, window 512; 1 global "
                                   "KV2 x256, K = V), qkv.cpu.optimize"})
    keqv_cache(s6, [512] if quick else [1024, 4096, 16384], repeat, args.cpu_time)
    s6.note("values_only stores the global layer's values alone and derives its keys (key-norm scale, RoPE) from "
            "every stored value each step; bytes_values_only/both falls toward 0.5 as the global layer's share of "
            "the cache grows with the context (local layers keep their 512-token window either way). The derivation "
            "reads the stored values and writes the keys each step (a multiply over every channel, a rotation of "
            "the turning quarter) before attention reads both: about twice the global layer's cache traffic of a "
            "two-tensor store. This model's weights are 20 MB, so that traffic is most of a long-context step; in a "
            "real Gemma 4 the weights a step reads dwarf it until far longer contexts. A fused decode kernel "
            "deriving keys in registers would read half a two-tensor store's bytes (not built). Ratios: median "
            "and range over paired repeats.")
    s6.finish()


if __name__ == "__main__":
    main()
