"""Admission control: which waiting requests the next prefill batch takes (reference solution)."""

from __future__ import annotations

from collections.abc import Sequence

from minisgl.core import Req


def worst_case_pages(prompt_len: int, max_tokens: int, page_size: int) -> int:
    """The most KV pages a request with this prompt and ``max_tokens`` ever holds."""
    # The last sampled token is returned, never fed back: it needs no slot.
    tokens = prompt_len + max_tokens - 1
    return -(-tokens // page_size)  # ceiling division


def choose_admissions(waiting: Sequence[Req], *, free_pages: int, free_rows: int,
                      token_budget: int, page_size: int) -> list[int]:
    """The uids of the waiting requests the next prefill batch admits, in queue order."""
    admitted: list[int] = []
    for req in waiting:
        prompt_len = len(req.prompt_ids)
        pages = worst_case_pages(prompt_len, req.params.max_tokens, page_size)
        if free_rows < 1 or pages > free_pages:
            break  # hard limits: a running request must never find the pool empty
        if admitted and prompt_len > token_budget:
            break  # the budget shapes the batch; its first request is always taken
        admitted.append(req.uid)
        free_rows -= 1
        free_pages -= pages
        token_budget -= prompt_len
    return admitted
