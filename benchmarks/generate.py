"""Greedy decoding speed: qkv against HF transformers ``generate`` with the same weights, in one run.

Models: a Llama-like, a DeepSeek-V2-like, a GPT-OSS-like, a DeepSeek-V3-like, a Qwen3-Next-like and a Gemma-4-like
decoder
(4 layers, width 512, vocabulary 32000; MLA and MoE for DeepSeek; GPT-OSS: sinks, alternating window-32 and
global layers, a biased router over clamped-SwiGLU experts; DeepSeek-V3: q-LoRA, sigmoid group-limited routing;
Qwen3-Next: three Gated DeltaNet layers, whose recurrent state the cache keeps, then a gated full-attention
layer, experts with a gated shared expert), and SmolLM3-like and Gemma-4-like ones at the published small models'
shapes scaled to this machine (12 layers of width 1024 with their real vocabularies; SmolLM3: GQA 16:4, 128,256
tokens, every 4th layer NoPE, a tied head; Gemma 4: see ``_gemma4_like``, 262,144 tokens; both judged at batch 1
and 8), random weights, built by HF and converted with
``qkv.models.from_hf``. For batch 1,
4 and 8, a 64-token prompt and 64 new tokens (``--quick``: a tiny model, 16 + 16):

- ``hf``: ``model.generate(do_sample=False)`` with HF's defaults (SDPA attention, ``DynamicCache``);
- ``qkv``: ``qkv.models.generate`` with a preallocated ``KVCache(storage=Static(N + T))`` on the model
  ``from_hf`` returns, with qkv's CPU products (``qkv.cpu.optimize``: row blocks for few rows, oneDNN-packed
  weights for many, as its measured rule says);
- ``qkv_noscreen``: the control row of the greedy head: ``qkv`` with its int8 head screen set aside for the call
  (``_harness.head_screen_off``: the float32 head's product and argmax);
- ``qkv_plain``: the same model without them (``from_hf(..., optimize=False)``, ``generate(...,
  optimize=False)``: ``F.linear`` everywhere), what the CPU products buy;
- ``qkv_bf16exact`` (with ``--bf16-values``, which rounds every random weight to a bfloat16 value, kept float32 for
  HF and qkv alike: a bf16 checkpoint loaded with ``dtype=float32``, as the released models are): the same model with
  ``qkv.cpu.optimize(model, weights="bf16-exact")``, its layers' weights held in bfloat16, the same numbers at half
  the bytes, multiplied in float32 (lossless); the LM head keeps its int8 screen;
- ``qkv_input_major``: ``qkv.cpu.optimize(model, input_major=True)`` (wide weights stored input-major and
  multiplied by column blocks, the default before row blocks of standard-layout weights measured faster
  for a few rows), an ablation of the one choice that is about memory traffic rather than Python overhead.

A streamer timestamps every new token (HF's ``streamer.put``, qkv's ``streamer(tokens)``), so each
decode step (forward, sampling, cache update) is timed on its own: ``decode tok/s = B / median step``
over all steps of all repeats, which a busy machine's occasional stalls do not move; ``prefill`` is the
time to the first token and end-to-end ``tok/s = B T / median total``. Contenders run round-robin under
``torch.inference_mode`` after a warm-up, every repeat a set, so each ratio is per repeat (HF's median
step in that repeat over qkv's; ``decode_ratio_p10`` compares the repeat's 10th-percentile steps, the
least disturbed ones; ``e2e_ratio`` the repeat's totals), reported as the median and range over the
repeats, and a target is met only when the slowest repeat meets it.
Decoding one row at a time streams every weight once per step, so the floor is bytes of weights per
step over memory bandwidth: ``weights_MB`` and the implied ``qkv_GB_per_s`` say how close a step is to it.

Every case runs at torch's default thread count (the whole CPU) and at 1 thread.

Published configuration (the defaults): torch's default threads, then 1 thread; wall clock; 5 paired
repeats of 63 timed steps each. The wall clock because a step's timestamp is taken from the streamer
(a point in time, not an interval of this process's CPU) and because the multi-thread rows are the
point: CPU time would count idle threads' spinning rather than the time a user waits. Expected time on a
quiet 2-core machine: about 11 minutes for the first four models (``--models`` picks some).

Real shapes (``--shapes``, a suite of its own, ``generate_shapes``): the random-weight checkpoints of
``benchmarks/_checkpoints.py`` (Qwen2.5-0.5B, Llama-3.2-1B and Qwen2.5-3B sizes with their vocabularies, unit-scale
weights), loaded by HF (``from_pretrained(dtype=...)``) and by ``qkv.models.from_hf`` (its default
``dtype="auto"``: the checkpoint's) in each of ``--dtypes`` (bfloat16, float32), 128-token prompts, 32 new tokens,
``--batches`` (default 1, 8, 32), ``--threads`` (default 1, 2). Contenders: ``hf``, ``qkv`` and the control
``qkv_noscreen`` (the same model, its int8 greedy head screen set aside for the call: ``_harness.head_screen_off``);
the ablations ``qkv_plain`` and ``qkv_input_major`` are left out there (two more copies of the weights).
``same_tokens`` there compares qkv's greedy tokens with HF's, ``agree`` the mean fraction of a row's tokens before
they first differ (bfloat16 rounds differently in the two), ``distinct`` the distinct tokens qkv emitted. Runtime on
a quiet 2-core machine, 3 repeats (estimated, not yet timed): about 12 minutes per dtype and thread count at 0.5B
(batches 1, 8, 32; batch 32's prefills most of it), twice that at 1B, six times at 3B; Qwen2.5-3B in float32 needs
two 12 GB copies: run it in bfloat16.

Usage: ``python benchmarks/generate.py [--quick] [--repeat R] [--threads T1,T2] [--models M1,M2] [--batches 1,4,8]
[--tag NAME]``, or at real shapes
``python benchmarks/generate.py --shapes qwen2.5-0.5b[,llama-3.2-1b,qwen2.5-3b] [--dtypes bfloat16,float32]
[--batches 1,8,32] [--threads 1,2] [--repeat R] [--tag NAME]`` (``--tag``: writes ``generate_shapes_NAME.json``)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Suite, head_screen_off, ratio, read_rate, step_breakdown, target, token_agreement  # noqa: E402
from qkv.cpu import optimize  # noqa: E402

TARGET = 1.5  # qkv decode tokens/s over HF's
TARGETS = {"gpt-oss-like": 1.8, "deepseek-v3-like": 1.8,  # the 2025 dense families
           "qwen3-next-like": 2.0}  # the hybrid (HF runs its recurrent layers through slow fallbacks)
TARGET_BATCHES = {name: (1, 4) for name in TARGETS}  # their issues judge batch 1 and 4; the rest: every batch
TARGET_BATCHES["smollm3-like"] = (1, 8)  # issue 48 judges batch 1 and 8
TARGET_BATCHES["gemma4-like"] = (1, 8)  # issue 48 judges batch 1 and 8


def _configs(quick: bool) -> dict[str, tuple[str, str, dict]]:
    base = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                num_attention_heads=8, max_position_embeddings=1024)
    if quick:
        base.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    w, heads = base["hidden_size"], base["num_attention_heads"]
    return {
        "llama-like": ("LlamaConfig", "LlamaForCausalLM",
                       dict(base, num_key_value_heads=base["num_attention_heads"] // 4)),
        "deepseek-v2-like": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
            base, q_lora_rank=None, kv_lora_rank=w // 4, qk_nope_head_dim=w // 8, qk_rope_head_dim=w // 16,
            v_head_dim=w // 8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=w // 2, first_k_dense_replace=1)),
        "gpt-oss-like": ("GptOssConfig", "GptOssForCausalLM", dict(
            base, num_key_value_heads=base["num_attention_heads"] // 4, head_dim=w // base["num_attention_heads"],
            intermediate_size=w // 2, num_local_experts=8, num_experts_per_tok=2, sliding_window=32,
            layer_types=["sliding_attention", "full_attention"] * (base["num_hidden_layers"] // 2))),
        "deepseek-v3-like": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
            base, num_key_value_heads=base["num_attention_heads"], q_lora_rank=w // 2, kv_lora_rank=w // 4,
            qk_nope_head_dim=w // 8, qk_rope_head_dim=w // 16, v_head_dim=w // 8, n_routed_experts=8, n_group=4,
            topk_group=2, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=w // 2,
            first_k_dense_replace=1, routed_scaling_factor=2.5)),
        "qwen3-next-like": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
            base, num_key_value_heads=heads // 4, head_dim=w // heads, linear_num_key_heads=heads // 2,
            linear_num_value_heads=heads, linear_key_head_dim=w // heads, linear_value_head_dim=w // heads,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=w // 2, shared_expert_intermediate_size=w // 2,
            layer_types=["linear_attention"] * (base["num_hidden_layers"] - 1) + ["full_attention"])),
        "smollm3-like": ("SmolLM3Config", "SmolLM3ForCausalLM", _smollm3(quick)),
        "gemma4-like": ("Gemma4TextConfig", "Gemma4ForCausalLM", _gemma4_like(quick)),
    }


def _smollm3(quick: bool) -> dict:
    """SmolLM3-3B's shape scaled to this machine: its vocabulary (128,256) and GQA 16:4 of width-64 heads, 12 layers
    of width 1024, every 4th a NoPE layer, tied embeddings (``--quick``: the tiny shape)."""
    cfg = dict(vocab_size=128256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
               num_attention_heads=16, num_key_value_heads=4, no_rope_layer_interval=4, tie_word_embeddings=True,
               max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if quick:
        cfg.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=1)
    return cfg


def _gemma4_like(quick: bool) -> dict:
    """Gemma 4 E2B/E4B's shape scaled to this machine: 12 layers of width 1024 with its real vocabulary (262,144),
    5 local (window 512) : 1 global layers, global heads twice as wide with proportional RoPE, the last 4 layers
    reading earlier layers' keys and values (double-wide MLP there), per-layer input embeddings (16 per layer)."""
    if quick:
        return dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8, num_kv_shared_layers=2,
                    use_double_wide_mlp=True, hidden_size_per_layer_input=4, vocab_size_per_layer_input=512,
                    final_logit_softcapping=30.0, max_position_embeddings=1024)
    return dict(vocab_size=262144, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
                num_attention_heads=8, num_key_value_heads=1, head_dim=128, global_head_dim=256, sliding_window=512,
                num_kv_shared_layers=4, use_double_wide_mlp=True, hidden_size_per_layer_input=16,
                vocab_size_per_layer_input=262144, final_logit_softcapping=30.0, max_position_embeddings=4096)


