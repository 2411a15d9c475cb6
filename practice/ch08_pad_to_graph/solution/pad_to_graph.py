"""Padding a decode batch to the batch size of a captured CUDA graph.

Reference solution.
"""

from __future__ import annotations

from bisect import bisect_left

import torch


def capture_sizes(max_batch_size: int, step: int = 8) -> list[int]:
    """Powers of two below ``step``, then its multiples up to ``max_batch_size``, and that."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    sizes, small = [], 1
    while small < step and small <= max_batch_size:  # small batches: each its own graph
        sizes.append(small)
        small *= 2
    sizes += range(step, max_batch_size + 1, step)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def choose_graph_size(batch_size: int, captured: list[int]) -> int | None:
    """The smallest captured size >= ``batch_size`` (``captured`` in any order); None if
    there is none."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ordered = sorted(set(captured))  # a hand-written list need not be sorted
    i = bisect_left(ordered, batch_size)
    return ordered[i] if i < len(ordered) else None


def pad_decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor,
                      graph_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode inputs padded to ``graph_size`` entries with token 0 at position 0."""
    num_real = input_ids.shape[0]
    if positions.shape[0] != num_real:
        raise ValueError(f"{num_real} input ids but {positions.shape[0]} positions")
    if graph_size < num_real:
        raise ValueError(f"a batch of {num_real} does not fit a graph of {graph_size}")

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.zeros(graph_size - num_real, dtype=x.dtype, device=x.device)])

    return pad(input_ids), pad(positions)


def padding_overhead(captured: list[int]) -> float:
    """Mean share of padded rows over batch sizes 1 .. max(captured)."""
    largest = max(captured)
    shares = []
    for batch_size in range(1, largest + 1):
        graph_size = choose_graph_size(batch_size, captured)
        assert graph_size is not None
        shares.append((graph_size - batch_size) / graph_size)
    return sum(shares) / len(shares)
