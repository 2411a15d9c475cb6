"""Chapter 11: the radix cache.

The unit tests pin down each move of the tree on small hand-made cases: matching, splitting,
inserting, locking and least-recently-used eviction, with one-token and four-token pages. The
property test then drives the cache through random sequences of those moves, the way a
scheduler would (requests that match, lock, compute, insert and unlock; evictions when the
allocator runs short), and checks every answer against a plain reference model: a dict from
each cached page-aligned prefix to the page holding its last page.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from minisgl.kvcache import CacheHandle, PageAllocator
from minisgl.kvcache.radix_cache import RadixCache, RadixHandle

PAGE_SIZES = [1, 4]


def seq(start: int, n: int) -> list[int]:
    """``n`` distinct token ids from ``start``: runs that share nothing with each other."""
    return list(range(start, start + n))


# ---------------------------------------------------------------------------------------------
# Matching


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_match_on_an_empty_tree_finds_nothing(page_size: int) -> None:
    cache = RadixCache(page_size)
    match = cache.match_prefix(seq(0, 3 * page_size))
    assert (match.num_tokens, match.pages) == (0, [])
    assert match.handle.num_tokens == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_exact_match_returns_every_page_in_order(page_size: int) -> None:
    cache = RadixCache(page_size)
    tokens = seq(0, 3 * page_size)
    cache.insert(tokens, [7, 3, 5])
    match = cache.match_prefix(tokens)
    assert match.num_tokens == len(tokens)
    assert match.pages == [7, 3, 5]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_longer_query_matches_the_cached_part(page_size: int) -> None:
    cache = RadixCache(page_size)
    cache.insert(seq(0, 2 * page_size), [4, 9])
    match = cache.match_prefix(seq(0, 5 * page_size))
    assert (match.num_tokens, match.pages) == (2 * page_size, [4, 9])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_query_with_another_first_page_matches_nothing(page_size: int) -> None:
    cache = RadixCache(page_size)
    cache.insert(seq(0, 2 * page_size), [4, 9])
    assert cache.match_prefix(seq(100, 2 * page_size)).pages == []


def test_match_shares_whole_pages_only() -> None:
    cache = RadixCache(page_size=4)
    cache.insert(seq(0, 8), [1, 2])
    # 7 tokens: one whole page and three of the next; the part page is not shared.
    assert cache.match_prefix(seq(0, 7)).pages == [1]
    # A difference in the middle of the second page stops the match at the first page.
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 7]).pages == [1]
    # A difference in the very first token: nothing.
    assert cache.match_prefix([99, 1, 2, 3]).pages == []


def test_match_accepts_a_tensor_of_token_ids() -> None:
    cache = RadixCache(page_size=2)
    cache.insert(torch.arange(6), torch.tensor([0, 1, 2]))
    assert cache.match_prefix(torch.arange(6)).pages == [0, 1, 2]


# ---------------------------------------------------------------------------------------------
# Splitting


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_match_ending_inside_an_edge_splits_it_there(page_size: int) -> None:
    cache = RadixCache(page_size)
    cache.insert(seq(0, 4 * page_size), [10, 11, 12, 13])
    (edge,) = cache.root.children.values()
    match = cache.match_prefix(seq(0, 2 * page_size) + seq(500, page_size))
    assert match.pages == [10, 11]
    (upper,) = cache.root.children.values()
    (lower,) = upper.children.values()
    assert (upper.pages, lower.pages) == ([10, 11], [12, 13])
    assert lower is edge, "the old node keeps the lower half, so handles to it stay valid"
    assert match.handle == RadixHandle(num_tokens=2 * page_size, node=upper)
    assert cache.num_cached_pages == 4 and cache.num_evictable_pages == 4
    cache.check_invariants()


def test_a_split_keeps_older_handles_valid() -> None:
    cache = RadixCache(page_size=1)
    whole = cache.insert([1, 2, 3, 4], [0, 1, 2, 3]).handle
    cache.lock(whole)
    cache.match_prefix([1, 2, 9])  # splits the locked edge after two tokens
    cache.check_invariants()
    assert cache.num_locked_pages == 4, "both halves of a locked edge stay locked"
    cache.unlock(whole)
    assert (cache.num_locked_pages, cache.num_evictable_pages) == (0, 4)
    cache.check_invariants()


def test_insert_of_a_diverging_run_splits_and_branches() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    result = cache.insert([1, 2, 3, 4, 7, 8], [5, 6, 7])
    assert result.num_already_cached == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages == [0, 1, 2]
    assert cache.match_prefix([1, 2, 3, 4, 7, 8]).pages == [0, 1, 7]
    assert cache.pretty().splitlines()[1:] == [
        "└── [1 2|3 4]  pages [0, 1]  used @4",
        "    ├── [5 6]  pages [2]  used @3",
        "    └── [7 8]  pages [7]  used @4",
    ]
    cache.check_invariants()


# ---------------------------------------------------------------------------------------------
# Inserting


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_insert_reports_how_many_tokens_were_cached_before(page_size: int) -> None:
    cache = RadixCache(page_size)
    first = cache.insert(seq(0, 2 * page_size), [0, 1])
    assert first.num_already_cached == 0 and first.handle.num_tokens == 2 * page_size
    again = cache.insert(seq(0, 2 * page_size), [8, 9])
    assert again.num_already_cached == 2 * page_size, "pages 8 and 9 are duplicates"
    longer = cache.insert(seq(0, 3 * page_size), [8, 9, 2])
    assert longer.num_already_cached == 2 * page_size
    assert longer.handle.num_tokens == 3 * page_size
    assert cache.match_prefix(seq(0, 3 * page_size)).pages == [0, 1, 2], \
        "the cache keeps its own pages for the part it had, and takes page 2 for the rest"
    assert cache.num_cached_pages == 3
    cache.check_invariants()


def test_insert_of_nothing_keeps_nothing() -> None:
    cache = RadixCache(page_size=4)
    result = cache.insert([], [])
    assert (result.num_already_cached, result.handle.num_tokens) == (0, 0)
    assert cache.num_cached_pages == 0


def test_insert_wants_whole_pages() -> None:
    cache = RadixCache(page_size=4)
    with pytest.raises(ValueError, match="2 page.*of 4 tokens cannot hold 7 tokens"):
        cache.insert(seq(0, 7), [0, 1])


def test_insert_rejects_a_page_the_cache_holds_elsewhere() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [0, 1])
    with pytest.raises(ValueError, match=r"page\(s\) \[1\] are already in the cache"):
        cache.insert([5, 6], [1, 7])
    assert cache.num_cached_pages == 2, "a rejected insert keeps nothing"
    with pytest.raises(ValueError, match="appears twice"):
        cache.insert([5, 6], [3, 3])
    cache.check_invariants()


def test_page_size_must_be_a_positive_integer() -> None:
    with pytest.raises(ValueError, match="page_size must be an integer >= 1, got 0"):
        RadixCache(0)


# ---------------------------------------------------------------------------------------------
# Locking


def test_a_locked_prefix_and_its_ancestors_are_never_evicted() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [0, 1, 3])  # shares [1, 2]; page 3 holds token 4
    handle = cache.match_prefix([1, 2, 4]).handle
    cache.lock(handle)
    assert (cache.num_locked_pages, cache.num_evictable_pages) == (3, 1)
    assert cache.evict(10) == [2], "only the branch nobody reads can go"
    assert cache.match_prefix([1, 2, 4]).pages == [0, 1, 3]
    cache.unlock(handle)
    assert (cache.num_locked_pages, cache.num_evictable_pages) == (0, 3)
    assert sorted(cache.evict(10)) == [0, 1, 3]
    cache.check_invariants()


def test_locks_nest() -> None:
    cache = RadixCache(page_size=1)
    handle = cache.insert([1, 2], [0, 1]).handle
    cache.lock(handle)
    cache.lock(handle)
    cache.unlock(handle)
    assert cache.evict(2) == [], "one lock is still held"
    cache.unlock(handle)
    assert sorted(cache.evict(2)) == [0, 1]


def test_locking_the_empty_prefix_does_nothing() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1], [0])
    empty = cache.match_prefix([7]).handle
    cache.lock(empty)
    assert cache.num_locked_pages == 0
    cache.unlock(empty)


def test_unlock_without_a_lock_is_an_error() -> None:
    cache = RadixCache(page_size=1)
    handle = cache.insert([1, 2], [0, 1]).handle
    with pytest.raises(ValueError, match="is not locked"):
        cache.unlock(handle)


def test_a_handle_whose_prefix_was_evicted_cannot_be_locked() -> None:
    cache = RadixCache(page_size=1)
    stale = cache.insert([1, 2], [0, 1]).handle
    cache.evict(2)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(stale)


def test_handles_of_other_caches_are_rejected() -> None:
    cache, other = RadixCache(page_size=1), RadixCache(page_size=1)
    foreign = other.insert([1], [0]).handle
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(foreign)
    with pytest.raises(TypeError, match="expected a handle from RadixCache"):
        cache.lock(CacheHandle(num_tokens=0))


# ---------------------------------------------------------------------------------------------
# Evicting


def test_eviction_takes_the_least_recently_used_leaf_first() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 1], [0, 1])
    cache.insert([2, 2], [2, 3])
    cache.insert([3, 3], [4, 5])
    cache.match_prefix([1, 1])  # [1, 1] is now the most recently used, [2, 2] the least
    assert cache.evict(2) == [2, 3]
    assert cache.evict(2) == [4, 5]
    assert cache.evict(2) == [0, 1]
    assert cache.num_cached_pages == 0


def test_eviction_cascades_to_a_parent_left_without_children() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [0, 1, 3])  # [1, 2] is now an inner node with two leaves
    cache.insert([9], [4])  # the most recent: evicted last
    freed = cache.evict(4)
    assert freed == [2, 3, 0, 1], "both leaves go, then their parent, which became a leaf"
    assert cache.match_prefix([9]).pages == [4]
    cache.check_invariants()


def test_eviction_frees_whole_nodes_and_at_most_what_exists() -> None:
    cache = RadixCache(page_size=2)
    cache.insert(seq(0, 6), [0, 1, 2])
    assert cache.evict(0) == []
    assert sorted(cache.evict(1)) == [0, 1, 2], "one node of three pages goes at once"
    cache.insert(seq(0, 2), [5])
    assert cache.evict(100) == [5], "fewer than asked when fewer are evictable"
    with pytest.raises(ValueError, match="integer >= 0, got -1"):
        cache.evict(-1)


# ---------------------------------------------------------------------------------------------
# A shared system prompt


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_requests_sharing_a_system_prompt_reuse_its_whole_pages(page_size: int) -> None:
    system = seq(1000, 13)  # not a whole number of pages when page_size is 4
    allocator = PageAllocator(64)
    cache = RadixCache(page_size)
    matched = []
    for user in range(4):
        prompt = system + seq(100 * user, 5)
        match = cache.match_prefix(prompt)
        cache.lock(match.handle)
        matched.append(match.num_tokens)
        num_pages = -(-len(prompt) // page_size)
        pages = match.pages + allocator.alloc(num_pages - len(match.pages))
        full = len(prompt) // page_size  # the request is done: offer its whole pages
        result = cache.insert(prompt[: full * page_size], pages[:full])
        cache.unlock(match.handle)
        allocator.free(pages[len(match.pages) : result.num_already_cached // page_size]
                       + pages[full:])
        cache.check_invariants()
    shared = len(system) // page_size * page_size
    assert matched == [0, shared, shared, shared]
    assert allocator.num_free + cache.num_cached_pages == 64


# ---------------------------------------------------------------------------------------------
# The property test: random moves against a reference model


class ReferenceModel:
    """What the cache should hold, without a tree.

    ``pages[prefix]`` is the page holding the last page of ``prefix`` (a whole-page prefix);
    the cached prefixes are closed under taking shorter whole-page prefixes. ``locks`` and
    ``last_used`` are kept per prefix, with the same clock the cache keeps: every match and
    every insert is one tick.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[tuple[int, ...], int] = {}
        self.locks: Counter[tuple[int, ...]] = Counter()
        self.last_used: dict[tuple[int, ...], int] = {}
        self.clock = 0

    def prefixes(self, tokens: tuple[int, ...], num_tokens: int) -> list[tuple[int, ...]]:
        return [tokens[:end] for end in range(self.page_size, num_tokens + 1, self.page_size)]

    def match(self, tokens: tuple[int, ...]) -> list[int]:
        self.clock += 1
        found = []
        for prefix in self.prefixes(tokens, len(tokens)):
            if prefix not in self.pages:
                break
            found.append(self.pages[prefix])
            self.last_used[prefix] = self.clock
        return found

    def insert(self, tokens: tuple[int, ...], pages: list[int]) -> int:
        num_cached = len(self.match(tokens))
        for i, prefix in enumerate(self.prefixes(tokens, len(tokens))):
            if i >= num_cached:
                self.pages[prefix] = pages[i]
                self.last_used[prefix] = self.clock
        return num_cached * self.page_size

    def lock(self, tokens: tuple[int, ...], num_tokens: int, delta: int) -> None:
        for prefix in self.prefixes(tokens, num_tokens):
            self.locks[prefix] += delta
            assert self.locks[prefix] >= 0

    def is_leaf(self, prefix: tuple[int, ...]) -> bool:
        n = len(prefix) + self.page_size
        return not any(len(p) == n and p[: len(prefix)] == prefix for p in self.pages)

    @property
    def num_locked(self) -> int:
        return sum(1 for p in self.pages if self.locks[p] > 0)

    @property
    def num_evictable(self) -> int:
        return len(self.pages) - self.num_locked


