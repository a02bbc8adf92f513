"""Padding-free training: a padded batch against the same sequences packed (``qkv.varlen``), tokens per second.

A batch of sequences of mixed lengths (default 32 sequences, lengths log-uniform in 16..2048, seeded) trains
one step (forward, next-token loss, backward) of a qkv decoder two ways:

- padded: ``(B, max_len)`` with right padding; padding positions are ``-1`` (never attended), so the
  attention masks them, but every projection, MLP and score tile still runs over the padding;
- packed: the real tokens only, ``(1, total)``, positions restarting per sequence, every attention call
  restricted to its sequence by ``qkv.nn.packed_documents`` (a document mask, whose empty tiles the
  tiled backend skips).

Both compute the same loss (the table reports the difference) over the same tokens; the rate counts real
tokens only. Floor: the packed step's FLOPs (6 x parameters x tokens for the linear layers, plus attention
over the causal pairs of each sequence) over the measured GEMM rate.

Agreement: ``max_err_vs_fp64`` is each path's largest logit error on the real tokens against a float64
reference that runs a float64 copy of the model on every sequence alone (no padding, no packing), and
``max|packed-padded|`` the largest logit difference between the two float32 paths.

Timing: the two steps run round-robin, every repeat a pair; ``vs_padded`` is the padded step's time over
the packed one's, its median and range over the paired repeats.

Published configuration (the defaults): 1 thread, process CPU time (both steps run single-threaded), 5
paired repeats. Expected time on a quiet 2-core machine: about 3 minutes (a padded step is about 12 s
on 2 threads, more on 1).

    python benchmarks/varlen.py [--quick] [--repeat R] [--threads T] [--wall-time]
"""

from __future__ import annotations

import copy
import math

import torch

from _harness import Suite, gemm_rate, median_ms, parse_args, ratio, time_interleaved
from qkv import varlen
from qkv.nn import DecoderConfig, DecoderLM, packed_documents

MODEL = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512)


def lengths_for(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g)
    return [int(round(math.exp(math.log(lo) + float(x) * (math.log(hi) - math.log(lo))))) for x in u]


def padded_step(model, ids, mask):
    pos = (mask.cumsum(1) - 1).masked_fill(~mask, -1)
    logits = model(ids, positions=pos).logits
    valid = mask[:, :-1] & mask[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1][valid], ids[:, 1:][valid], reduction="sum")
    loss.backward()
    return loss.detach()


def packed_step(model, p: varlen.Packed):
    with packed_documents(model, p.cu_seqlens):
        logits = model(p.values[None], positions=p.positions[None]).logits[0]
    nxt = torch.ones(p.values.shape[0], dtype=torch.bool)
    nxt[p.cu_seqlens[1:].long() - 1] = False
    loss = torch.nn.functional.cross_entropy(logits[:-1][nxt[:-1]], p.values[1:][nxt[:-1]], reduction="sum")
    loss.backward()
    return loss.detach()


@torch.no_grad()
def agreement(model, ids, mask, p: varlen.Packed, lengths: list[int]) -> dict[str, float]:
    """Largest logit error of the padded and the packed forward (float32) on the real tokens, against a
    float64 copy of the model run on each sequence alone."""
    ref_model = copy.deepcopy(model).double()
    pos = (mask.cumsum(1) - 1).masked_fill(~mask, -1)
    padded = model(ids, positions=pos).logits
    with packed_documents(model, p.cu_seqlens):
        packed = model(p.values[None], positions=p.positions[None]).logits[0]
    err = {"padded": 0.0, "packed": 0.0, "packed-padded": 0.0}
    starts = p.cu_seqlens.tolist()
    for b, n in enumerate(lengths):
        want = ref_model(ids[b:b + 1, :n], positions=torch.arange(n).view(1, n)).logits[0]
        got_padded, got_packed = padded[b, :n].double(), packed[starts[b]:starts[b] + n].double()
        err["padded"] = max(err["padded"], float((got_padded - want).abs().max()))
        err["packed"] = max(err["packed"], float((got_packed - want).abs().max()))
        err["packed-padded"] = max(err["packed-padded"], float((got_packed - got_padded).abs().max()))
    return err


def main(argv=None) -> None:
    args = parse_args(__doc__, argv, threads=1, cpu_time=True)  # the published configuration
    n_seq, lo, hi = (8, 16, 256) if args.quick else (32, 16, 2048)
    repeat = args.repeat or (2 if args.quick else 5)
    lengths = lengths_for(n_seq, lo, hi)
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**MODEL, backend="auto"))
    B, N = n_seq, max(lengths)
    mask = torch.arange(N).view(1, -1) < torch.tensor(lengths).view(-1, 1)
    ids = torch.randint(0, MODEL["vocab_size"], (B, N)).masked_fill(~mask, 0)
    packed = varlen.pack(ids, mask)
    total = int(mask.sum())
    rate = gemm_rate(cpu=args.cpu_time)
    suite = Suite("varlen", "one training step, padded batch vs packed sequences (qkv.varlen), float32",
                  gemm_gflops=round(rate / 1e9, 1), sequences=n_seq, min_len=min(lengths), max_len=N,
                  real_tokens=total, padded_tokens=B * N, **MODEL, repeats=repeat,
                  clock="process CPU time" if args.cpu_time else "wall")
    err = agreement(model, ids, mask, packed, lengths)  # a fast wrong answer is no answer
    losses = {}

    def run(name, fn):
        def step():
            model.zero_grad(set_to_none=True)
            losses[name] = fn()
        return step

    t = time_interleaved({"padded": run("padded", lambda: padded_step(model, ids, mask)),
                          "packed": run("packed", lambda: packed_step(model, packed))},
                         warmup=1, repeat=repeat, cpu=args.cpu_time, samples=True)
    params = sum(p.numel() for p in model.parameters())
    d = MODEL["hidden_size"]
    attn = sum(6.0 * 2 * n * n * d / 2 for n in lengths) * MODEL["num_hidden_layers"]  # fwd+bwd causal pairs
    floor = (6.0 * params * total + attn) / rate
    ms = {name: median_ms(s) for name, s in t.items()}
    suite.add({"path": "padded"}, {"ms": ms["padded"], "tokens_per_s": total / ms["padded"] * 1e3,
                                   "vs_padded": ratio(t["padded"], t["padded"]), "floor_ms": floor * 1e3,
                                   "max_err_vs_fp64": err["padded"]})
    suite.add({"path": "packed"}, {"ms": ms["packed"], "tokens_per_s": total / ms["packed"] * 1e3,
                                   "vs_padded": ratio(t["padded"], t["packed"]), "floor_ms": floor * 1e3,
                                   "max_err_vs_fp64": err["packed"], "max|packed-padded|": err["packed-padded"],
                                   "loss_rel_diff": float((losses["packed"] - losses["padded"]).abs()
                                                          / losses["padded"].abs())})
    suite.note("vs_padded: the padded step's time over this path's, the median of the paired repeats, then the "
               "lowest and highest. max_err_vs_fp64: the largest logit error on real tokens against a float64 "
               "copy of the model run on each sequence alone.")
    suite.note(f"Lengths: {sorted(lengths)}. The padded batch computes {B * N} token slots for {total} real tokens "
               f"({B * N / total:.2f}x).")
    suite.finish()


if __name__ == "__main__":
    main()
