"""Choosing what a prefix cache evicts.

Write ``protected`` and ``eviction_order``. See README.md for the rules and an example;
`python practice/judge.py ch11_eviction_order` checks your work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CachedNode:
    """One node of the cache's tree, as a row of a table.

    ``parent`` is the parent's name, or None for a child of the root (the root is not listed
    and is never evicted). ``num_pages`` is how many KV pages the node's edge holds. ``locks``
    counts the running requests whose matched prefix ends exactly at this node. ``last_used``
    is the clock tick of the last walk that passed through the node.
    """

    name: str
    parent: str | None
    num_pages: int
    locks: int
    last_used: int


def protected(nodes: Sequence[CachedNode]) -> set[str]:
    """The names of the nodes no eviction may take while the current locks hold."""
    raise NotImplementedError("protected: a request reads its whole prefix, from the root down "
                              "to the node its match ends at")


def eviction_order(nodes: Sequence[CachedNode], num_pages: int) -> list[str]:
    """The names of the nodes evicted, in order, to free at least ``num_pages`` pages."""
    raise NotImplementedError("eviction_order: least recently used unprotected leaf first; a "
                              "parent left without children becomes a leaf")
