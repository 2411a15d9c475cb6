"""The radix cache: one copy of the KV pages of every prefix that requests share.

A token's K/V depend only on the tokens before it, so requests that share a prefix can share
its pages. The tree keeps finished requests' pages keyed by token ids: each edge holds a run of
tokens in *whole pages* (``len(tokens) == len(pages) * page_size``), children are keyed by the
first page of their run, and the least recently used unlocked leaves are evicted first.
Chapter 11 tells the story.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from minisgl.kvcache.base import BasePrefixCache, CacheHandle, InsertResult, PrefixMatch
from minisgl.utils.checks import check_int
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

Tokens = tuple[int, ...]


@dataclass(eq=False)  # nodes are compared by identity: two runs of equal tokens are two nodes
class RadixNode:
    """One edge of the tree and the node it leads to.

    Attributes:
        tokens: the run of token ids on the edge from the parent, a whole number of pages.
        pages: the page ids holding those tokens' K/V, one per ``page_size`` tokens.
        parent: the node above (None for the root, and for a node that has been evicted).
        children: the nodes below, keyed by the first page of their run.
        depth: tokens on the path from the root to the end of this edge: the length of the
            prefix this node completes.
        lock_count: running requests whose prefix passes through this node. A locked node is
            never evicted; since a lock covers the whole path, its ancestors are locked too.
        last_used: the cache's clock when a match or an insert last walked through this node.
    """

    tokens: Tokens
    pages: list[int]
    parent: RadixNode | None = field(default=None, repr=False)
    children: dict[Tokens, RadixNode] = field(default_factory=dict, repr=False)
    depth: int = 0
    lock_count: int = 0
    last_used: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.pages)


@dataclass(frozen=True)
class RadixHandle(CacheHandle):
    """A cached prefix: the node where it ends. ``num_tokens`` is that node's depth."""

    node: RadixNode = field(repr=False)


