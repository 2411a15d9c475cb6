"""The paged KV cache: the pool that stores keys and values, and the allocator of its pages.

- ``base``: the interface :class:`BasePrefixCache`.
- ``mha_pool``: :class:`MHAKVPool`; ``allocator``: :class:`PageAllocator`.
- ``page_table``: :class:`PageTable`, KV-cache state read by the attention backends and the
  engine, so it lives here, below both.
- ``request_pages``: :class:`RequestPages`, the only code that moves pages and rows.

Chapter 5 tells the story; chapter 7 adds ``request_pages``.
"""

from __future__ import annotations

from minisgl.kvcache.allocator import OutOfPagesError, PageAllocator
from minisgl.kvcache.base import BasePrefixCache, CacheHandle, InsertResult, PrefixMatch
from minisgl.kvcache.mha_pool import MHAKVPool
from minisgl.kvcache.page_table import PageTable
from minisgl.kvcache.request_pages import RequestPages

__all__ = ["BasePrefixCache", "CacheHandle", "InsertResult", "MHAKVPool", "OutOfPagesError",
           "PageAllocator", "PageTable", "PrefixMatch", "RequestPages"]
