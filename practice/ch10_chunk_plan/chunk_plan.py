"""Chunked prefill: split a queue of prompts into the chunks each prefill step computes.

Write ``plan_chunks``. See README.md for the rules and an example;
`python practice/judge.py ch10_chunk_plan` checks your work.
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
    raise NotImplementedError("plan_chunks: walk the queue, fill each step to the budget, cut "
                              "the prompt that does not fit and carry its rest to the next step")
