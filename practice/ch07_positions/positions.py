"""The model inputs of a ragged batch: packed token ids, positions and last-token indices.

Write the three functions. See README.md for the rules and an example;
`python practice/judge.py ch07_positions` checks your work.
"""

from __future__ import annotations

import torch


def pack_input_ids(token_ids: list[list[int]], cached_lens: list[int]) -> torch.Tensor:
    """The new tokens of every request, packed in batch order: ``[T]`` int64.

    Args:
        token_ids: each request's whole sequence so far.
        cached_lens: how many leading tokens of each request are already in the KV pool.
    """
    raise NotImplementedError("pack_input_ids: concatenate token_ids[i][cached_lens[i]:]")


def build_positions(cached_lens: list[int], new_lens: list[int]) -> torch.Tensor:
    """The position of every new token in its own sequence: ``[T]`` int64."""
    raise NotImplementedError("build_positions: request i's new tokens start at cached_lens[i]")


def build_last_indices(new_lens: list[int]) -> torch.Tensor:
    """For each request, the index of its last new token in the packed input: ``[B]`` int64."""
    raise NotImplementedError("build_last_indices: a running total of new_lens, minus one")
