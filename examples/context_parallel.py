"""Context-parallel training of a small decoder on one long synthetic sequence, checked against one process.

The sequence is split across the ranks (``zigzag`` by default: rank r holds chunks r and 2W-1-r of 2W, which
evens out causal work); every attention layer runs :func:`qkv.distributed.attention` over the shards, RoPE
rotates by global position ids, and the gradients are all-reduced. Every rank also trains an identical
single-process copy on the whole sequence, and the script prints how closely the two agree at each step.

Task: the second half of each sequence repeats the first half, so predicting it needs attention across
the whole context (tokens half a sequence back, on another rank).

Run: ``torchrun --nproc-per-node 2 examples/context_parallel.py`` (gloo on CPU, NCCL when CUDA is present);
options: ``--scheme ring|zigzag|stripe|allgather|ulysses``, ``--seq-len``, ``--steps``.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import qkv.distributed as cp
from qkv.nn import DecoderConfig, DecoderLM

__all__ = ["make_batch", "main"]


def make_batch(seq_len: int, vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (1, seq_len) whose second half copies the first, and next-token labels (-100 where unscored:
    the first half, which is random)."""
    half = torch.randint(0, vocab, (1, seq_len // 2), generator=generator)
    ids = torch.cat([half, half], dim=1)
    labels = torch.full_like(ids, -100)
    labels[:, seq_len // 2 - 1:-1] = ids[:, seq_len // 2:]
    return ids, labels


def _loss(logits: torch.Tensor, labels: torch.Tensor, n_scored: int) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / n_scored


def main(*, steps: int = 30, seq_len: int = 512, scheme: str = "zigzag", seed: int = 0, lr: float = 3e-3,
         verbose: bool = True) -> dict:
    """Train on ``torch.distributed``'s world (initialized from torchrun's environment if it is not yet)."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if dist.get_backend() == "nccl" else \
        torch.device("cpu")
    config = DecoderConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=seq_len)
    torch.manual_seed(seed)
    model = DecoderLM(config).to(device)
    single = copy.deepcopy(model)  # the single-process reference, trained in lockstep
    ctx = cp.context_parallel(model, scheme=scheme, timeout=120)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    opt_single = torch.optim.AdamW(single.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)  # the same batches on every rank
    history = dict(loss=[], loss_single=[], grad_diff=[], param_diff=[])
    for step in range(steps):
        ids, labels = (t.to(device) for t in make_batch(seq_len, config.vocab_size, g))
        n_scored = int((labels != -100).sum())

        opt.zero_grad()
        loss_local = _loss(ctx(ctx.shard(ids)).logits, ctx.shard(labels), n_scored)  # this rank's share of the loss
        loss_local.backward()
        ctx.all_reduce_gradients()
        loss = float(ctx.all_reduce(loss_local))

        opt_single.zero_grad()
        loss_single_t = _loss(single(ids).logits, labels, n_scored)
        loss_single_t.backward()
        loss_single = float(loss_single_t.detach())

        grad_diff = max(float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(), single.parameters()))
        opt.step()
        opt_single.step()
        with torch.no_grad():  # a difference of parameters is a number to print, not part of any graph
            param_diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), single.parameters()))
        for key, val in (("loss", loss), ("loss_single", loss_single), ("grad_diff", grad_diff),
                         ("param_diff", param_diff)):
            history[key].append(val)
        if verbose and rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss: {world} ranks ({scheme}) {loss:.5f}  single process {loss_single:.5f}"
                  f"  |dloss| {abs(loss - loss_single):.1e}  max|dgrad| {grad_diff:.1e}"
                  f"  max|dparam| {param_diff:.1e}")
    ctx.restore()
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="zigzag", choices=[s for s in cp.SCHEMES if s != "usp"])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    main(steps=args.steps, seq_len=args.seq_len, scheme=args.scheme)
    dist.destroy_process_group()