class RadixCache(BasePrefixCache):
    """A prefix cache that shares the KV pages of common prefixes through a radix tree.

    The tree owns the pages it holds: no request frees them. A request borrows (and locks) its
    matched prefix's pages while it runs; :meth:`insert` takes over the pages the tree lacked.
    Pages leave the tree only through :meth:`evict`, which hands them back to the caller.

    Args:
        page_size: token slots per KV page: the unit of matching, sharing and eviction.
    """

    def __init__(self, page_size: int = 1) -> None:
        super().__init__(page_size)
        self.root = RadixNode(tokens=(), pages=[])
        # A logical clock rather than wall time: the order of events is all LRU needs, and a
        # counter makes eviction (and every test of it) deterministic.
        self._clock = 0
        # Every page the tree holds, and how many are unlocked: kept in step with the tree by
        # each operation, so the scheduler reads the sizes in O(1); check_invariants recounts.
        self._pages: set[int] = set()
        self._num_evictable = 0

    # ---------------------------------------------------------------------------------------
    # Sizes

    @property
    def num_cached_pages(self) -> int:
        """Pages the tree holds, locked or not."""
        return len(self._pages)

    @property
    def num_evictable_pages(self) -> int:
        """Pages the tree holds that no running request has locked."""
        return self._num_evictable

    @property
    def num_locked_pages(self) -> int:
        """Pages the tree holds that some running request reads: every one not evictable."""
        return len(self._pages) - self._num_evictable

    # ---------------------------------------------------------------------------------------
    # Matching

    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor) -> PrefixMatch:
        """The longest cached prefix of ``token_ids``, in whole pages, and its pages.

        What the cache holds does not change, but its shape may: when the match ends inside
        an edge, that edge is split there, so that the handle can name a node. The nodes on
        the matched path count as used now for LRU eviction.
        """
        node, pages = self._walk(tuple(_as_ints(token_ids)))
        return PrefixMatch(handle=RadixHandle(num_tokens=node.depth, node=node), pages=pages)

    def _walk(self, tokens: Tokens) -> tuple[RadixNode, list[int]]:
        """Follow ``tokens`` down the tree as far as whole pages agree: the last node, and the
        pages on the way there, in token order.

        Every node on the way is stamped with a new tick of the clock. Tokens past the last
        whole page are not looked at: a request keeps writing into its last, partly filled
        page, so a part page is never the cache's to give away.
        """
        self._clock += 1
        page = self.page_size
        end = len(tokens) - len(tokens) % page
        node, pos, pages = self.root, 0, []
        while pos < end:
            child = node.children.get(tokens[pos : pos + page])
            if child is None:
                break  # no cached run starts with our next page
            # The child's first page agrees (it is the key); count how many more do.
            num_pages = _pages_in_common(child.tokens, tokens[pos:end], page)
            if num_pages < child.num_pages:
                child = self._split(child, num_pages)  # the match ends inside this edge
            child.last_used = self._clock
            pages.extend(child.pages)
            node, pos = child, pos + num_pages * page
        return node, pages

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut ``node``'s edge after its first ``num_pages`` pages; return the new upper node.

        ``node`` keeps the *lower* part and its depth, so every handle on it still names the
        same prefix. The upper node takes ``node``'s key under the parent and its lock count
        (every lock through ``node`` passes through it too). The page counts do not change.
        """
        assert 0 < num_pages < node.num_pages, (num_pages, node.num_pages)
        assert node.parent is not None, "the root has no edge to split"
        cut = num_pages * self.page_size
        upper = RadixNode(tokens=node.tokens[:cut], pages=node.pages[:num_pages],
                          parent=node.parent, depth=node.depth - len(node.tokens) + cut,
                          lock_count=node.lock_count, last_used=node.last_used)
        node.parent.children[upper.tokens[: self.page_size]] = upper
        node.tokens, node.pages = node.tokens[cut:], node.pages[num_pages:]
        node.parent = upper
        upper.children[node.tokens[: self.page_size]] = node
        return upper

    # ---------------------------------------------------------------------------------------
    # Inserting

    def insert(self, token_ids: Sequence[int] | torch.Tensor,
               pages: Sequence[int] | torch.Tensor) -> InsertResult:
        """Offer the K/V of ``token_ids``, held in ``pages``; the cache keeps what it lacks.

        The leading tokens the tree already holds keep the tree's pages: for them the caller's
        pages are duplicates (``num_already_cached`` tells how many tokens), and the caller
        frees those it owns. The rest becomes one new leaf that owns its pages from now on.
        The returned handle names the whole of ``token_ids``, which the tree now holds.

        Raises:
            ValueError: ``pages`` do not hold ``token_ids`` in whole pages, a page id repeats,
                or a page to be kept is one the cache holds already (somewhere else).
        """
        tokens, new_pages = tuple(_as_ints(token_ids)), _as_ints(pages)
        self._check_whole_pages(len(tokens), len(new_pages))
        if len(set(new_pages)) != len(new_pages):
            raise ValueError(f"insert: a page id appears twice in {new_pages[:16]}")
        node, _ = self._walk(tokens)
        num_cached = node.depth
        if num_cached < len(tokens):
            kept = new_pages[num_cached // self.page_size :]
            if held := self._pages.intersection(kept):
                # A page in two places of the tree would be freed twice on eviction.
                raise ValueError(f"insert: page(s) {sorted(held)[:8]} are already in the cache, "
                                 "at other positions; offer pages the cache does not hold")
            leaf = RadixNode(tokens=tokens[num_cached:], pages=kept, parent=node,
                             depth=len(tokens), last_used=self._clock)
            node.children[leaf.tokens[: self.page_size]] = leaf
            self._pages.update(kept)
            self._num_evictable += len(kept)  # nobody has locked the new leaf yet
            node = leaf
        return InsertResult(num_already_cached=num_cached,
                            handle=RadixHandle(num_tokens=node.depth, node=node))

    # ---------------------------------------------------------------------------------------
    # Locking

    def lock(self, handle: CacheHandle) -> None:
        """Protect the prefix behind ``handle`` from eviction while a request reads it.

        The lock covers every node from the handle's up to the root: a request reads its whole
        prefix.
        """
        self._count_lock(self._node_of(handle, "lock"), +1)

    def unlock(self, handle: CacheHandle) -> None:
        """Undo one :meth:`lock` of ``handle``; the last unlock makes its pages evictable."""
        node = self._node_of(handle, "unlock")
        if node.parent is not None and node.lock_count == 0:
            raise ValueError(f"unlock: the prefix of {handle.num_tokens} tokens is not locked "
                             "(one unlock per lock)")
        self._count_lock(node, -1)

    def _count_lock(self, node: RadixNode, step: int) -> None:
        """Add ``step`` (+1 or -1) to every lock count from ``node`` up to the root; a node's
        pages move between evictable and locked when its count leaves or comes back to 0."""
        while node.parent is not None:
            was_locked = node.lock_count > 0
            node.lock_count += step
            if (node.lock_count > 0) != was_locked:
                self._num_evictable -= step * node.num_pages
            node = node.parent

    def _node_of(self, handle: CacheHandle, op: str) -> RadixNode:
        """The node behind ``handle``, checked to be still in this tree."""
        if not isinstance(handle, RadixHandle):
            raise TypeError(f"{op}: expected a handle from RadixCache.match_prefix or insert, "
                             f"got {handle!r}")
        top = handle.node
        while top.parent is not None:
            top = top.parent
        if top is not self.root:
            # An evicted node is cut loose from the tree; so is every node of another cache.
            raise ValueError(f"{op}: the prefix of {handle.num_tokens} tokens is not in this "
                             "cache (evicted since it was matched, or another cache's handle); "
                             "lock a handle right after match_prefix, before anything evicts")
        assert handle.node.depth == handle.num_tokens, (handle.node.depth, handle.num_tokens)
        return handle.node

    # ---------------------------------------------------------------------------------------
    # Evicting

    def evict(self, num_pages: int) -> list[int]:
        """Remove least recently used unlocked leaves until ``num_pages`` pages are freed.

        Returns the freed page ids, for the caller to give back to the allocator. Whole nodes
        go, so a few more pages than asked may come back; fewer only when fewer are
        evictable. Only leaves are cut: a child cut off from the root could never be matched
        again.
        """
        check_int("evict: num_pages", num_pages, at_least=0)
        # Every unlocked node, least recently used first. A walk stamps its whole path, so a
        # parent is never used less recently than its children; on a tie the deeper node comes
        # first. So each node comes after all of its children (a lock on a child would lock
        # it too): by its turn it is a leaf.
        unlocked = [node for node in self._nodes() if node.lock_count == 0]
        unlocked.sort(key=lambda node: (node.last_used, -node.depth))
        freed: list[int] = []
        for leaf in unlocked:
            if len(freed) >= num_pages:
                break
            assert leaf.parent is not None and not leaf.children
            del leaf.parent.children[leaf.tokens[: self.page_size]]
            leaf.parent = None  # cut loose: a stale handle to it is now detected
            freed.extend(leaf.pages)
            self._pages.difference_update(leaf.pages)
            self._num_evictable -= leaf.num_pages
        logger.debug("evicted %d page(s) (asked for %d); %d evictable left",
                     len(freed), num_pages, self._num_evictable)
        return freed

    # ---------------------------------------------------------------------------------------
    # Checking and printing

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node below the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Recount the tree and check every structural promise the operations above make.

        Raises:
            RuntimeError: naming the first broken invariant.
        """
        def fail(why: str) -> None:
            raise RuntimeError(f"radix cache invariant broken: {why}")

        if self.root.tokens or self.root.pages or self.root.lock_count or self.root.depth:
            fail("the root holds no tokens, no pages and no locks")
        pages: list[int] = []
        evictable = 0
        for node in self._nodes():
            parent = node.parent
            if parent is None or parent.children.get(node.tokens[: self.page_size]) is not node:
                fail(f"node at depth {node.depth} is not its parent's child under its first page")
            if not node.pages or len(node.tokens) != node.num_pages * self.page_size:
                fail(f"node at depth {node.depth} holds {len(node.tokens)} tokens in "
                     f"{node.num_pages} page(s) of {self.page_size}")
            if node.depth != parent.depth + len(node.tokens):
                fail(f"node at depth {node.depth} sits under a node at depth {parent.depth} "
                     f"with {len(node.tokens)} tokens on its edge")
            # Locks cover whole paths: a node is locked at least as often as all its children
            # (and so, from the leaves up, never a negative number of times).
            if node.lock_count < sum(c.lock_count for c in node.children.values()):
                fail(f"node at depth {node.depth} has fewer locks than its children")
            if parent is not self.root and parent.last_used < node.last_used:
                fail(f"node at depth {node.depth} was used after its parent")
            pages.extend(node.pages)
            evictable += 0 if node.lock_count else node.num_pages
        if len(set(pages)) != len(pages):
            fail(f"a page appears twice in the tree: {sorted(pages)}")
        if set(pages) != self._pages:
            fail(f"the tree holds {len(pages)} pages but the cache counts {len(self._pages)}")
        if evictable != self._num_evictable:
            fail(f"recounted {evictable} evictable pages, the counter says {self._num_evictable}")

    def pretty(self, max_tokens: int = 12) -> str:
        """A drawing of the tree: each edge's token ids (``|`` between pages), pages, lock
        count and last use. Runs longer than ``max_tokens`` are cut, saying how many are left out.
        """
        lines = [f"root  ({self.num_cached_pages} pages cached: {self.num_locked_pages} "
                 f"locked, {self.num_evictable_pages} evictable)"]

        def run_text(tokens: Tokens) -> str:
            shown, page = tokens[:max_tokens], self.page_size
            text = "|".join(" ".join(map(str, shown[i : i + page]))
                            for i in range(0, len(shown), page))
            more = len(tokens) - len(shown)
            return text + (f" …(+{more})" if more else "")

        def draw(node: RadixNode, indent: str) -> None:
            children = sorted(node.children.items())  # by first page: a stable drawing
            for i, (_, child) in enumerate(children):
                last = i == len(children) - 1
                lock = f"  locked x{child.lock_count}" if child.lock_count else ""
                lines.append(f"{indent}{'└── ' if last else '├── '}[{run_text(child.tokens)}]  "
                             f"pages {_page_list(child.pages)}{lock}  used @{child.last_used}")
                draw(child, indent + ("    " if last else "│   "))

        draw(self.root, "")
        return "\n".join(lines)


def _pages_in_common(edge: Tokens, tokens: Tokens, page_size: int) -> int:
    """Whole pages at the start of ``edge`` and ``tokens`` that agree token for token."""
    limit = min(len(edge), len(tokens))
    same = 0
    while same < limit and edge[same] == tokens[same]:
        same += 1
    return same // page_size


def _as_ints(ids: Sequence[int] | torch.Tensor) -> list[int]:
    """Token or page ids as plain ints (a tensor's too): hashable, so a page can key a child."""
    return ids.tolist() if isinstance(ids, torch.Tensor) else [operator.index(i) for i in ids]


def _page_list(pages: list[int], limit: int = 6) -> str:
    if len(pages) <= limit:
        return str(pages)
    return f"[{', '.join(map(str, pages[:limit]))}, … {len(pages) - limit} more]"
