"""Tests for the radix match exercise: they are its specification.

Splits of hand-built trees first, then matches worked by hand, then random traffic compared
with chapter 11's RadixCache: same insertions, same queries, same pages.
"""

from __future__ import annotations

import random

import pytest
from radix_match import Node, insert, match_prefix, path_tokens, split

from minisgl.kvcache.radix_cache import RadixCache


def chain(tokens: list[int], pages: list[int], page_size: int) -> tuple[Node, Node]:
    """A root with one child holding ``tokens``; returns (root, child)."""
    root = Node()
    child = Node(tokens=tuple(tokens), pages=list(pages), parent=root)
    root.children[child.tokens[:page_size]] = child
    return root, child


# ---------------------------------------------------------------------------------------------
# split


def test_split_returns_the_upper_part_in_the_nodes_place() -> None:
    root, node = chain([1, 2, 3, 4, 5, 6], [10, 11, 12], page_size=2)
    upper = split(node, 1, page_size=2)
    assert (upper.tokens, upper.pages) == ((1, 2), [10]), "the upper node holds the first page"
    assert root.children == {(1, 2): upper}, "the upper node replaces node under the same key"
    assert upper.parent is root


def test_split_keeps_the_node_object_as_the_lower_part() -> None:
    _, node = chain([1, 2, 3, 4, 5, 6], [10, 11, 12], page_size=2)
    upper = split(node, 1, page_size=2)
    assert (node.tokens, node.pages) == ((3, 4, 5, 6), [11, 12]), \
        "node keeps the rest of its run and pages"
    assert upper.children == {(3, 4): node}, "node hangs below the upper node, under (3, 4)"
    assert node.parent is upper
    assert path_tokens(node) == (1, 2, 3, 4, 5, 6), "node still ends where it ended"


def test_split_with_four_token_pages_cuts_at_a_page_boundary() -> None:
    root, node = chain(list(range(12)), [7, 8, 9], page_size=4)
    upper = split(node, 2, page_size=4)
    assert (upper.tokens, upper.pages) == (tuple(range(8)), [7, 8])
    assert (node.tokens, node.pages) == ((8, 9, 10, 11), [9])
    assert upper.children == {(8, 9, 10, 11): node}
    assert root.children == {(0, 1, 2, 3): upper}


def test_split_keeps_the_children_of_the_node() -> None:
    _, node = chain([1, 2, 3, 4], [0, 1, 2, 3], page_size=1)
    grandchild = Node(tokens=(5,), pages=[4], parent=node)
    node.children[(5,)] = grandchild
    split(node, 3, page_size=1)
    assert node.children == {(5,): grandchild} and grandchild.parent is node


# ---------------------------------------------------------------------------------------------
# match_prefix by hand


def test_match_on_an_empty_tree_returns_the_root() -> None:
    root = Node()
    node, pages = match_prefix(root, [1, 2, 3], page_size=1)
    assert node is root and pages == []


def test_the_readme_example() -> None:
    root = Node()
    insert(root, [1, 2, 3, 4, 5, 6], [10, 11, 12], 2)
    (original,) = root.children.values()
    node, pages = match_prefix(root, [1, 2, 3, 9, 5], page_size=2)
    assert pages == [10], "one whole page agrees: (1, 2)"
    assert (node.tokens, node.pages) == ((1, 2), [10]), "the match ends on the new upper node"
    assert root.children == {(1, 2): node}
    assert node.children == {(3, 4): original}, "the original node keeps (3, 4, 5, 6)"
    assert original.pages == [11, 12]


