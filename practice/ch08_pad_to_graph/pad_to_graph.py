"""Padding a decode batch to the batch size of a captured CUDA graph.

Write the four functions. See README.md for the rules;
`python practice/judge.py ch08_pad_to_graph` checks your work.
"""

from __future__ import annotations

import torch


def capture_sizes(max_batch_size: int, step: int = 8) -> list[int]:
    """Powers of two below ``step``, then its multiples up to ``max_batch_size``, and that."""
    raise NotImplementedError("capture_sizes: powers of two below step, then multiples of step")


def choose_graph_size(batch_size: int, captured: list[int]) -> int | None:
    """The smallest captured size >= ``batch_size`` (``captured`` in any order); None if
    there is none."""
    raise NotImplementedError("choose_graph_size: the smallest captured size that holds the batch")


def pad_decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor,
                      graph_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode inputs padded to ``graph_size`` entries with token 0 at position 0."""
    raise NotImplementedError("pad_decode_inputs: the real entries, then zeros")


def padding_overhead(captured: list[int]) -> float:
    """Mean share of padded rows over batch sizes 1 .. max(captured)."""
    raise NotImplementedError("padding_overhead: average (graph_size - B) / graph_size")
