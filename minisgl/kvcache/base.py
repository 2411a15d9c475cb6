"""The two interfaces of the KV cache: where the vectors live, and who may reuse them.

``BaseKVPool`` stores every layer's keys and values, one row per *token slot*; page ``p`` owns
slots ``p * page_size .. p * page_size + page_size - 1``. The pool does not know which request a
slot belongs to: the allocator and the page table do. ``BasePrefixCache`` is the policy that
keeps finished requests' pages for reuse; the scheduler talks only to this interface, so a new
policy is a new class. Chapter 5 tells the story.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class BaseKVPool(ABC):
    """Storage for the keys and values of every layer, addressed by token slot.

    A slot is one token's K (or V) vectors for all KV heads of one layer: ``[num_kv_heads,
    head_dim]`` numbers. ``kv_cache(layer)`` holds the two ``[num_slots, num_kv_heads, head_dim]``
    tensors of that layer, and slot ``s`` is their row ``s``. Implementations differ in layout, not in
    addressing.
    """

    # What every pool tells its readers, set by the implementation's constructor.
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    device: torch.device
    dtype: torch.dtype

    @abstractmethod
    def kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s keys and values: two ``[num_slots, num_kv_heads, head_dim]``
        views (no copy)."""

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor,
                 layer_id: int) -> None:
        """Write ``k[i]`` and ``v[i]`` (``[num_kv_heads, head_dim]``) to slot ``out_loc[i]``."""

    @property
    def num_slots(self) -> int:
        """Token slots in the pool: every page's ``page_size`` slots."""
        return self.num_pages * self.page_size

    def gather_kv(self, slots: torch.Tensor, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read back the keys and values at ``slots``: two ``[len(slots), num_kv_heads, head_dim]``.

        A copy, in the order of ``slots``: how the torch attention backend reads a request's
        scattered pages as one sequence. Fused kernels read the pages in place (:meth:`kv_pages`).
        """
        k, v = self.kv_cache(layer_id)
        return k[slots], v[slots]

    def kv_pages(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K and V seen page by page: ``[num_pages, page_size, heads, dim]``.

        The same memory as :meth:`kv_cache`, reshaped (no copy): the form
        paged attention kernels such as FlashInfer's take.
        """
        k, v = self.kv_cache(layer_id)
        shape = (self.num_pages, self.page_size, *k.shape[1:])
        return k.view(shape), v.view(shape)


@dataclass(frozen=True)
class CacheHandle:
    """A reference to a prefix held by a :class:`BasePrefixCache`.

    ``num_tokens`` is the length of the prefix (always a whole number of pages). A cache
    subclasses this to remember where the prefix sits in its own structure (a tree node, say).
    """

    num_tokens: int


@dataclass(frozen=True)
class PrefixMatch:
    """What :meth:`BasePrefixCache.match_prefix` found: a handle and the pages behind it."""

    handle: CacheHandle
    pages: list[int]  # the page ids holding the prefix, in order: num_tokens // page_size of them

    @property
    def num_tokens(self) -> int:
        return self.handle.num_tokens


@dataclass(frozen=True)
class InsertResult:
    """What :meth:`BasePrefixCache.insert` did with a request's pages."""

    num_already_cached: int  # leading tokens the cache held before: the request's pages for
                             # them are duplicates, and the caller frees them
    handle: CacheHandle      # the prefix the cache now holds for these tokens (it owns the pages)


class BasePrefixCache(ABC):
    """A policy that keeps KV pages alive after their request is done, to share them later.

    The scheduler talks to it in whole pages: ``match_prefix`` when a request arrives, ``lock``
    while it runs (a locked prefix is never evicted), ``insert`` when it finishes (the cache
    takes the pages it keeps; the caller frees the duplicates, ``num_already_cached``, and every
    page past ``handle.num_tokens``), and ``evict`` when the allocator runs short.
    """

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``token_ids`` (whole pages only).

        It does not change which pages are cached; a tree-shaped cache may still reshape itself
        (split an edge at the match) and note the use for LRU eviction.
        """

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None:
        """Protect the prefix behind ``handle`` from eviction (locks nest: count them)."""

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None:
        """Undo one :meth:`lock`."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Offer the K/V of ``token_ids`` (held in ``pages``, ``page_size`` tokens each)."""

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Give back at least ``num_pages`` unlocked pages (fewer only if fewer exist)."""

    @property
    @abstractmethod
    def num_evictable_pages(self) -> int:
        """Pages the cache holds that no running request has locked."""

    @property
    @abstractmethod
    def num_locked_pages(self) -> int:
        """Pages the cache holds that some running request has locked."""
