"""Admission control: which waiting requests the next prefill batch takes.

Write the two functions. See README.md for the rules and an example;
`python practice/judge.py ch09_admission` checks your work.
"""

from __future__ import annotations

from collections.abc import Sequence

from minisgl.core import Req


def worst_case_pages(prompt_len: int, max_tokens: int, page_size: int) -> int:
    """The most KV pages a request with this prompt and ``max_tokens`` ever holds."""
    raise NotImplementedError("worst_case_pages: the prompt and all outputs but the last, "
                              "in whole pages")


def choose_admissions(waiting: Sequence[Req], *, free_pages: int, free_rows: int,
                      token_budget: int, page_size: int) -> list[int]:
    """The uids of the waiting requests the next prefill batch admits, in queue order.

    Args:
        waiting: the queue, oldest first. Every request is fresh: its whole prompt is to be
            computed.
        free_pages: KV pages not promised to any running request.
        free_rows: free page-table rows.
        token_budget: prompt tokens one prefill step may compute.
        page_size: token slots per page.
    """
    raise NotImplementedError("choose_admissions: walk the queue in order; stop at the first "
                              "request that does not fit")
