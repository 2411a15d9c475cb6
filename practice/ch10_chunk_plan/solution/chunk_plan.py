"""Chunked prefill: split a queue of prompts into the chunks each prefill step computes.

The reference solution of `practice/ch10_chunk_plan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Chunk(NamedTuple):
    """Tokens ``[start, end)`` of prompt ``index``, computed in one prefill step.

    ``start`` is how much of the prompt earlier steps computed (the request's ``cached_len``
    when the step begins).
    """

    index: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def plan_chunks(prompt_lens: Sequence[int], budget: int) -> list[list[Chunk]]:
    """The prefill steps that compute the queued prompts, each a list of chunks in batch order.

    Args:
        prompt_lens: the prompts' lengths, in queue order (oldest first); prompt ``i`` is
            ``Chunk.index`` ``i``.
        budget: the most tokens one step computes (``max_prefill_tokens``).

    Raises:
        ValueError: ``budget`` is below 1, or a prompt is empty.
    """
    if budget < 1:
        raise ValueError(f"budget must be at least 1 token per step, got {budget}")
    for index, length in enumerate(prompt_lens):
        if length < 1:
            raise ValueError(f"prompt {index} has {length} tokens; a prompt needs at least one")

    steps: list[list[Chunk]] = []
    step: list[Chunk] = []
    left = budget  # tokens the current step may still compute
    for index, length in enumerate(prompt_lens):
        done = 0  # tokens of this prompt computed so far: its cached_len
        while done < length:
            take = min(length - done, left)  # the whole rest, or the head that fits
            step.append(Chunk(index, done, done + take))
            done += take
            left -= take
            if left == 0:  # the step is full: the next one starts with what is left
                steps.append(step)
                step, left = [], budget
    if step:
        steps.append(step)
    return steps
