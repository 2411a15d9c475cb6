"""The cache manager: every KV page a request holds, from admission to release.

Two things decide where a request's keys and values live: the engine's
:class:`~minisgl.kvcache.request_pages.RequestPages` (which pages are free, which pages a
request's row maps, in token order), the only code that moves a page, and a prefix cache (which
pages outlive their request, to be shared by the next request with the same prefix). The
:class:`CacheManager` is the prefix-cache *policy* between them: what a new request may reuse,
what to keep when it finishes, what to evict to make room. It asks ``engine.pages`` for every
page it hands out or takes back, so that the scheduler only ever says *what* happens to a
request (it is admitted, it needs pages for its next step, it is done) and never *how* pages
move.

Chapter 9 runs it with :class:`~minisgl.kvcache.naive_cache.NaivePrefixCache`, which keeps
nothing; chapter 11 plugs in a radix tree. The bookkeeping below is already the general one: a
request may start with pages it borrowed from the cache, and when it finishes the cache may keep
some of its pages. With the naive cache both are empty, and every page goes back to the
allocator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from minisgl.core import Req
from minisgl.kvcache import BasePrefixCache, CacheHandle, OutOfPagesError, PrefixMatch
from minisgl.kvcache.naive_cache import NaivePrefixCache

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine

# The prefix caches a scheduler can run with, by the name ``SchedulerConfig.prefix_cache`` takes
# (checked there). Each entry builds an empty one from the page size. Chapter 11 adds "radix".
PREFIX_CACHES: dict[str, Callable[[int], BasePrefixCache]] = {
    "naive": NaivePrefixCache,
}


class CacheManager:
    """Hands KV pages to requests and takes them back, through a prefix cache.

    Args:
        engine: the engine whose ``pages`` own the pages and rows.
        prefix_cache: the policy that may keep pages after their request finishes.

    Attributes:
        pages: ``engine.pages``, the owner this manager asks.
        num_pages: the pages this manager hands out: every page that was free when it was made
            (on a GPU the engine keeps one page back for CUDA-graph padding).
    """

    def __init__(self, engine: Engine, prefix_cache: BasePrefixCache) -> None:
        self.pages = engine.pages
        self.page_size = engine.config.page_size
        self.prefix_cache = prefix_cache
        self.num_pages = self.pages.num_free
        # The cached prefix each admitted request started from, and locked; popped on release.
        self._handles: dict[Req, CacheHandle] = {}

    @property
    def available_pages(self) -> int:
        """Pages a new request could get: the free ones, and those the cache could evict."""
        return self.pages.num_free + self.prefix_cache.num_evictable_pages

    @property
    def pages_in_use(self) -> int:
        """Pages not free: held by requests, or kept by the prefix cache."""
        return self.num_pages - self.pages.num_free

    def match(self, req: Req) -> PrefixMatch:
        """The longest cached prefix ``req``'s prompt may reuse. Changes nothing.

        The prompt's last token is left out of the match: a prefill must compute at least one
        token, the one whose logits give the request its first output token.
        """
        return self.prefix_cache.match_prefix(req.prompt_ids[:-1])

    def admit(self, req: Req, match: PrefixMatch) -> None:
        """Give ``req`` a page-table row that starts with the pages of its cached prefix.

        The prefix is locked so that no eviction takes its pages while ``req`` reads them, and
        ``req.cached_len`` jumps past it: the prefill computes only the rest. The pages for the
        rest are allocated by :meth:`reserve`, step by step.
        """
        # First: it refuses a request that holds a row, and if no row is free nothing changes.
        self.pages.open_row(req, match.pages)
        self.prefix_cache.lock(match.handle)
        req.cached_len = match.num_tokens
        self._handles[req] = match.handle

    def reserve(self, reqs: Sequence[Req]) -> int:
        """Pages for the next forward pass of every request in ``reqs`` (a batch); returns how
        many were allocated.

        When too few pages are free, unlocked pages of the prefix cache are evicted first. The
        scheduler admits requests only while their worst case fits, so after eviction the pages
        are always there; running out here would be a bookkeeping bug, and ``engine.pages`` says
        so (``OutOfPagesError``) instead of corrupting anyone's cache.
        """
        try:
            return self.pages.reserve(*reqs)
        except OutOfPagesError as short:  # nothing was taken: evict the difference, once
            self.evict(short.requested - short.free)
            return self.pages.reserve(*reqs)

    def evict(self, num_pages: int) -> int:
        """Evict up to ``num_pages`` unlocked pages of the prefix cache; returns how many went
        back to the free pages."""
        evicted = self.prefix_cache.evict(num_pages)
        self.pages.free_pages(evicted)
        return len(evicted)

    def release(self, req: Req) -> int:
        """Take back ``req``'s row and pages (it finished or was aborted); returns pages freed.

        The request's whole pages of computed K/V are offered to the prefix cache, which keeps
        the ones it wants. In token order the row's pages are then:

        - ``[0, prefix)``: the cached prefix ``req`` started from: the cache's already; untouched;
        - ``[prefix, already)``: pages ``req`` computed that another request cached in the
          meantime: duplicates, freed;
        - ``[already, kept)``: pages the cache took over just now;
        - ``[kept, end)``: what the cache did not keep (and a last, partly filled page): freed.

        With the naive cache ``prefix``, ``already`` and ``kept`` are all 0: every page is freed.
        """
        handle = self._handles.pop(req, None)
        if handle is None or req.table_row is None:
            raise ValueError(f"request {req.uid} holds no pages to release")
        pages = self.pages.close_row(req)
        full_pages = req.cached_len // self.page_size  # a cache only keeps whole pages
        result = self.prefix_cache.insert(req.token_ids[:full_pages * self.page_size],
                                          pages[:full_pages])
        self.prefix_cache.unlock(handle)

        prefix = handle.num_tokens // self.page_size
        already = result.num_already_cached // self.page_size
        kept = result.handle.num_tokens // self.page_size
        assert prefix <= already <= kept <= full_pages, (prefix, already, kept, full_pages)
        to_free = pages[prefix:already] + pages[kept:]
        self.pages.free_pages(to_free)
        return len(to_free)

    def check_integrity(self) -> None:
        """Every page is in exactly one place: free, held by a request, or kept by the cache.

        A request's pages that came from the cache are counted once, as the cache's.

        Raises:
            RuntimeError: the counts do not add up (a page leaked or was counted twice).
        """
        held = sum(self.pages.pages_held(req) - handle.num_tokens // self.page_size
                   for req, handle in self._handles.items())
        cached = self.prefix_cache.num_evictable_pages + self.prefix_cache.num_locked_pages
        free = self.pages.num_free
        if free + held + cached != self.num_pages:
            raise RuntimeError(f"KV page accounting is off: {free} free + {held} held by "
                               f"{len(self._handles)} request(s) + {cached} in the prefix cache "
                               f"!= {self.num_pages} pages")

    @property
    def num_admitted(self) -> int:
        """Requests holding a page-table row."""
        return len(self._handles)
