"""Padding-free training: a padded batch against the same sequences packed (``qkv.varlen``), tokens per second.

A batch of sequences of mixed lengths (default 32 sequences, lengths log-uniform in 16..2048, seeded) trains
one step (forward, next-token loss, backward) of a qkv decoder two ways:

- padded: ``(B, max_len)`` with right padding; padding positions are ``-1`` (never attended), so the
  attention masks them, but every projection, MLP and score tile still runs over the padding;
- packed: the real tokens only, ``(1, total)``, positions restarting per sequence, every attention call
  restricted to its sequence by ``qkv.varlen.packed_documents`` (a document mask, whose empty tiles the
  tiled backend skips).

Both compute the same loss (the table reports the difference) over the same tokens; the rate counts real
tokens only. Floor: the packed step's FLOPs (6 x parameters x tokens for the linear layers, plus attention
over the causal pairs of each sequence) over the measured GEMM rate.

    python benchmarks/varlen.py [--quick] [--repeat R] [--threads T]
"""

from __future__ import annotations

import math

import torch

from _harness import Suite, gemm_rate, parse_args, time_interleaved
from qkv import varlen
from qkv.nn import DecoderConfig, DecoderLM

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
    with varlen.packed_documents(model, p.cu_seqlens):
        logits = model(p.values[None], positions=p.positions[None]).logits[0]
    nxt = torch.ones(p.values.shape[0], dtype=torch.bool)
    nxt[p.cu_seqlens[1:].long() - 1] = False
    loss = torch.nn.functional.cross_entropy(logits[:-1][nxt[:-1]], p.values[1:][nxt[:-1]], reduction="sum")
    loss.backward()
    return loss.detach()


def main(argv=None) -> None:
    args = parse_args(__doc__, argv)
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
    rate = gemm_rate()
    suite = Suite("varlen", "one training step, padded batch vs packed sequences (qkv.varlen), float32",
                  gemm_gflops=round(rate / 1e9, 1), sequences=n_seq, min_len=min(lengths), max_len=N,
                  real_tokens=total, padded_tokens=B * N, **MODEL, repeats=repeat)
    losses = {}

    def run(name, fn):
        def step():
            model.zero_grad(set_to_none=True)
            losses[name] = fn()
        return step

    times = time_interleaved({"padded": run("padded", lambda: padded_step(model, ids, mask)),
                              "packed": run("packed", lambda: packed_step(model, packed))},
                             warmup=1, repeat=repeat, cpu=args.cpu_time)
    params = sum(p.numel() for p in model.parameters())
    d = MODEL["hidden_size"]
    attn = sum(6.0 * 2 * n * n * d / 2 for n in lengths) * MODEL["num_hidden_layers"]  # fwd+bwd causal pairs
    floor = (6.0 * params * total + attn) / rate
    suite.add({"path": "padded"}, {"ms": times["padded"] * 1e3, "tokens_per_s": total / times["padded"],
                                   "vs_padded": 1.0, "floor_ms": floor * 1e3})
    suite.add({"path": "packed"}, {"ms": times["packed"] * 1e3, "tokens_per_s": total / times["packed"],
                                   "vs_padded": times["padded"] / times["packed"], "floor_ms": floor * 1e3,
                                   "loss_rel_diff": float((losses["packed"] - losses["padded"]).abs()
                                                          / losses["padded"].abs())})
    suite.note(f"Lengths: {sorted(lengths)}. The padded batch computes {B * N} token slots for {total} real tokens "
               f"({B * N / total:.2f}x).")
    suite.finish()


if __name__ == "__main__":
    main()
