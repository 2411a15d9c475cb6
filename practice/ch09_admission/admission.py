"""Admission control with bounded overtaking: which waiting requests the next prefill batch takes.

Write choose_admissions. See README.md for the rules and an example;
`python practice/judge.py ch09_admission` checks your work.
"""

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
    """The uids of the waiting requests the next prefill batch admits, in queue order.

    Args:
        waiting: the queue, oldest first. Every request is fresh: its whole prompt is to be
            computed.
        free_pages: KV pages not promised to any running request.
        free_rows: free page-table rows.
        token_budget: prompt tokens one prefill step may compute.
        page_size: token slots per page.
        overtaken: uid -> how many batches so far admitted a request from behind it. Update it
            in place (README.md says how).
        max_overtakes: how many times a request may be overtaken before nobody may go first.
    """
    raise NotImplementedError("choose_admissions: walk the queue in order; decide for each "
                              "request whether it goes in, waits, or holds the others back")
