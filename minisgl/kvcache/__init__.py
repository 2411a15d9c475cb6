"""The paged KV cache: the pool that stores keys and values, and the allocator of its pages.

- ``base``: the interfaces: :class:`BaseKVPool` (storage addressed by token slot) and
  :class:`BasePrefixCache` (the seam for the caches of chapters 9 and 11).
- ``mha_pool``: :class:`MHAKVPool`, one K and one V tensor per layer.
- ``allocator``: :class:`PageAllocator`, the free list of page ids.

Which request owns which pages is recorded by the page table, ``minisgl.scheduler.table``.
"""

from __future__ import annotations

from minisgl.kvcache.allocator import OutOfPagesError, PageAllocator
from minisgl.kvcache.base import (
    BaseKVPool,
    BasePrefixCache,
    CacheHandle,
    InsertResult,
    PrefixMatch,
)
from minisgl.kvcache.mha_pool import MHAKVPool

__all__ = [
    "BaseKVPool",
    "BasePrefixCache",
    "CacheHandle",
    "InsertResult",
    "MHAKVPool",
    "OutOfPagesError",
    "PageAllocator",
    "PrefixMatch",
]
