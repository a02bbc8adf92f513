"""Context parallelism on ``torch.distributed``: exact attention over a sequence sharded across processes.

Schemes (``scheme=``): ``ring`` (contiguous chunks, K/V passed around), ``zigzag`` and ``stripe`` (ring with
causally balanced layouts), ``allgather`` (gather K/V once), ``ulysses`` (all-to-all to head shards) and
``usp`` (Ulysses x ring, 2-D). Masks and score modifiers hold by global position under every scheme.
Runs on any backend (gloo on CPU, NCCL on GPUs); every wait is bounded by a timeout.

Example:
    >>> # torchrun --nproc-per-node 2 script.py, inside:
    >>> # import torch.distributed as dist, qkv, qkv.distributed as cp
    >>> # dist.init_process_group("gloo")
    >>> # ql, kl, vl = (cp.shard(t, scheme="zigzag") for t in (q, k, v))
    >>> # out = cp.attention(ql, kl, vl, mask=qkv.masks.causal(), scheme="zigzag")
"""

from .api import attention, ring_attention
from .exchange import ALL_TO_ALL, DEFAULT_TIMEOUT, CollectiveTimeout, CommLog
from .groups import UspGroups, usp_groups
from .model import ContextParallel, context_parallel
from .sharding import SCHEMES, ShardLayout, layout, shard, unshard

__all__ = [
    "attention", "ring_attention", "shard", "unshard", "layout", "ShardLayout", "SCHEMES", "usp_groups", "UspGroups",
    "CommLog", "CollectiveTimeout", "DEFAULT_TIMEOUT", "ALL_TO_ALL", "context_parallel", "ContextParallel",
]