@dataclass
class Request:
    """A request in flight, as the scheduler sees it: its tokens and its page-table row."""

    tokens: tuple[int, ...]
    handle: CacheHandle  # the locked cached prefix it reads
    pages: list[int]  # its row: the cache's pages for the prefix, then its own
    handle_pages: int  # the row's first pages, which are the cache's (the locked prefix)


NUM_PAGES = 40
BASES = [tuple(range(16)), tuple([0, 1, 2, 3] * 4), tuple([5] * 16)]
token_runs = st.builds(
    lambda base, cut, tail: base[:cut] + tuple(tail),
    st.sampled_from(BASES), st.integers(0, 16), st.lists(st.integers(0, 5), max_size=6),
)


class RadixCacheMachine(RuleBasedStateMachine):
    """Random scheduler-like traffic against the cache, the model and a real page allocator."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def start(self, page_size: int) -> None:
        self.page_size = page_size
        self.cache = RadixCache(page_size)
        self.model = ReferenceModel(page_size)
        self.allocator = PageAllocator(NUM_PAGES)
        self.requests: list[Request] = []
        self.held: list[tuple[CacheHandle, tuple[int, ...]]] = []  # extra locks, not requests

    # -- helpers ------------------------------------------------------------------------------

    def match(self, tokens: tuple[int, ...]):
        match = self.cache.match_prefix(tokens)
        expected = self.model.match(tokens)
        assert match.pages == expected, f"match of {tokens}: {match.pages} != model {expected}"
        assert match.num_tokens == len(expected) * self.page_size
        return match

    def lock(self, handle: CacheHandle, tokens: tuple[int, ...], delta: int) -> None:
        (self.cache.lock if delta > 0 else self.cache.unlock)(handle)
        self.model.lock(tokens, handle.num_tokens, delta)

    def evict(self, num_pages: int) -> list[int]:
        model = self.model
        evicted = self.cache.evict(num_pages)
        owner = {page: prefix for prefix, page in model.pages.items()}
        assert len(set(evicted)) == len(evicted), f"evict returned a page twice: {evicted}"
        assert all(p in owner for p in evicted), \
            f"evict returned page(s) the cache does not hold: {set(evicted) - set(owner)}"
        gone = [owner[p] for p in evicted]
        assert not any(model.locks[p] for p in gone), "evict returned a locked page"
        assert len(evicted) >= min(num_pages, model.num_evictable), \
            f"asked for {num_pages}, got {len(evicted)} of {model.num_evictable} evictable"
        for prefix in gone:
            del model.pages[prefix]
        for prefix in model.pages:
            assert len(prefix) == self.page_size or prefix[: -self.page_size] in model.pages, \
                "eviction cut an inner node: a cached prefix lost its parent"
        if gone:  # LRU: nothing evicted was used after a leaf that could have gone instead
            newest = max(model.last_used[p] for p in gone)
            for prefix in model.pages:
                if not model.locks[prefix] and model.is_leaf(prefix):
                    assert model.last_used[prefix] >= newest, "evicted a more recent leaf"
        self.allocator.free(evicted)  # raises on a double free
        return evicted

    def alloc(self, num_pages: int) -> list[int] | None:
        """Pages from the allocator, evicting when it runs short, as the scheduler does."""
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.evict(short)
        if num_pages > self.allocator.num_free:
            return None
        return self.allocator.alloc(num_pages)

    def whole(self, tokens: tuple[int, ...]) -> int:
        return len(tokens) // self.page_size

    # -- rules --------------------------------------------------------------------------------

    @rule(tokens=token_runs, keep=st.booleans())
    def match_only(self, tokens: tuple[int, ...], keep: bool) -> None:
        match = self.match(tokens)
        if keep:
            self.lock(match.handle, tokens, +1)
            self.held.append((match.handle, tokens))

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 99))
    def unlock_held(self, index: int) -> None:
        handle, tokens = self.held.pop(index % len(self.held))
        self.lock(handle, tokens, -1)

    @rule(tokens=token_runs)
    def insert_fresh_pages(self, tokens: tuple[int, ...]) -> None:
        tokens = tokens[: self.whole(tokens) * self.page_size]
        pages = self.alloc(self.whole(tokens))
        if pages is None:
            return
        result = self.cache.insert(tokens, pages)
        assert result.num_already_cached == self.model.insert(tokens, pages)
        assert result.handle.num_tokens == len(tokens)
        self.allocator.free(pages[: result.num_already_cached // self.page_size])
        for page in pages:
            assert (page in self.model.pages.values()) != self.allocator.is_free(page), \
                f"page {page} is neither cached nor free (or both)"

    @rule(tokens=token_runs.filter(len))
    def start_request(self, tokens: tuple[int, ...]) -> None:
        match = self.match(tokens)
        self.lock(match.handle, tokens, +1)
        own = self.alloc(-(-len(tokens) // self.page_size) - len(match.pages))
        if own is None:  # does not fit now: a scheduler would leave it waiting
            self.lock(match.handle, tokens, -1)
            return
        self.requests.append(Request(tokens, match.handle, match.pages + own,
                                     handle_pages=len(match.pages)))

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 99))
    def insert_after_prefill(self, index: int) -> None:
        """Offer a running request's pages, keep reading the cache's copy of the prefix."""
        req = self.requests[index % len(self.requests)]
        full = self.whole(req.tokens)
        tokens = req.tokens[: full * self.page_size]
        result = self.cache.insert(tokens, req.pages[:full])
        already = self.model.insert(tokens, req.pages[:full]) // self.page_size
        assert result.num_already_cached == already * self.page_size
        self.lock(result.handle, req.tokens, +1)
        self.lock(req.handle, req.tokens, -1)
        # Pages another request cached meanwhile are duplicates: point the row at the cache's
        # copy, then free ours.
        cached = self.match(tokens).pages
        duplicates = req.pages[req.handle_pages : already]
        req.pages[req.handle_pages : already] = cached[req.handle_pages : already]
        self.allocator.free(duplicates)
        assert req.pages[:full] == cached
        req.handle, req.handle_pages = result.handle, full

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 99))
    def finish_request(self, index: int) -> None:
        self.finish(self.requests.pop(index % len(self.requests)))

    def finish(self, req: Request) -> None:
        full = self.whole(req.tokens)
        tokens = req.tokens[: full * self.page_size]
        result = self.cache.insert(tokens, req.pages[:full])
        already = self.model.insert(tokens, req.pages[:full]) // self.page_size
        assert result.num_already_cached == already * self.page_size
        assert req.handle_pages <= already <= full
        self.lock(req.handle, req.tokens, -1)
        self.allocator.free(req.pages[req.handle_pages : already] + req.pages[full:])
        for page in req.pages:
            assert (page in self.model.pages.values()) != self.allocator.is_free(page), \
                f"page {page} of a finished request is neither cached nor free (or both)"

    @rule(num_pages=st.integers(0, 12))
    def evict_pages(self, num_pages: int) -> None:
        self.evict(num_pages)

    # -- after every step ---------------------------------------------------------------------

    @invariant()
    def tree_agrees_with_the_model(self) -> None:
        self.cache.check_invariants()
        assert self.cache.num_cached_pages == len(self.model.pages)
        assert self.cache.num_locked_pages == self.model.num_locked
        assert self.cache.num_evictable_pages == self.model.num_evictable

    @invariant()
    def every_page_is_in_exactly_one_place(self) -> None:
        cached = set(self.model.pages.values())
        own = [p for req in self.requests for p in req.pages[req.handle_pages :]]
        free = {p for p in range(NUM_PAGES) if self.allocator.is_free(p)}
        assert len(cached) + len(own) + len(free) == NUM_PAGES
        assert cached | set(own) | free == set(range(NUM_PAGES))

    def teardown(self) -> None:
        """Finish everything: all pages the cache does not hold are free, and none is locked."""
        while self.requests:
            self.finish(self.requests.pop())
        while self.held:
            self.unlock_held(0)
        self.cache.check_invariants()
        assert self.cache.num_locked_pages == 0
        assert self.allocator.num_free + self.cache.num_cached_pages == NUM_PAGES


# Modest: a few seconds on two cores. One bug is reported, shrunk, at a time (several at once
# take minutes to shrink).
RadixCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                               deadline=None, report_multiple_bugs=False)
TestRadixCacheAgainstModel = RadixCacheMachine.TestCase


# ---------------------------------------------------------------------------------------------
# End to end: the scheduler with the radix cache
#
# The same engine and scheduler as chapters 9 and 10, switched to ``prefix_cache="radix"``: the
# tokens must not change, only the prefill work. A request's pages enter the tree when it
# finishes, so the tests that count the saving let the first request finish before the others
# arrive.

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

from minisgl.core import Req, SamplingParams  # noqa: E402
from minisgl.kvcache.naive_cache import NaivePrefixCache  # noqa: E402
from minisgl.scheduler.cache import PREFIX_CACHES  # noqa: E402
from minisgl.scheduler.config import SchedulerConfig  # noqa: E402
from minisgl.scheduler.scheduler import Scheduler  # noqa: E402
from minisgl.scheduler.scheduler import StepResult  # noqa: E402

E2E_PAGE_SIZE = 4
E2E_BUDGETS = {"small": 7, "large": 48}  # prompt tokens per prefill step


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Run this module's forward passes on one CPU thread: the tiny model's operations are too
    small for a second thread to pay off, and on a busy machine it makes them much slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_scheduler(model_dir: Path, **options: object) -> Scheduler:
    settings_: dict[str, object] = {"device": "cpu", "page_size": E2E_PAGE_SIZE, "num_pages": 64,
                                    "max_running_reqs": 8, "prefix_cache": "radix"}
    return Scheduler(SchedulerConfig(model_dir, **{**settings_, **options}))


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2048, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def assert_pages_accounted(scheduler: Scheduler) -> None:
    """Nothing runs: every page is free or held by the prefix cache, and none is locked."""
    cache = scheduler.cache
    prefix = cache.prefix_cache
    cached = prefix.num_cached_pages if isinstance(prefix, RadixCache) else 0
    assert cache.pages.num_free + cached == cache.num_pages, "a page leaked"
    assert prefix.num_locked_pages == 0, "a finished request left its prefix locked"
    if isinstance(prefix, RadixCache):
        prefix.check_invariants()


def run(scheduler: Scheduler, reqs: list[Req], arrivals: list[int]) -> list[StepResult]:
    """Add ``reqs[i]`` before step ``arrivals[i]``; step until all finish, checking the
    bookkeeping after every step and the pages at the end."""
    results: list[StepResult] = []
    step = 0
    while step <= max(arrivals) or scheduler.has_work:
        for req, arrival in zip(reqs, arrivals):
            if arrival == step:
                scheduler.add(req)
        results.append(scheduler.step())
        scheduler.check_integrity()
        step += 1
        assert step < 2000, "the run does not end"
    assert all(req.is_finished for req in reqs)
    assert_pages_accounted(scheduler)
    return results


def prefill_tokens(results: list[StepResult]) -> int:
    """Prompt tokens the model computed over a run."""
    return sum(r.num_tokens for r in results if r.phase == "prefill")


SHARED_PROMPT = random_prompts([22], seed=7)[0]  # 5 whole pages of 4 tokens, and 2 more


def e2e_workload() -> tuple[list[list[int]], list[int], list[int]]:
    """18 requests, arriving over the first 14 steps: half start with the shared prompt, three
    extend an earlier prompt (a conversation's next turn), the rest share nothing."""
    generator = torch.Generator().manual_seed(11)
    lengths = torch.randint(2, 30, (18,), generator=generator).tolist()
    prompts = random_prompts(lengths, seed=11)
    for i in range(0, 18, 2):
        prompts[i] = SHARED_PROMPT + prompts[i]
    for i, earlier in ((9, 1), (13, 3), (17, 1)):
        prompts[i] = prompts[earlier] + prompts[i]
    new_tokens = torch.randint(1, 8, (18,), generator=generator).tolist()
    arrivals = sorted(torch.randint(0, 15, (18,), generator=generator).tolist())
    return prompts, new_tokens, arrivals


def run_e2e(scheduler: Scheduler) -> tuple[list[Req], list[StepResult]]:
    prompts, new_tokens, arrivals = e2e_workload()
    reqs = [Req(i, p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    return reqs, run(scheduler, reqs, arrivals)


@pytest.fixture(scope="module")
def naive_outputs(tiny_model_dir: Path) -> list[list[int]]:
    """The workload's tokens without prefix sharing, checked against transformers."""
    from transformers import AutoModelForCausalLM

    reqs, _ = run_e2e(make_scheduler(tiny_model_dir, prefix_cache="naive"))
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for req in reqs:
        # One causal pass over prompt + output gives every greedy choice at once.
        with torch.inference_mode():
            logits = hf_model(torch.tensor([req.prompt_ids + req.output_ids])).logits[0]
        expected = logits[len(req.prompt_ids) - 1:-1].argmax(dim=-1).tolist()
        assert req.output_ids == expected, f"request {req.uid}: not transformers' greedy tokens"
    return [req.output_ids for req in reqs]


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
@pytest.mark.parametrize("budget", sorted(E2E_BUDGETS), ids=str)
def test_the_radix_cache_changes_no_token(tiny_model_dir: Path, budget: str, chunked: bool,
                                          naive_outputs: list[list[int]]) -> None:
    """Transformers' greedy tokens (through the naive run), with less prefill work."""
    scheduler = make_scheduler(tiny_model_dir, prefix_cache="radix", chunked_prefill=chunked,
                               max_prefill_tokens=E2E_BUDGETS[budget])
    reqs, results = run_e2e(scheduler)
    for req, expected in zip(reqs, naive_outputs):
        assert req.output_ids == expected, f"request {req.uid} ({len(req.prompt_ids)} tokens)"
    prompt_tokens = sum(len(req.prompt_ids) for req in reqs)
    assert prefill_tokens(results) < prompt_tokens, "no prefix was reused: a weak test"


def shared_prompt_run(model_dir: Path, prefix_cache: str,
                      num_reqs: int = 8) -> tuple[list[Req], list[StepResult]]:
    """The first request runs alone to its end; then the others arrive together."""
    suffixes = random_prompts([5 + i for i in range(num_reqs)], seed=3)
    for i, suffix in enumerate(suffixes):
        suffix[0] = 100 + i  # every suffix differs from the others at its first token
    reqs = [Req(i, SHARED_PROMPT + s, greedy(3)) for i, s in enumerate(suffixes)]
    scheduler = make_scheduler(model_dir, prefix_cache=prefix_cache)
    first = run(scheduler, reqs[:1], [0])
    return reqs, first + run(scheduler, reqs[1:], [0] * (num_reqs - 1))


def test_a_shared_prompt_saves_exactly_its_whole_pages(tiny_model_dir: Path) -> None:
    naive_reqs, naive_results = shared_prompt_run(tiny_model_dir, "naive")
    radix_reqs, radix_results = shared_prompt_run(tiny_model_dir, "radix")
    shared_pages = len(SHARED_PROMPT) // E2E_PAGE_SIZE  # the 2 tokens past them are recomputed
    saved = prefill_tokens(naive_results) - prefill_tokens(radix_results)
    assert saved == shared_pages * E2E_PAGE_SIZE * (len(radix_reqs) - 1)
    assert [r.output_ids for r in radix_reqs] == [r.output_ids for r in naive_reqs]


def test_locking_a_match_charges_its_evictable_pages(tiny_model_dir: Path) -> None:
    """A matched page that was evictable counted as room for anyone; once locked it is not.

    A's 10 pages stay in the tree; B reuses 9 of them and C needs 6 fresh pages. If admission
    forgot that B's lock took 9 evictable pages away, it would admit C in the same batch and
    the pool would run out when their pages are reserved.
    """
    scheduler = make_scheduler(tiny_model_dir, num_pages=16)
    a = Req(0, seq(1, 40), greedy(1))
    run(scheduler, [a], [0])
    assert scheduler.cache.prefix_cache.num_evictable_pages == 10
    b = Req(1, seq(1, 36) + seq(500, 8), greedy(1))
    c = Req(2, seq(900, 24), greedy(1))
    results = run(scheduler, [b, c], [0, 0])
    assert results[0].uids == (1,), "C must wait: B's locked pages are no longer available"
    assert results[0].num_tokens == 8, "B computes only what its 9 cached pages lack"


def test_eviction_under_a_small_pool_completes_every_request(tiny_model_dir: Path) -> None:
    prompts = random_prompts([30] * 4, seed=5) + [SHARED_PROMPT + p for p in
                                                   random_prompts([8] * 12, seed=6)]
    arrivals = [0, 2, 4, 6] + list(range(8, 32, 2))
    outputs: dict[str, list[list[int]]] = {}
    evicted: list[int] = []
    for kind in ("naive", "radix"):
        scheduler = make_scheduler(tiny_model_dir, prefix_cache=kind, num_pages=14)
        evict = scheduler.cache.prefix_cache.evict

        def counting_evict(num_pages: int) -> list[int]:
            pages = evict(num_pages)
            evicted.extend(pages)
            return pages
        scheduler.cache.prefix_cache.evict = counting_evict  # type: ignore[method-assign]
        reqs = [Req(i, p, greedy(4)) for i, p in enumerate(prompts)]
        run(scheduler, reqs, arrivals)
        outputs[kind] = [req.output_ids for req in reqs]
    assert evicted, "nothing was evicted: the pool is not small enough for this test"
    assert outputs["radix"] == outputs["naive"]


def test_the_prefix_cache_is_chosen_by_name(tiny_model_dir: Path) -> None:
    assert set(PREFIX_CACHES) >= {"naive", "radix"}
    assert isinstance(make_scheduler(tiny_model_dir, prefix_cache="radix").cache.prefix_cache,
                      RadixCache)
    assert isinstance(make_scheduler(tiny_model_dir, prefix_cache="naive").cache.prefix_cache,
                      NaivePrefixCache)
    with pytest.raises(ValueError, match="prefix_cache must be one of naive, radix; got 'lru'"):
        SchedulerConfig(tiny_model_dir, prefix_cache="lru")