def _models(name: str, spec: tuple[str, str, dict], bf16_values: bool = False):
    import transformers

    from qkv.models import from_hf

    cfg_cls, model_cls, kwargs = spec
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs)).eval()
    hf.generation_config.eos_token_id = None  # always T new tokens
    hf.generation_config.pad_token_id = 0
    if bf16_values:  # a bf16 checkpoint loaded with dtype=float32: every weight a bfloat16 value, held as float32
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    qkv_model = from_hf(hf)
    plain = from_hf(hf, optimize=False)
    input_major = optimize(from_hf(hf, optimize=False), input_major=True)
    # the lossless narrowing's row: the same float32 numbers, the layers' weights held in bf16
    narrow = optimize(from_hf(hf), weights="bf16-exact") if bf16_values else None
    weight_bytes = sum(p.numel() * p.element_size() for p in qkv_model.parameters())
    if qkv_model.lm_head is not None:  # a step reads one row of an untied embedding table
        emb = qkv_model.embed_tokens.weight
        weight_bytes -= emb.numel() * emb.element_size()
    if qkv_model.config.moe is not None:  # a token reads only its top-k routed experts
        m = qkv_model.config.moe
        unread = sum(p.numel() * p.element_size() for n, p in qkv_model.named_parameters() if ".experts." in n)
        weight_bytes -= unread * (1 - m.num_experts_per_tok / m.n_routed_experts)
    return hf, qkv_model, plain, input_major, narrow, weight_bytes