@pytest.mark.parametrize("page_size", [1, 4])
def test_an_exact_match_returns_every_page_and_the_last_node(page_size: int) -> None:
    root = Node()
    tokens = list(range(3 * page_size))
    insert(root, tokens, [5, 6, 7], page_size)
    node, pages = match_prefix(root, tokens, page_size)
    assert pages == [5, 6, 7]
    assert path_tokens(node) == tuple(tokens)
    assert len(root.children) == 1 and not node.children, "an exact match splits nothing"


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_longer_query_matches_the_cached_part(page_size: int) -> None:
    root = Node()
    insert(root, list(range(2 * page_size)), [5, 6], page_size)
    node, pages = match_prefix(root, list(range(5 * page_size)), page_size)
    assert pages == [5, 6] and path_tokens(node) == tuple(range(2 * page_size))


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_query_with_another_first_page_matches_nothing(page_size: int) -> None:
    root = Node()
    insert(root, list(range(2 * page_size)), [5, 6], page_size)
    node, pages = match_prefix(root, [99] * page_size, page_size)
    assert node is root and pages == []


def test_only_whole_pages_match() -> None:
    root = Node()
    insert(root, list(range(8)), [1, 2], 4)
    assert match_prefix(root, list(range(7)), 4)[1] == [1], \
        "7 tokens hold one whole page; the part page is not matched"
    assert match_prefix(root, [0, 1, 2, 3, 4, 5, 99, 7], 4)[1] == [1], \
        "a difference inside the second page leaves only the first"
    assert match_prefix(root, [0, 1, 2], 4)[1] == [], "less than a page matches nothing"


def test_a_query_ending_inside_an_edge_splits_it() -> None:
    root = Node()
    insert(root, [1, 2, 3, 4], [0, 1, 2, 3], 1)
    node, pages = match_prefix(root, [1, 2], page_size=1)
    assert pages == [0, 1] and (node.tokens, node.pages) == ((1, 2), [0, 1])
    assert list(node.children) == [(3,)], "the rest, (3, 4), hangs below the match"


def test_matching_changes_what_is_cached_not_at_all() -> None:
    root = Node()
    insert(root, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], 1)
    match_prefix(root, [1, 2, 9], 1)
    match_prefix(root, [1, 2, 3, 4, 0], 1)
    assert match_prefix(root, [1, 2, 3, 4, 5, 6], 1)[1] == [0, 1, 2, 3, 4, 5]


def test_branches_are_followed_by_their_first_page() -> None:
    root = Node()
    insert(root, [1, 2, 3, 4], [0, 1], 2)
    insert(root, [1, 2, 5, 6], [2, 3], 2)  # shares (1, 2): your match splits, insert branches
    insert(root, [7, 8], [4], 2)
    assert match_prefix(root, [1, 2, 5, 6, 7], 2)[1] == [0, 3]
    assert match_prefix(root, [1, 2, 3, 4], 2)[1] == [0, 1]
    assert match_prefix(root, [7, 8, 1, 2], 2)[1] == [4]


# ---------------------------------------------------------------------------------------------
# Against chapter 11's RadixCache


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_random_traffic_matches_the_radix_cache(page_size: int) -> None:
    rng = random.Random(page_size)
    root, cache = Node(), RadixCache(page_size)
    bases = [[rng.randrange(3) for _ in range(24)] for _ in range(3)]
    next_page = 0
    for step in range(300):
        base = rng.choice(bases)
        tokens = base[: rng.randrange(len(base) + 1)] + [rng.randrange(3)
                                                         for _ in range(rng.randrange(4))]
        if rng.random() < 0.4:
            tokens = tokens[: len(tokens) // page_size * page_size]
            pages = list(range(next_page, next_page + len(tokens) // page_size))
            next_page += len(pages)
            expected = cache.insert(tokens, pages).num_already_cached
            got = insert(root, tokens, pages, page_size)
            assert got == expected, f"step {step}: insert of {tokens} found {got} tokens cached, " \
                                    f"the radix cache {expected}"
        else:
            node, pages = match_prefix(root, tokens, page_size)
            expected = cache.match_prefix(tokens).pages
            assert pages == expected, f"step {step}: match of {tokens} gave pages {pages}, " \
                                      f"expected {expected}"
            assert path_tokens(node) == tuple(tokens[: len(pages) * page_size]), \
                f"step {step}: the returned node does not end where the match ends"
