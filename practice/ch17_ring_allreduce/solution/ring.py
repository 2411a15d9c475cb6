"""A ring all-reduce over simulated ranks: every rank ends with the sum of every rank's vector.

The reference solution.
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
    base, extra = divmod(length, num_ranks)
    bounds, start = [], 0
    for i in range(num_ranks):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_all_reduce(vectors: Sequence[Sequence[float]]) -> tuple[list[list[float]], list[Send]]:
    """Every rank's final vector (the element-wise sum of ``vectors``) and every send, in order.

    Args:
        vectors: ``vectors[r]`` is rank ``r``'s vector; all have the same length.

    Raises:
        ValueError: no ranks, or vectors of different lengths.
    """
    n = len(vectors)
    if n == 0:
        raise ValueError("an all-reduce needs at least one rank")
    length = len(vectors[0])
    if any(len(v) != length for v in vectors):
        raise ValueError(f"every rank's vector must have {length} numbers, got lengths "
                         f"{[len(v) for v in vectors]}")
    bounds = chunk_bounds(length, n)
    data = [list(v) for v in vectors]
    sends: list[Send] = []
    for step in range(2 * (n - 1)):
        reducing = step < n - 1
        s = step if reducing else step - (n - 1)
        # Rank r sends chunk (r - s) % n while reducing; chunk (r + 1 - s) % n while gathering.
        # All sends of a step leave before any arrives: read every payload first.
        payloads = []
        for src in range(n):
            chunk = (src - s) % n if reducing else (src + 1 - s) % n
            start, end = bounds[chunk]
            payloads.append((src, chunk, data[src][start:end]))
            sends.append(Send(step, src, (src + 1) % n, chunk, end - start))
        for src, chunk, values in payloads:
            dst, (start, _) = (src + 1) % n, bounds[chunk]
            for i, value in enumerate(values):
                data[dst][start + i] = data[dst][start + i] + value if reducing else value
    return data, sends
