"""A page allocator and the token-to-slot mapping of a paged KV cache (reference solution)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisgl.kvcache.allocator import OutOfPagesError  # raise this when alloc cannot succeed


class PageAllocator:
    """Hands out the page ids ``0 .. num_pages - 1`` and takes them back."""

    def __init__(self, num_pages: int) -> None:
        """Start with every page free."""
        self.num_pages = num_pages
        self.free_pages = list(range(num_pages))  # a stack: the end of the list is its top
        self.is_free = [True] * num_pages  # answers "is page p free?" without a search

    @property
    def num_free(self) -> int:
        """How many pages ``alloc`` can hand out right now."""
        return len(self.free_pages)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages and return their ids (all ``n``, or none)."""
        if n > len(self.free_pages):
            raise OutOfPagesError(requested=n, free=len(self.free_pages))
        if n == 0:
            return []
        pages = self.free_pages[-n:]
        del self.free_pages[-n:]
        for page in pages:
            self.is_free[page] = False
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Give ``pages`` back; every id is checked before anything changes."""
        pages = list(pages)
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page {page} is not in 0..{self.num_pages - 1}")
            if self.is_free[page]:
                raise ValueError(f"page {page} is already free (double free)")
        if len(set(pages)) != len(pages):
            raise ValueError(f"a page appears twice in {pages}")
        for page in pages:
            self.is_free[page] = True
            self.free_pages.append(page)


def token_slots(page_ids: torch.Tensor, rows: Sequence[int], starts: Sequence[int],
                ends: Sequence[int], page_size: int) -> torch.Tensor:
    """Pool slots of positions ``starts[i] .. ends[i] - 1`` of the request in row ``rows[i]``."""
    if len(rows) == 0:
        return torch.empty(0, dtype=torch.int64, device=page_ids.device)
    # One (row, position) pair per token; the lookup below then handles every token at once.
    token_rows = torch.cat([torch.full((end - start,), row, dtype=torch.int64)
                            for row, start, end in zip(rows, starts, ends)])
    positions = torch.cat([torch.arange(start, end, dtype=torch.int64)
                           for start, end in zip(starts, ends)])
    pages = page_ids[token_rows, positions // page_size].long()
    return pages * page_size + positions % page_size
