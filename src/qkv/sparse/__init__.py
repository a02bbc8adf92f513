"""Sparse attention by selection: a cheap scorer picks, per query, the keys worth reading.

- :mod:`qkv.sparse.select`: the selection space (scorer, granularity, sharing, forced entries, budget) whose
  points are DSA, QSA, MSA and MoBA; its output is a :func:`qkv.masks.topk` index list.
- :func:`moba`: MoBA (Lu et al. 2025, arXiv:2502.13189), the top key blocks by affinity with each block's
  mean key; :func:`moba_reference` is its dense float64 definition.

The picked keys become a :func:`qkv.masks.topk` mask, so :func:`qkv.attention` reads only those keys (the
gather backend). DeepSeek Sparse Attention's lightning indexer is a module: :class:`qkv.nn.LightningIndexer`.

Compression (DeepSeek-V4's CSA and HCA):

- :func:`compress_kv`: learned softmax-gated pooling of every ``rate`` tokens into one entry (overlapping
  windows for CSA), incremental through a :class:`CompressCarry`.
- :func:`compressed_attention`: one softmax over a sliding window of keys and the visible (selected) compressed
  entries, with sinks, O(Nq·(window + K)) forward and backward; :func:`compressed_attention_reference` is its
  dense float64 definition.

Example:
    >>> import torch
    >>> from qkv.sparse import moba
    >>> q, k, v = torch.randn(3, 1, 2, 32, 8).unbind(0)
    >>> moba(q, k, v, block_size=8, topk=2).shape
    torch.Size([1, 2, 32, 8])
"""

from qkv.sparse import select
from qkv.sparse.compress import CompressCarry, CompressOut, compress_kv
from qkv.sparse.compressed import compressed_attention, compressed_attention_reference
from qkv.sparse.moba import moba, moba_blocks, moba_reference

__all__ = ["moba", "moba_blocks", "moba_reference", "select", "compress_kv", "CompressOut", "CompressCarry",
           "compressed_attention", "compressed_attention_reference"]
