"""Building a FlexAttention BlockMask from qkv's analytic block map vs ``create_block_mask``, packed documents.

The mask is causal attention within packed documents (``masks.document(ids) & masks.causal()``), the
predicate attention-gym's document-masking users write; ``create_block_mask`` evaluates it on every
(query, key) pair, ``mask.to_flex_block_mask`` reads the O(tiles) block map. Both run on the CPU. The
two BlockMasks are compared (``to_dense`` and block counts) wherever both were built. ``create_block_mask``
is skipped above 64K tokens (it evaluates N^2 pairs).

    python benchmarks/mask_export.py [--quick] [--repeat R] [--threads N]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import Suite, parse_args, time_fn  # noqa: E402
from qkv import masks  # noqa: E402


def documents(n: int, seed: int = 0) -> torch.Tensor:
    """Document ids (1, n) of random lengths 256..4096 packed back to back."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(torch.randint(256, 4097, (1,), generator=g)))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:n]
    return ids.view(1, n)


def main(argv=None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    max_dense = 65536
    from torch.nn.attention.flex_attention import create_block_mask

    sizes = [2048, 4096] if args.quick else [32768, 65536, 131072]
    repeat = args.repeat or (2 if args.quick else 5)
    suite = Suite("mask_export", "FlexAttention BlockMask from the block map vs create_block_mask, packed "
                                 "causal documents, CPU", dtype="bool")
    for n in sizes:
        ids = documents(n)
        mask = masks.document(ids) & masks.causal()
        doc = ids[0]

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        ours = time_fn(lambda: mask.to_flex_block_mask(1, 1, n, n), warmup=1, repeat=repeat)
        row = {"to_flex_block_mask ms": ours * 1e3}
        if n <= max_dense:
            try:
                theirs = time_fn(lambda: create_block_mask(mask_mod, 1, 1, n, n, device="cpu"), warmup=1,
                                 repeat=max(1, repeat // 2))
                a, b = mask.to_flex_block_mask(1, 1, n, n), create_block_mask(mask_mod, 1, 1, n, n, device="cpu")
                row.update({"create_block_mask ms": theirs * 1e3, "speed-up": theirs / ours,
                            "equal": bool(torch.equal(a.to_dense(), b.to_dense())
                                          and torch.equal(a.full_kv_num_blocks, b.full_kv_num_blocks))})
            except (RuntimeError, MemoryError) as e:  # it sums an (N, N) int64 tensor: 8 N^2 bytes
                if "allocate" not in str(e) and not isinstance(e, MemoryError):
                    raise
                row.update({"create_block_mask ms": f"out of memory ({8 * n * n / 2**30:.0f} GiB N^2 sum)",
                            "speed-up": "", "equal": ""})
        else:
            row.update({"create_block_mask ms": f"skipped (N > {max_dense})", "speed-up": "", "equal": ""})
        suite.add({"N": n, "documents": int(doc.max()) + 1}, row)
    suite.note(f"Median of {repeat} repeats (create_block_mask: {max(1, repeat // 2)}); equal: to_dense() and "
               f"full-block counts of the two BlockMasks agree.")
    suite.finish()


if __name__ == "__main__":
    main()