def _shape_models(shape: str, dtype: torch.dtype, folder: Path):
    """HF and qkv on the random checkpoint of ``shape`` in ``dtype`` (``benchmarks/_checkpoints.py``), no ablation
    copies; the weight bytes a decode step reads."""
    import transformers

    from _checkpoints import build_checkpoint
    from qkv.models import from_hf

    ckpt = folder / f"{shape}-{str(dtype).removeprefix('torch.')}"
    build_checkpoint(ckpt, shape, dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    qkv_model = from_hf(str(ckpt))  # dtype="auto": the checkpoint's
    weight_bytes = sum(p.numel() * p.element_size() for p in qkv_model.parameters())
    if qkv_model.lm_head is not None:  # a step reads one row of an untied embedding table
        emb = qkv_model.embed_tokens.weight
        weight_bytes -= emb.numel() * emb.element_size()
    return hf, qkv_model, None, None, None, weight_bytes


class _Clock:
    """Timestamps of a generate call: its start, then one per new token."""

    def __init__(self) -> None:
        self.times = [time.perf_counter()]

    def __call__(self, tokens) -> None:  # qkv.models.generate streamer
        self.times.append(time.perf_counter())

    def put(self, value) -> None:  # HF streamer: first called with the prompt, then with each new token
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass

    _seen_prompt = False


def _timed(run, n_new: int) -> float:
    """Wall seconds of ``run(clock, n_new)``: a ``qkv_gen`` closure generating ``n_new`` tokens."""
    clock = _Clock()
    run(clock, n_new)
    return clock.times[-1] - clock.times[0]


def _run_case(suite: Suite, name: str, spec, batches, n_prompt: int, n_new: int, repeat: int,
              thread_counts: list[int], models=None, bf16_values: bool = False) -> None:
    from qkv.cache import KVCache, Static
    from qkv.models.generate import generate

    hf, qkv_model, plain, input_major, narrow, weight_bytes = models or _models(name, spec, bf16_values)
    vocab = spec[2]["vocab_size"]
    dtype = next(qkv_model.parameters()).dtype
    for threads, B in ((t, b) for t in thread_counts for b in batches):
        torch.set_num_threads(threads)
        ids = torch.randint(1, vocab, (B, n_prompt), generator=torch.Generator().manual_seed(B))
        mask = torch.ones_like(ids)

        def hf_gen(clock):
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False, streamer=clock)
            return out[:, n_prompt:]

        def qkv_gen(model, optimized: bool = True):
            def run(clock, new: int = n_new):
                cache = KVCache(model.cache_specs(), storage=Static(n_prompt + n_new))
                return generate(model, ids, max_new_tokens=new, cache=cache, streamer=clock,
                                optimize=optimized).new_tokens
            return run

        def screen_off(clock, new: int = n_new):  # the control: the same model, its head screen off for the call
            with head_screen_off(qkv_model):
                return qkv_gen(qkv_model)(clock, new)

        contenders = {"hf": hf_gen, "qkv": qkv_gen(qkv_model), "qkv_noscreen": screen_off}
        if plain is not None:
            contenders.update(qkv_plain=qkv_gen(plain, optimized=False), qkv_input_major=qkv_gen(input_major))
        if narrow is not None:
            contenders.update(qkv_bf16exact=qkv_gen(narrow))
        steps: dict[str, list[float]] = {k: [] for k in contenders}
        step_med: dict[str, list[float]] = {k: [] for k in contenders}  # per repeat, paired across contenders
        step_p10: dict[str, list[float]] = {k: [] for k in contenders}
        prefill: dict[str, list[float]] = {k: [] for k in contenders}
        total: dict[str, list[float]] = {k: [] for k in contenders}
        with torch.inference_mode():
            tokens = {k: f(_Clock()) for k, f in contenders.items()}  # warm-up, and the tokens to compare
            for _ in range(repeat):
                for k, f in contenders.items():
                    clock = _Clock()
                    f(clock)
                    t = clock.times
                    assert len(t) == n_new + 1, f"{k}: expected {n_new} streamed steps, got {len(t) - 1}"
                    prefill[k].append(t[1] - t[0])
                    total[k].append(t[-1] - t[0])
                    these = [b - a for a, b in zip(t[1:], t[2:])]
                    steps[k].extend(these)
                    step_med[k].append(statistics.median(these))
                    step_p10[k].append(statistics.quantiles(these, n=10)[0])
            where = step_breakdown(lambda n: _timed(qkv_gen(qkv_model), n), n_new)  # qkv's step, by category
        decode = {k: B / statistics.median(v) for k, v in steps.items()}
        e2e = {k: B * n_new / statistics.median(total[k]) for k in contenders}
        weight_rate = weight_bytes / statistics.median(steps["qkv"])
        floor_s = weight_bytes / read_rate(threads)  # every weight streamed once per step from memory
        r = ratio(step_med["hf"], step_med["qkv"])  # qkv decode tok/s over HF's, per repeat
        control = {"qkv_noscreen_decode_tok_s": decode["qkv_noscreen"],  # the head screen's control row
                   "noscreen_ratio": ratio(step_med["hf"], step_med["qkv_noscreen"]),
                   "noscreen_same": bool(torch.equal(tokens["qkv"], tokens["qkv_noscreen"]))}
        if plain is not None:
            extra = {"qkv_plain_decode_tok_s": decode["qkv_plain"],  # what qkv.cpu.optimize buys, per repeat
                     "optimize_ratio": ratio(step_med["qkv_plain"], step_med["qkv"]),
                     "qkv_input_major_decode_tok_s": decode["qkv_input_major"], **control}
            same = bool(torch.equal(tokens["hf"], tokens["qkv"]) and torch.equal(tokens["hf"], tokens["qkv_plain"]))
        else:
            extra = {**control, "agree": token_agreement(tokens["qkv"], tokens["hf"]),
                     "distinct": len(set(tokens["qkv"].flatten().tolist()))}
            same = bool(torch.equal(tokens["hf"], tokens["qkv"]))
        if narrow is not None:  # the bf16-valued weights held in bf16 (lossless): its own ratio to HF and floor
            nr = ratio(step_med["hf"], step_med["qkv_bf16exact"])
            narrow_bytes = weight_bytes - sum(m.weight_bf16.numel() * 2 for m in narrow.modules()
                                              if hasattr(m, "weight_bf16"))
            extra.update({"qkv_bf16exact_decode_tok_s": decode["qkv_bf16exact"], "bf16exact_ratio": nr,
                          "bf16exact_same": bool(torch.equal(tokens["hf"], tokens["qkv_bf16exact"])),
                          "bf16exact_weights_MB": narrow_bytes / 1e6,
                          "bf16exact_step/floor": statistics.median(steps["qkv_bf16exact"]) / floor_s,
                          "bf16exact_target": (f"{target(nr, '>=', TARGETS.get(name, TARGET))} "
                                               f"({TARGETS.get(name, TARGET)}x)"
                                               if B in TARGET_BATCHES.get(name, (B,)) else "none at this batch")})
        case = {"model": name, "threads": threads, "B": B, "prompt": n_prompt, "new": n_new}
        if plain is None:
            case = {"model": name, "dtype": str(dtype).removeprefix("torch."), **case}
        suite.add(case, {
            "hf_decode_tok_s": decode["hf"], "qkv_decode_tok_s": decode["qkv"], **extra, "decode_ratio": r,
            "decode_ratio_p10": ratio(step_p10["hf"], step_p10["qkv"]),
            "hf_e2e_tok_s": e2e["hf"], "qkv_e2e_tok_s": e2e["qkv"], "e2e_ratio": ratio(total["hf"], total["qkv"]),
            "hf_prefill_ms": statistics.median(prefill["hf"]) * 1e3,
            "qkv_prefill_ms": statistics.median(prefill["qkv"]) * 1e3,
            "weights_MB": weight_bytes / 1e6, "qkv_GB_per_s": weight_rate / 1e9,
            "floor_ms": floor_s * 1e3, "qkv_step/floor": statistics.median(steps["qkv"]) / floor_s,
            "hf_step/floor": statistics.median(steps["hf"]) / floor_s,
            **where,
            "target": ("none here (the real shapes' targets are vs_vllm.py's)" if plain is None
                       else f"{target(r, '>=', TARGETS.get(name, TARGET))} ({TARGETS.get(name, TARGET)}x)"
                       if B in TARGET_BATCHES.get(name, (B,)) else "none at this batch"),
            "same_tokens": same,
        })


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny models, short prompts (a smoke run)")
    p.add_argument("--repeat", type=int, default=None, help="timed repeats per contender (median reported)")
    p.add_argument("--threads", default=None,
                   help="comma-separated torch CPU thread counts to run (default: torch's, then 1)")
    p.add_argument("--models", default=None, help="comma-separated model names to run (default: all)")
    p.add_argument("--shapes", default=None, help="run the real-shape suite (generate_shapes) instead: "
                   "comma-separated shapes of benchmarks/_checkpoints.py, e.g. qwen2.5-0.5b,llama-3.2-1b,qwen2.5-3b")
    p.add_argument("--tag", default=None, help="the suite writes generate_<tag>.json (with --shapes: "
                   "generate_shapes_<tag>.json), one part of the matrix, leaving the untagged table's rows alone")
    p.add_argument("--dtypes", default="bfloat16,float32", help="with --shapes: comma-separated dtypes")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,4,8; with --shapes "
                                                    "1,8,32)")
    p.add_argument("--bf16-values", action="store_true",
                   help="round every random weight to a bfloat16 value (kept float32, as a bf16 checkpoint loaded "
                        "with dtype=float32) and add the qkv_bf16exact row (optimize(weights='bf16-exact'))")
    args = p.parse_args(argv)
    if args.shapes:
        _run_shapes(args)
        return
    default = torch.get_num_threads()
    thread_counts = ([int(t) for t in args.threads.split(",")] if args.threads
                     else list(dict.fromkeys([default, 1])))
    n_prompt, n_new = (16, 16) if args.quick else (64, 64)
    repeat = args.repeat or (2 if args.quick else 5)  # 5 interleaved repeats: the published configuration
    import transformers

    from _checkpoints import suite_name

    name = suite_name("generate", args.tag)  # a tagged part keeps generate.json's other rows
    suite = Suite(name, "greedy decode tokens/s, qkv vs HF transformers generate (same weights)",
                  transformers=transformers.__version__, dtype="float32", cache="qkv Static / HF DynamicCache",
                  hf_attention="sdpa (HF default)", repeat=repeat, threads=thread_counts,
                  weights=("random float32 rounded to bfloat16 values (a bf16 checkpoint loaded as float32)"
                           if args.bf16_values else "random float32"))
    configs = _configs(args.quick)
    chosen = args.models.split(",") if args.models else list(configs)
    unknown = sorted(set(chosen) - set(configs))
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {sorted(configs)}")
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [1, 4, 8]
    if min(batches) < 1:
        p.error(f"--batches takes positive integers, got {args.batches!r}")
    for name in chosen:
        spec = configs[name]
        _run_case(suite, name, spec, batches, n_prompt, n_new, repeat, thread_counts, bf16_values=args.bf16_values)
    suite.note(f"Target: qkv decode tokens/s >= {TARGET}x HF's ({', '.join(f'{k} {v}x' for k, v in TARGETS.items())}, "
               "at batch 1 and 4, as their issues set it; smollm3-like and gemma4-like at batch 1 and 8) "
               "in every repeat (ratios: the median over the "
               "paired repeats, then the lowest and highest). step_*_ms: where qkv's decode step goes (products, "
               "attention, other torch ops, Python; one profiled run of each length, indicative). "
               "decode: B / median time between streamed tokens; "
               "e2e includes prefill. optimize_ratio: qkv_plain's step time over qkv's (what qkv.cpu.optimize "
               "buys). qkv_input_major: qkv with wide weights stored input-major (optimize(input_major=True)). "
               "floor_ms: the weights a step reads (weights_MB, the float32 head included; an untied embedding "
               "table counts one row) over the best of 7 reads (a sum) of a 256 MB matrix at the row's thread count; "
               "step/floor near 1 means a step is bound by memory bandwidth, and a ratio to HF above hf_step/floor "
               "needs fewer bytes than the float32 weights: qkv's greedy head reads its int8 screen (a quarter of "
               "the head's bytes; qkv.cpu.greedy). qkv_noscreen / noscreen_ratio: the control row, the same model "
               "with the screen set aside for the call (the float32 head)."
               + (" qkv_bf16exact / bf16exact_ratio: the same weights (every one a bfloat16 value, held as float32 "
                  "by HF and qkv alike) with qkv.cpu.optimize(weights='bf16-exact'): the layers' weights held in "
                  "bfloat16, the same numbers at half the bytes, products in float32 (lossless; the LM head keeps "
                  "its int8 screen); bf16exact_weights_MB: what its step reads." if args.bf16_values else ""))
    suite.finish()


