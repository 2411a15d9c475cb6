"""The cache manager: every KV page a request holds, from admission to release.

:class:`CacheManager` is the prefix-cache *policy* between ``engine.pages`` (the only code that
moves a page) and a prefix cache: what a new request may reuse, what to keep when it finishes,
what to evict to make room. The scheduler only says *what* happens to a request, never *how*
pages move. The bookkeeping is the general one (a request may start with borrowed pages, the
cache may keep some of its pages); with the naive cache both are empty. Chapter 9 tells the
story; chapter 11 adds the radix cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from minisgl.core import Req
from minisgl.kvcache import BasePrefixCache, CacheHandle, OutOfPagesError, PrefixMatch
from minisgl.kvcache.naive_cache import NaivePrefixCache
from minisgl.kvcache.radix_cache import RadixCache

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine

# The prefix caches a scheduler can run with, by the name ``SchedulerConfig.prefix_cache`` takes
# (checked there). Each entry builds an empty one from the page size.
PREFIX_CACHES: dict[str, Callable[[int], BasePrefixCache]] = {
    "naive": NaivePrefixCache,
    "radix": RadixCache,  # share the pages of common prefixes
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
        """The longest cached prefix ``req``'s prompt may reuse. No page changes hands here.

        The prompt's last token is left out of the match: a prefill must compute at least one
        token, the one whose logits give the request its first output token.
        """
        if req.params.prompt_logprobs is not None:  # chapter 21: it needs every position's
            return self.prefix_cache.match_prefix([])  # logits, so it computes them all
        return self.prefix_cache.match_prefix(req.prompt_ids[:-1])

    def admit(self, req: Req, match: PrefixMatch) -> None:
        """Give ``req`` a page-table row that starts with the pages of its cached prefix.

        The prefix must be locked already (:meth:`lock`), so that no eviction takes its pages
        while ``req`` reads them; ``req.cached_len`` jumps past it. The pages for the rest are
        allocated by :meth:`reserve`, step by step.
        """
        # First: it refuses a request that holds a row, and if no row is free nothing changes.
        self.pages.open_row(req, match.pages)
        req.cached_len = match.num_tokens
        self._handles[req] = match.handle

    def lock(self, match: PrefixMatch) -> int:
        """Lock ``match``'s prefix at once, before anything can evict it or insert around it.

        Returns how many pages the lock took out of :attr:`available_pages`: a matched page
        nobody had locked counted as room for anyone, and the admission budget must charge the
        request for it, or it would promise it twice. Pages already locked cost nothing.
        """
        evictable = self.prefix_cache.num_evictable_pages
        self.prefix_cache.lock(match.handle)
        return evictable - self.prefix_cache.num_evictable_pages

    def unlock(self, match: PrefixMatch) -> None:
        """Undo :meth:`lock` for a request that was not admitted after all."""
        self.prefix_cache.unlock(match.handle)

    def cache_prompt(self, req: Req) -> None:
        """Give ``req``'s computed prompt to the prefix cache now, not only when it finishes
        (chapter 21), so that a request with the same prompt shares its pages at once: the
        ``n`` choices of one prompt compute it once.

        The cache keeps the pages it lacks; for tokens another request cached meanwhile,
        ``req``'s row maps the cache's pages instead and its own copies are freed. ``req``
        then holds the longer prefix locked, as if it had matched it on arrival.
        """
        full = min(len(req.prompt_ids), req.cached_len) // self.page_size
        handle = self._handles[req]
        prefix = handle.num_tokens // self.page_size
        if full <= prefix:
            return
        tokens = req.prompt_ids[:full * self.page_size]
        row = self.pages.table.row_pages(req.table_row)[:full].tolist()
        result = self.prefix_cache.insert(tokens, row)
        if result.handle.num_tokens < len(tokens):  # a cache that keeps nothing (naive)
            return
        already = result.num_already_cached // self.page_size
        if already > prefix:  # map the cache's pages, free the duplicates
            cached = self.prefix_cache.match_prefix(tokens[:already * self.page_size]).pages
            self.pages.free_pages(self.pages.swap_pages(req, prefix, cached[prefix:already]))
        self.prefix_cache.lock(result.handle)
        self.prefix_cache.unlock(handle)
        self._handles[req] = result.handle

    def reserve(self, reqs: Sequence[Req]) -> int:
        """Pages for the next forward pass of every request in ``reqs`` (a batch); returns how
        many were allocated.

        When too few pages are free, unlocked pages of the prefix cache are evicted first.
        Admission guarantees the pages are then there; running out would be a bookkeeping bug,
        reported as ``OutOfPagesError``.
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

        Its whole pages of computed K/V are offered to the prefix cache. In token order the
        row's pages are then:

        - ``[0, prefix)``: the cached prefix ``req`` started from: the cache's already; untouched;
        - ``[prefix, already)``: pages ``req`` computed that another request cached in the
          meantime: duplicates, freed;
        - ``[already, kept)``: pages the cache took over just now;
        - ``[kept, end)``: what the cache did not keep (and a last, partly filled page): freed.

        With the naive cache ``prefix``, ``already`` and ``kept`` are all 0. The cache learns of
        a request's pages only here: a request that arrives while another with the same prefix
        still runs computes it again.
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
