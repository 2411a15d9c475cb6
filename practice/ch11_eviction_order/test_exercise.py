"""Tests for the eviction-order exercise: they are its specification.

The README's example first, then the rules one by one (a lock protects its path, least
recently used first, ties by name, parents after their children, whole nodes), then random
tables compared with a step-by-step reference, then a tree grown by chapter 11's RadixCache,
whose own eviction must free the same pages in the same order.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest
from eviction_order import CachedNode, eviction_order, protected

if TYPE_CHECKING:  # the tree's types only: the module needs torch, the browser has none
    from minisgl.kvcache.radix_cache import RadixCache, RadixNode


N = CachedNode

EXAMPLE = [N("S", None, 2, 0, 9), N("A", "S", 1, 0, 3), N("B", "S", 2, 1, 5),
           N("C", "S", 1, 0, 8), N("D", "C", 2, 0, 7), N("T", None, 3, 0, 4)]


def show(nodes: list[CachedNode]) -> str:
    """The table, one node per entry: name<parent pages=, locks=, used=."""
    return "[" + ", ".join(f"{n.name}<{n.parent or 'root'} pages={n.num_pages} "
                           f"locks={n.locks} used={n.last_used}" for n in nodes) + "]"


def check_order(nodes: list[CachedNode], num_pages: int, expected: list[str]) -> None:
    got = eviction_order(nodes, num_pages)
    assert got == expected, (f"eviction_order({show(nodes)}, num_pages={num_pages}): "
                             f"expected {expected}, got {got}")


def check_protected(nodes: list[CachedNode], expected: set[str]) -> None:
    got = protected(nodes)
    assert got == expected, (f"protected({show(nodes)}): expected {sorted(expected)}, "
                             f"got {sorted(got) if isinstance(got, set) else got!r}")


# ---------------------------------------------------------------------------------------------
# The README's example


def test_the_readme_example_protects_the_locked_node_and_its_ancestors() -> None:
    check_protected(EXAMPLE, {"B", "S"})


@pytest.mark.parametrize(("num_pages", "expected"), [
    (1, ["A"]), (4, ["A", "T"]), (6, ["A", "T", "D"]), (7, ["A", "T", "D", "C"]),
    (100, ["A", "T", "D", "C"])])
def test_the_readme_example(num_pages: int, expected: list[str]) -> None:
    check_order(EXAMPLE, num_pages, expected)


# ---------------------------------------------------------------------------------------------
# protected


def test_a_lock_protects_every_node_up_to_the_root() -> None:
    chain = [N("X", None, 1, 0, 1), N("Y", "X", 1, 0, 1), N("Z", "Y", 1, 2, 1),
             N("W", "X", 1, 0, 1)]
    check_protected(chain, {"X", "Y", "Z"})


def test_nothing_locked_protects_nothing() -> None:
    check_protected([N("X", None, 1, 0, 1), N("Y", "X", 1, 0, 2)], set())


def test_two_locks_on_one_path_protect_it_once() -> None:
    chain = [N("X", None, 1, 1, 1), N("Y", "X", 1, 1, 1), N("V", None, 4, 0, 1)]
    check_protected(chain, {"X", "Y"})


# ---------------------------------------------------------------------------------------------
# eviction_order, rule by rule


def test_zero_pages_evict_nothing() -> None:
    check_order(EXAMPLE, 0, [])


def test_the_least_recently_used_leaf_goes_first() -> None:
    leaves = [N("old", None, 1, 0, 2), N("new", None, 1, 0, 9), N("mid", None, 1, 0, 5)]
    check_order(leaves, 1, ["old"])
    check_order(leaves, 3, ["old", "mid", "new"])


def test_a_tie_goes_to_the_smaller_name() -> None:
    check_order([N("b", None, 1, 0, 4), N("a", None, 1, 0, 4), N("c", None, 1, 0, 3)], 2,
                ["c", "a"])


def test_whole_nodes_go_even_when_fewer_pages_were_asked_for() -> None:
    check_order([N("big", None, 5, 0, 1), N("small", None, 1, 0, 2)], 1, ["big"])


def test_a_locked_leaf_is_never_evicted() -> None:
    check_order([N("busy", None, 1, 1, 1), N("idle", None, 1, 0, 8)], 5, ["idle"])


def test_a_parent_goes_only_after_its_last_child() -> None:
    tree = [N("P", None, 1, 0, 6), N("Q", "P", 1, 0, 2), N("R", "P", 1, 0, 3),
            N("L", None, 1, 0, 4)]
    check_order(tree, 4, ["Q", "R", "L", "P"])


def test_a_parent_left_childless_competes_by_its_own_last_use() -> None:
    # P was last used before L: once Q is gone, P goes before L.
    tree = [N("P", None, 1, 0, 2), N("Q", "P", 1, 0, 3), N("L", None, 1, 0, 5)]
    check_order(tree, 3, ["Q", "P", "L"])


def test_a_parent_that_keeps_a_locked_child_stays() -> None:
    tree = [N("P", None, 3, 0, 9), N("Q", "P", 1, 0, 1), N("K", "P", 1, 1, 2)]
    check_order(tree, 10, ["Q"])


@pytest.mark.parametrize("bad", [
    ("a negative num_pages", [N("X", None, 1, 0, 1)], -1),
    ("a name twice", [N("X", None, 1, 0, 1), N("X", None, 2, 0, 2)], 1),
    ("a parent not in the table", [N("X", "nowhere", 1, 0, 1)], 1)], ids=lambda b: b[0])
def test_bad_input_is_refused_with_a_value_error(bad: tuple) -> None:
    what, nodes, num_pages = bad
    with pytest.raises(ValueError):
        eviction_order(nodes, num_pages)
        pytest.fail(f"eviction_order({show(nodes)}, num_pages={num_pages}) accepted {what}")


# ---------------------------------------------------------------------------------------------
# Random tables against a step-by-step reference


def reference_order(nodes: list[CachedNode], num_pages: int) -> list[str]:
    """Re-scan the whole table after every eviction: slow, and plainly right."""
    table = {n.name: n for n in nodes}
    safe = set()
    for n in nodes:
        name = n.name if n.locks else None
        while name is not None:
            safe.add(name)
            name = table[name].parent
    left, order, freed = dict(table), [], 0
    while freed < num_pages:
        leaves = [n for n in left.values() if n.name not in safe
                  and not any(m.parent == n.name for m in left.values())]
        if not leaves:
            break
        victim = min(leaves, key=lambda n: (n.last_used, n.name))
        order.append(victim.name)
        freed += victim.num_pages
        del left[victim.name]
    return order


def random_table(rng: random.Random) -> list[CachedNode]:
    nodes: list[CachedNode] = []
    for i in range(rng.randrange(1, 12)):
        parent = rng.choice([None] + [n.name for n in nodes]) if nodes else None
        nodes.append(N(f"n{i}", parent, rng.randrange(1, 5), int(rng.random() < 0.2),
                       rng.randrange(10)))
    rng.shuffle(nodes)
    return nodes


@pytest.mark.parametrize("seed", range(5))
def test_random_tables_match_a_step_by_step_reference(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        nodes = random_table(rng)
        num_pages = rng.randrange(0, 3 + sum(n.num_pages for n in nodes))
        check_order(nodes, num_pages, reference_order(nodes, num_pages))


# ---------------------------------------------------------------------------------------------
# A tree grown by chapter 11's RadixCache


def table_of(cache: RadixCache) -> tuple[list[CachedNode], dict[str, list[int]]]:
    """The cache's tree as a table, and each named node's pages."""
    nodes, pages = [], {}
    names: dict[int, str] = {}
    stack: list[tuple[RadixNode, str | None]] = [(c, None) for c in cache.root.children.values()]
    while stack:
        node, parent = stack.pop()
        name = names.setdefault(id(node), f"n{len(names):02d}")
        # The cache counts a lock on every node of the path; the table counts it where it ends.
        own = node.lock_count - sum(c.lock_count for c in node.children.values())
        nodes.append(N(name, parent, node.num_pages, own, node.last_used))
        pages[name] = list(node.pages)
        stack.extend((c, name) for c in node.children.values())
    return nodes, pages


@pytest.mark.parametrize("seed", range(4))
def test_the_chapters_cache_evicts_the_same_pages_in_the_same_order(seed: int) -> None:
    pytest.importorskip("torch", reason="chapter 11's RadixCache needs PyTorch (not in the "
                                        "browser): the local judge runs this test")
    from minisgl.kvcache.radix_cache import RadixCache

    rng = random.Random(seed)
    page_size = 2
    cache = RadixCache(page_size)
    bases = [[rng.randrange(4) for _ in range(16)] for _ in range(2)]
    next_page = 0
    for _ in range(12):
        base = rng.choice(bases)
        tokens = base[: rng.randrange(1, 9) * page_size] + [rng.randrange(4) for _ in range(4)]
        num = len(tokens) // page_size
        cache.insert(tokens, list(range(next_page, next_page + num)))
        next_page += num
        if rng.random() < 0.4:
            cache.lock(cache.match_prefix(rng.choice(bases)[: rng.randrange(1, 8) * 2]).handle)
    nodes, pages = table_of(cache)
    asked = rng.randrange(1, cache.num_cached_pages + 1)
    order = eviction_order(nodes, asked)
    got = [p for name in order for p in pages.get(name, [])]
    expected = cache.evict(asked)
    assert got == expected, (f"eviction_order({show(nodes)}, num_pages={asked}) = {order} frees "
                             f"pages {got}; the chapter's RadixCache frees {expected}")
