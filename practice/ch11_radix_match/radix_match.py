"""Matching a prefix in a radix tree of token runs.

Write ``split`` and ``match_prefix``. See README.md for the rules and an example;
`python practice/judge.py ch11_radix_match` checks your work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    """One edge of the tree (from ``parent`` to this node) and the node it leads to.

    ``tokens`` is the run of token ids on the edge, ``pages`` the KV pages holding them:
    ``len(tokens) == len(pages) * page_size``. ``children`` maps the first page of each child's
    run (a tuple of ``page_size`` token ids) to the child. The root has no tokens, no pages
    and no parent.
    """

    tokens: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    parent: Node | None = field(default=None, repr=False)
    children: dict[tuple[int, ...], Node] = field(default_factory=dict, repr=False)


def split(node: Node, num_pages: int, page_size: int) -> Node:
    """Cut ``node``'s edge after its first ``num_pages`` pages; return the new upper node."""
    raise NotImplementedError("split: a new upper node takes the first pages and node's place "
                              "under the parent; node keeps the rest and hangs below it")


def match_prefix(root: Node, token_ids: Sequence[int],
                 page_size: int) -> tuple[Node, list[int]]:
    """The longest cached prefix of ``token_ids`` in whole pages: where it ends, and its pages."""
    raise NotImplementedError("match_prefix: walk down page by page from the root, split the "
                              "edge where the match ends inside it")


# ---------------------------------------------------------------------------------------------
# Given: you do not need to change anything below.


def insert(root: Node, token_ids: Sequence[int], pages: Sequence[int], page_size: int) -> int:
    """Add ``token_ids`` (held in ``pages``) to the tree; return how many tokens it had already.

    Uses your :func:`match_prefix` to find where the new run hangs.
    """
    tokens = tuple(token_ids)
    assert len(tokens) == len(pages) * page_size, "whole pages only"
    node, matched = match_prefix(root, tokens, page_size)
    num_cached = len(matched) * page_size
    if num_cached < len(tokens):
        leaf = Node(tokens=tokens[num_cached:], pages=list(pages[len(matched):]), parent=node)
        node.children[leaf.tokens[:page_size]] = leaf
    return num_cached


def path_tokens(node: Node) -> tuple[int, ...]:
    """The prefix the path from the root to ``node`` spells."""
    runs = []
    while node.parent is not None:
        runs.append(node.tokens)
        node = node.parent
    return tuple(t for run in reversed(runs) for t in run)
