"""The interface of the prefix cache: who may reuse a finished request's KV pages.

``BasePrefixCache`` is the policy that keeps finished requests' pages for reuse; the scheduler
talks only to this interface, so a new policy is a new class. Chapter 5 tells the story.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from minisgl.utils.checks import check_int


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

    Args:
        page_size: token slots per KV page: the unit of matching, keeping and eviction.
    """

    def __init__(self, page_size: int = 1) -> None:
        check_int("page_size", page_size, at_least=1)
        self.page_size = page_size

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

    def _check_whole_pages(self, num_tokens: int, num_pages: int) -> None:
        """What :meth:`insert` is offered must be whole pages: ``num_pages`` full ones."""
        if num_tokens != num_pages * self.page_size:
            raise ValueError(f"insert: {num_pages} page(s) of {self.page_size} tokens cannot "
                             f"hold {num_tokens} tokens (offer whole pages only)")
