"""The prefix cache that keeps nothing: every request computes its whole prompt.

Nothing is matched or kept, so a finished request's pages go straight back to the allocator.
It exists so that the scheduler always talks to a prefix cache, and the radix cache slots in
without a change to the scheduler. Chapter 9 tells the story.
"""

from __future__ import annotations

from collections.abc import Sequence

from minisgl.kvcache.base import BasePrefixCache, CacheHandle, InsertResult, PrefixMatch

# The only prefix this cache ever holds: the empty one.
EMPTY_HANDLE = CacheHandle(num_tokens=0)


class NaivePrefixCache(BasePrefixCache):
    """A prefix cache that matches nothing and keeps nothing."""

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Always the empty prefix: the request computes every token of its prompt."""
        return PrefixMatch(handle=EMPTY_HANDLE, pages=[])

    def lock(self, handle: CacheHandle) -> None:
        self._check_handle(handle)  # nothing to protect: the empty prefix owns no pages

    def unlock(self, handle: CacheHandle) -> None:
        self._check_handle(handle)

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Keep none of the pages: the caller frees all of them."""
        self._check_whole_pages(len(token_ids), len(pages))
        return InsertResult(num_already_cached=0, handle=EMPTY_HANDLE)

    def evict(self, num_pages: int) -> list[int]:
        """Nothing to give back: this cache never holds a page."""
        return []

    @property
    def num_evictable_pages(self) -> int:
        return 0

    @property
    def num_locked_pages(self) -> int:
        return 0

    def _check_handle(self, handle: CacheHandle) -> None:
        # A handle from another cache would mean pages this one knows nothing about.
        if handle.num_tokens != 0:
            raise ValueError(f"the naive prefix cache only hands out empty handles, got {handle}")
