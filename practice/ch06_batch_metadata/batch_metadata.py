"""A batch's attention metadata, built from plain lists.

Write `new_token_fields` and `page_arrays`. See README.md for the rules and a worked example;
`python practice/judge.py ch06_batch_metadata` checks your work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Span = tuple[int, int, int]  # (page-table row, cached tokens, new tokens) of one request


def new_token_fields(spans: Sequence[Span], page_rows: Mapping[int, Sequence[int]],
                     page_size: int) -> dict[str, list[int]]:
    """Where this pass's new tokens sit.

    Args:
        spans: the batch's requests, in the order their new tokens are packed.
        page_rows: each page-table row's page ids, in position order.
        page_size: tokens per page.

    Returns:
        ``{"positions": [...], "out_loc": [...], "last_indices": [...]}``.

    Raises:
        ValueError: a request's row does not hold pages for all of its tokens.
    """
    raise NotImplementedError("new_token_fields: one position and one slot per new token")


def page_arrays(spans: Sequence[Span], page_rows: Mapping[int, Sequence[int]],
                page_size: int) -> dict[str, list[int]]:
    """Where each request's keys are, as FlashInfer reads them.

    Returns:
        ``{"qo_indptr": [...], "page_indptr": [...], "page_indices": [...],
        "last_page_len": [...]}``.

    Raises:
        ValueError: a request's row does not hold pages for all of its tokens.
    """
    raise NotImplementedError("page_arrays: indptr over new tokens and over pages, the pages "
                              "themselves, and how full each last page is")
