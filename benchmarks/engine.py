"""A request stream through ``qkv.models.Engine`` (continuous batching over the paged cache): one forward pass
per phase (the default) against mixed steps and against static batches, in one run.

Model: the Llama of ``benchmarks/vs_vllm.py`` built directly as a ``qkv.nn.DecoderLM`` (vocabulary 32000, width
512, 4 layers, 8 query heads and 2 KV heads, intermediate 1376, float32, unit-scale random weights; ``--quick``:
a tiny one). Requests: prompt lengths 16-512 and budgets 8-128, seeded (``--quick``: 8-48 and 4-16), all
submitted at once. Contenders, each over the same requests, round-robin per repeat:

- ``phases``: ``Engine(max_batch=8, prefill_chunk=64)``: every step runs one pass over the rows reading their
  prompt (as wide as the longest chunk) and one pass of width 1 over the decoding rows (``cache.step_rows``);
- ``mixed``: the same engine with ``mixed_steps=True``: one pass per step over every running row, decoding rows
  padded to the chunk width (position -1), as in a padded (B, chunk) step;
- ``static``: ``qkv.models.generate`` on static batches of 8 requests sorted by prompt length, each batch
  decoding to its longest budget (what ``vs_vllm.py`` ran before the engine);
- ``sampled``: the ``phases`` engine with every request sampled
  (``SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i, logprobs=5)``): exact logits for every row
  (no screened head), the filters and one draw per token, and the top-5 logprobs of each token.

Reported: generated tokens per second (budgets summed over wall time) with its range over the repeats, each
rate over ``phases``' in the same repeat, time to first token (median over requests, from submission), and
``same_tokens``: whether every greedy contender's tokens equal ``phases``', and for ``sampled`` whether its seeded
tokens are the same in every repeat.

Published configuration (the defaults): 1 thread, 3 paired repeats, wall clock, 32 requests.

Usage: ``python benchmarks/engine.py [--quick] [--repeat R] [--threads T] [--requests N]``
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Suite, spread  # noqa: E402
from qkv.models import Engine, SamplingParams, generate  # noqa: E402
from qkv.nn import DecoderConfig, DecoderLM  # noqa: E402


def build_model(quick: bool) -> DecoderLM:
    fields = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2)
    if quick:
        fields.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**fields, max_position_embeddings=1024)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 if "embed" in name else 1.0 / math.sqrt(p.shape[-1]))
    return model


def stream_requests(n: int, vocab: int, quick: bool) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    lo, hi, blo, bhi = (8, 48, 4, 16) if quick else (16, 512, 8, 128)
    return [([rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(blo, bhi))
            for _ in range(n)]


def sampled(i: int, n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, top_k=50, top_p=0.95, seed=i, logprobs=5)


def run_engine(model, requests, *, mixed: bool, sample: bool = False) -> tuple[float, list[list[int]], list[float]]:
    """Seconds, tokens per request, and each request's time to first token."""
    engine = Engine(model, num_blocks=1024, block_size=16, max_batch=8, prefill_chunk=64, mixed_steps=mixed)
    tokens: list[list[int]] = [[] for _ in requests]
    first = [0.0] * len(requests)
    t0 = time.perf_counter()
    ids = {(engine.add(p, params=sampled(i, n)) if sample else engine.add(p, n)): i
           for i, (p, n) in enumerate(requests)}
    for u in engine.stream():
        i = ids[u.request_id]
        if not tokens[i]:
            first[i] = time.perf_counter() - t0
        tokens[i] += u.tokens
    return time.perf_counter() - t0, tokens, first


def run_static(model, requests, group: int = 8) -> tuple[float, list[list[int]], list[float]]:
    order = sorted(range(len(requests)), key=lambda i: len(requests[i][0]))
    tokens: list[list[int]] = [[] for _ in requests]
    first = [0.0] * len(requests)
    t0 = time.perf_counter()
    for s in range(0, len(order), group):
        rows = order[s:s + group]
        width = max(len(requests[i][0]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            p = requests[i][0]
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        started = []

        def streamer(_tok, started=started):
            if not started:
                started.append(time.perf_counter() - t0)

        out = generate(model, ids, attention_mask=mask, max_new_tokens=max(requests[i][1] for i in rows),
                       streamer=streamer)
        for r, i in enumerate(rows):
            tokens[i] = out.new_tokens[r, :requests[i][1]].tolist()
            first[i] = started[0]
    return time.perf_counter() - t0, tokens, first


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, short prompts (a smoke run)")
    p.add_argument("--repeat", type=int, default=None, help="paired repeats (default 3; 2 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--requests", type=int, default=None, help="requests in the stream (default 32; 8 with --quick)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    quick, repeat = args.quick, args.repeat or (2 if args.quick else 3)
    model = build_model(quick)
    requests = stream_requests(args.requests or (8 if quick else 32), model.config.vocab_size, quick)
    n_tokens = sum(n for _, n in requests)
    contenders = {"phases": lambda: run_engine(model, requests, mixed=False),
                  "mixed": lambda: run_engine(model, requests, mixed=True),
                  "static": lambda: run_static(model, requests),
                  "sampled": lambda: run_engine(model, requests, mixed=False, sample=True)}
    seconds: dict[str, list[float]] = {k: [] for k in contenders}
    ttft: dict[str, list[float]] = {k: [] for k in contenders}
    tokens: dict[str, list[list[int]]] = {}
    repeatable = True  # the sampled contender's seeded tokens, the same in every repeat
    with torch.inference_mode():
        run_engine(model, requests[:2], mixed=False)  # warm-up (and qkv.cpu.optimize on first use)
        run_static(model, requests[:2])
        for _ in range(repeat):
            for name, fn in contenders.items():
                t, toks, first = fn()
                seconds[name].append(t)
                ttft[name].append(statistics.median(first))
                repeatable &= name != "sampled" or tokens.get(name, toks) == toks
                tokens[name] = toks
    suite = Suite("engine", "request stream: Engine with one pass per phase vs mixed steps vs static batches, and "
                  "sampled with logprobs",
                  quick=quick, threads=args.threads, requests=len(requests), repeat=repeat)
    for name in contenders:
        suite.add({"contender": name, "requests": len(requests), "threads": args.threads}, {
            "tok_s": statistics.median(n_tokens / t for t in seconds[name]),
            "rate/phases": spread([p / t for p, t in zip(seconds["phases"], seconds[name], strict=True)]),
            "ttft_ms": statistics.median(ttft[name]) * 1e3,
            "same_tokens": repeatable if name == "sampled" else tokens[name] == tokens["phases"],
        })
    suite.finish()


if __name__ == "__main__":
    main()
