"""A page allocator and the token-to-slot mapping of a paged KV cache.

Write the four methods of `PageAllocator` and the function `token_slots`. See README.md for the
rules and hints; `python practice/judge.py ch05_page_alloc` checks your work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisgl.kvcache.allocator import OutOfPagesError  # raise this when alloc cannot succeed


class PageAllocator:
    """Hands out the page ids ``0 .. num_pages - 1`` and takes them back."""

    def __init__(self, num_pages: int) -> None:
        """Start with every page free."""
        raise NotImplementedError("PageAllocator.__init__: set up the free pages")

    @property
    def num_free(self) -> int:
        """How many pages ``alloc`` can hand out right now."""
        raise NotImplementedError("PageAllocator.num_free")

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages and return their ids.

        All ``n`` or none: when fewer than ``n`` pages are free, raise
        ``OutOfPagesError(requested=n, free=<pages free>)`` and change nothing.
        ``alloc(0)`` returns ``[]``.
        """
        raise NotImplementedError("PageAllocator.alloc: take n pages, or raise OutOfPagesError")

    def free(self, pages: Sequence[int]) -> None:
        """Give ``pages`` back.

        Raise ``ValueError`` and change nothing when any id is outside ``0 .. num_pages - 1``,
        is already free (a double free), or appears twice in ``pages``.
        """
        raise NotImplementedError("PageAllocator.free: check every id, then return them")


def token_slots(page_ids: torch.Tensor, rows: Sequence[int], starts: Sequence[int],
                ends: Sequence[int], page_size: int) -> torch.Tensor:
    """Pool slots of positions ``starts[i] .. ends[i] - 1`` of the request in row ``rows[i]``.

    Args:
        page_ids: ``[max_reqs, max_pages_per_req]`` int32: entry ``[r, j]`` is the page holding
            tokens ``j * page_size .. j * page_size + page_size - 1`` of row ``r``'s request.
        rows, starts, ends: one entry per request (``0 <= starts[i] <= ends[i]``, and row
            ``rows[i]`` holds enough pages for ``ends[i]`` tokens).
        page_size: tokens per page.

    Returns:
        A 1-D int64 tensor of ``sum(ends[i] - starts[i])`` slots, request after request, each
        request's tokens in position order.
    """
    raise NotImplementedError("token_slots: page_ids[row, pos // page_size] * page_size + ...")
