"""The paged KV cache: the pool that stores keys and values, and the allocator of its pages.

- ``base``: the interfaces: :class:`BaseKVPool` (storage addressed by token slot) and
  :class:`BasePrefixCache` (the policy for keeping pages after their request ends).
- ``mha_pool``: :class:`MHAKVPool`, one K and one V tensor per layer.
- ``allocator``: :class:`PageAllocator`, the free list of page ids.
- ``page_table``: :class:`PageTable`, which pages hold which request's tokens. It is KV-cache
  state, read by the attention backends and the engine, so it lives here, below both.
- ``request_pages``: :class:`RequestPages`, the one owner of the allocator and the
  page table together: the only code that gives a request pages and a row, or takes them back.
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
from minisgl.kvcache.page_table import PageTable
from minisgl.kvcache.request_pages import RequestPages

__all__ = [
    "BaseKVPool",
    "BasePrefixCache",
    "CacheHandle",
    "InsertResult",
    "MHAKVPool",
    "OutOfPagesError",
    "PageAllocator",
    "PageTable",
    "PrefixMatch",
    "RequestPages",
]
