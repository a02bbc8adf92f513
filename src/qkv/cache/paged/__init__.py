"""Block-paged KV storage, one concept per file: configuration (:mod:`.config`: :class:`Paged`, :class:`CacheFull`,
:class:`PoolStats`), prefix keys (:mod:`.prefix`), the block manager (:mod:`.blocks`: allocation, reference counts,
copy-on-write, the prefix index, admission) and a layer's store (:mod:`.store`: the pools)."""

from .blocks import BlockManager
from .config import CacheFull, Paged, PoolStats
from .prefix import prefix_hashes
from .store import PagedStore

__all__ = ["Paged", "PagedStore", "BlockManager", "CacheFull", "PoolStats", "prefix_hashes"]
