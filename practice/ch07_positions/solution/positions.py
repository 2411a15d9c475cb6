"""The model inputs of a ragged batch: packed token ids, positions and last-token indices.

Reference solution.
"""

from __future__ import annotations

import torch


def _check(cached_lens: list[int], new_lens: list[int]) -> None:
    if len(cached_lens) != len(new_lens):
        raise ValueError(f"cached_lens and new_lens must have one entry per request, got "
                         f"{len(cached_lens)} and {len(new_lens)}")
    if any(n < 1 for n in new_lens):
        raise ValueError(f"every request brings at least one new token, got {new_lens}")


def pack_input_ids(token_ids: list[list[int]], cached_lens: list[int]) -> torch.Tensor:
    """The new tokens of every request, packed in batch order: ``[T]`` int64."""
    if len(token_ids) != len(cached_lens):
        raise ValueError(f"token_ids and cached_lens must have one entry per request, got "
                         f"{len(token_ids)} and {len(cached_lens)}")
    _check(cached_lens, [len(ids) - cached for ids, cached in zip(token_ids, cached_lens)])
    return torch.tensor([t for ids, cached in zip(token_ids, cached_lens) for t in ids[cached:]],
                        dtype=torch.int64)


def build_positions(cached_lens: list[int], new_lens: list[int]) -> torch.Tensor:
    """The position of every new token in its own sequence: ``[T]`` int64."""
    _check(cached_lens, new_lens)
    return torch.cat([torch.arange(cached, cached + new, dtype=torch.int64)
                      for cached, new in zip(cached_lens, new_lens)])


def build_last_indices(new_lens: list[int]) -> torch.Tensor:
    """For each request, the index of its last new token in the packed input: ``[B]`` int64."""
    _check([0] * len(new_lens), new_lens)
    return torch.cumsum(torch.tensor(new_lens, dtype=torch.int64), dim=0) - 1
