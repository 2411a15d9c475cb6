"""A ring all-reduce over simulated ranks: every rank ends with the sum of every rank's vector.

Write ``chunk_bounds`` and ``ring_all_reduce``. See README.md for the rules and an example;
`python practice/judge.py ch17_ring_allreduce` checks your work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Send(NamedTuple):
    """In step ``step``, rank ``src`` sends chunk ``chunk`` (``length`` numbers) to ``dst``."""

    step: int
    src: int
    dst: int
    chunk: int
    length: int


def chunk_bounds(length: int, num_ranks: int) -> list[tuple[int, int]]:
    """Split ``range(length)`` into ``num_ranks`` contiguous chunks ``[start, end)``, in order,
    the first ``length % num_ranks`` of them one longer than the others."""
    raise NotImplementedError("chunk_bounds: num_ranks chunks of length // num_ranks, "
                              "the first length % num_ranks of them one longer")


def ring_all_reduce(vectors: Sequence[Sequence[float]]) -> tuple[list[list[float]], list[Send]]:
    """Every rank's final vector (the element-wise sum of ``vectors``) and every send, in order.

    Args:
        vectors: ``vectors[r]`` is rank ``r``'s vector; all have the same length.

    Raises:
        ValueError: no ranks, or vectors of different lengths.
    """
    raise NotImplementedError("ring_all_reduce: n-1 reduce-scatter steps, then n-1 all-gather "
                              "steps; in each, every rank sends one chunk to rank (r + 1) % n")
