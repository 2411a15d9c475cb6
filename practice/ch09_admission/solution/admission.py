"""Admission control with bounded overtaking: which waiting requests the next prefill batch
takes (reference solution)."""

from __future__ import annotations

from collections.abc import Sequence

from minisgl.core import Req


def worst_case_pages(prompt_len: int, max_tokens: int, page_size: int) -> int:
    """The most KV pages a request with this prompt and ``max_tokens`` ever holds (chapter 9's
    rule: the prompt and every output but the last, in whole pages)."""
    tokens = prompt_len + max_tokens - 1
    return -(-tokens // page_size)  # ceiling division


def choose_admissions(waiting: Sequence[Req], *, free_pages: int, free_rows: int,
                      token_budget: int, page_size: int, overtaken: dict[int, int],
                      max_overtakes: int) -> list[int]:
    """The uids of the waiting requests the next prefill batch admits, in queue order; updates
    ``overtaken`` (uid -> times a later request went first)."""
    admitted: list[int] = []
    passed: list[int] = []  # requests that did not fit, in queue order
    for req in waiting:
        prompt_len = len(req.prompt_ids)
        pages = worst_case_pages(prompt_len, req.params.max_tokens, page_size)
        fits = (free_rows >= 1 and pages <= free_pages
                and (not admitted or prompt_len <= token_budget))
        if not fits:
            if overtaken.get(req.uid, 0) >= max_overtakes:
                break  # it has waited long enough: nobody behind it goes first any more
            passed.append(req.uid)
            continue
        admitted.append(req.uid)
        overtaken.pop(req.uid, None)
        free_rows -= 1
        free_pages -= pages
        token_budget -= prompt_len
    # Count one overtaking per batch for each request that a later admission went ahead of.
    if admitted:
        position = {req.uid: i for i, req in enumerate(waiting)}
        last = position[admitted[-1]]
        for uid in passed:
            if position[uid] < last:
                overtaken[uid] = overtaken.get(uid, 0) + 1
    return admitted