def _run_shapes(args) -> None:
    """The ``generate_shapes`` suite: HF vs qkv at the real shapes (module notes)."""
    import tempfile

    import transformers

    from _checkpoints import SHAPES, shape_names, suite_name

    shapes = shape_names(args.shapes)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or set(dtypes) - {"bfloat16", "float32"}:
        raise SystemExit(f"--dtypes takes comma-separated bfloat16 and/or float32, got {args.dtypes!r}")
    batches = [int(b) for b in (args.batches or "1,8,32").split(",")]
    thread_counts = [int(t) for t in (args.threads or "1,2").split(",")]
    repeat = args.repeat or 3
    if repeat < 1 or min(batches) < 1 or min(thread_counts) < 1:
        raise SystemExit(f"--repeat, --batches and --threads take positive integers, got {repeat}, {batches}, "
                         f"{thread_counts}")
    suite = Suite(suite_name("generate_shapes", args.tag),
                  "greedy decode tokens/s at real shapes, qkv vs HF transformers generate (same "
                  "random checkpoint)", transformers=transformers.__version__, cache="qkv Static / HF DynamicCache",
                  hf_attention="sdpa (HF default)", repeat=repeat, threads=thread_counts,
                  weights=("random float32 rounded to bfloat16 values (a bf16 checkpoint loaded as float32)"
                           if args.bf16_values else "random float32"))
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            for dtype_name in dtypes:
                models = _shape_models(shape, getattr(torch, dtype_name), Path(tmp))
                _run_case(suite, shape, SHAPES[shape], batches, 128, 32, repeat, thread_counts, models=models)
                del models
    suite.note("decode_ratio: qkv decode tokens/s over HF's (median [slowest, fastest] repeat); noscreen_ratio: the "
               "control, qkv with its int8 head screen off. agree: mean fraction of a row's greedy tokens before qkv "
               "and HF first differ; distinct: distinct greedy tokens qkv emitted. floor_ms: the weights a step "
               "reads over the measured read rate.")
    suite.finish()


if __name__ == "__main__":
    main()
