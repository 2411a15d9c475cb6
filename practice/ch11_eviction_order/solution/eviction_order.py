"""Choosing what a prefix cache evicts (reference solution)."""

from __future__ import annotations

import heapq
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


def _by_name(nodes: Sequence[CachedNode]) -> dict[str, CachedNode]:
    table: dict[str, CachedNode] = {}
    for node in nodes:
        if node.name in table:
            raise ValueError(f"node {node.name!r} appears twice in the table")
        table[node.name] = node
    for node in nodes:
        if node.parent is not None and node.parent not in table:
            raise ValueError(f"node {node.name!r} names a parent {node.parent!r} that is not "
                             f"in the table")
    return table


def protected(nodes: Sequence[CachedNode]) -> set[str]:
    """The names of the nodes no eviction may take while the current locks hold."""
    table = _by_name(nodes)
    safe: set[str] = set()
    for node in nodes:
        name = node.name if node.locks > 0 else None
        # A lock covers the whole path: the request reads every page from the root down.
        while name is not None and name not in safe:
            safe.add(name)
            name = table[name].parent
    return safe


def eviction_order(nodes: Sequence[CachedNode], num_pages: int) -> list[str]:
    """The names of the nodes evicted, in order, to free at least ``num_pages`` pages."""
    if num_pages < 0:
        raise ValueError(f"num_pages must be >= 0, got {num_pages}")
    table = _by_name(nodes)
    safe = protected(nodes)
    children = {name: 0 for name in table}
    for node in nodes:
        if node.parent is not None:
            children[node.parent] += 1
    # (last used, name): least recently used first, ties to the smaller name.
    heap = [(n.last_used, n.name) for n in nodes if children[n.name] == 0 and n.name not in safe]
    heapq.heapify(heap)
    order: list[str] = []
    freed = 0
    while freed < num_pages and heap:
        _, name = heapq.heappop(heap)
        order.append(name)
        freed += table[name].num_pages
        parent = table[name].parent
        if parent is not None:
            children[parent] -= 1
            # A parent left without children is a leaf now, and a candidate if unprotected.
            if children[parent] == 0 and parent not in safe:
                heapq.heappush(heap, (table[parent].last_used, parent))
    return order
