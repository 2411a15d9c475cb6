"""The one owner of KV pages and page-table rows: every page a request gets or gives back.

A page moves in the :class:`~minisgl.kvcache.allocator.PageAllocator` and the
:class:`~minisgl.kvcache.page_table.PageTable` at once, or the two disagree and pages leak. So
one object holds both and is the only code that moves pages (``tests/test_page_ownership.py``
fails if anything else allocates or frees a page or a row). It decides nothing about *which*
pages to keep or evict: that is the prefix cache's policy. Chapter 7 tells the story.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisgl.core import Req
from minisgl.kvcache.allocator import OutOfPagesError, PageAllocator
from minisgl.kvcache.page_table import PageTable, pages_for
from minisgl.utils.checks import check_int


class RequestPages:
    """The KV pool's pages and the page table's rows, handed to requests and taken back.

    Args:
        num_pages: pages in the KV pool.
        max_reqs: page-table rows: requests that can hold pages at the same time.
        max_seq_len: the longest sequence (prompt and output) one request may reach.
        page_size: token slots per page.
        device: where the page table lives (the pool's device: attention reads it there).

    Attributes:
        table: the page table, for the attention backends to *read* (slots, page ids); only
            this class changes it.
    """

    def __init__(self, num_pages: int, max_reqs: int, max_seq_len: int, *, page_size: int,
                 device: torch.device | str = "cpu") -> None:
        check_int("max_seq_len", max_seq_len, at_least=1)
        self.max_seq_len = max_seq_len
        self.page_size = page_size
        self._allocator = PageAllocator(num_pages)
        self.table = PageTable(max_reqs, pages_for(max_seq_len, page_size), page_size=page_size,
                               device=device)

    def pages_needed(self, req: Req) -> int:
        """Pages :meth:`reserve` would take for ``req`` now (0 once its row maps all its
        tokens: what a forward pass checks)."""
        return self.table.pages_needed(req.table_row, req.num_tokens)

    def reserve(self, *reqs: Req, ahead: int = 0) -> int:
        """Make the next forward pass of every request in ``reqs`` possible (one request, or a
        whole batch): a row and pages for all its tokens.

        A request without a row gets one; then its row grows to map all ``req.num_tokens``
        tokens, the cached ones and those the next pass writes. All or nothing: if anything is
        missing, nothing changes, not even a row. The pages come from one allocation.
        Chapter 23: a pass launched before the host knows the lengths may feed ``ahead``
        tokens past the end; their pages are taken too (:meth:`shrink` gives back the rest).

        Returns:
            The number of pages allocated.

        Raises:
            ValueError: a request would outgrow ``max_seq_len``.
            OutOfPagesError: too few free pages (the caller may free some and retry).
            RuntimeError: too few page-table rows are free.
        """
        needs: list[int] = []
        for req in reqs:
            num_tokens = req.num_tokens + ahead
            if num_tokens > self.max_seq_len:
                raise ValueError(f"request {req.uid} has {num_tokens} tokens; the longest "
                                 f"sequence this cache holds is max_seq_len={self.max_seq_len}")
            needs.append(self.table.pages_needed(req.table_row, num_tokens))
        total = sum(needs)
        free = self._allocator.num_free
        if total > free:  # before taking a row: nothing to undo
            raise OutOfPagesError(requested=total, free=free)
        new_rows = sum(req.table_row is None for req in reqs)
        if new_rows and new_rows > self.table.num_free_rows:
            raise RuntimeError(f"page table rows are in use: {new_rows} request(s) need one, "
                               f"{self.table.num_free_rows} are free; a request must finish "
                               "before another can start")
        for req in reqs:
            if req.table_row is None:
                self.open_row(req)
        if total:  # most decode steps need none, unless a page holds a single token
            self.table.extend_rows([req.table_row for req in reqs], needs,
                                   self._allocator.alloc(total))
        return total

    def release(self, req: Req) -> int:
        """Give back ``req``'s row and every page it maps; returns how many pages were freed.

        The plain case: a prefix cache that keeps pages uses :meth:`close_row` instead.
        """
        pages = self.close_row(req)
        self._allocator.free(pages)
        return len(pages)

    def shrink(self, req: Req, ahead: int = 0) -> int:
        """Give back the pages of ``req``'s row past its ``num_tokens`` tokens and ``ahead``
        more; returns how many.

        Chapter 23: a verify pass wrote K/V for guesses that were then rejected; the request
        is shorter again, and pages that hold only rejected tokens are freed. Their slots in a
        page it keeps are written over by the tokens that come next. A pass launched before
        this one's verdict was read feeds ``ahead`` tokens past the end: their pages stay.
        """
        keep = pages_for(req.num_tokens + ahead, self.page_size)
        dropped = self.table.truncate_row(req.table_row, min(keep, self.pages_held(req)))
        self._allocator.free(dropped)
        return len(dropped)

    def open_row(self, req: Req, prefix_pages: Sequence[int] = ()) -> int:
        """Give ``req`` a row whose first entries are ``prefix_pages``; returns the row.

        The prefix's pages are not allocated here: a prefix cache holds them (and has locked
        them, so nothing evicts them while ``req`` reads them). With no prefix the row starts
        empty and :meth:`reserve` fills it.

        Raises:
            ValueError: ``req`` holds a row already.
            RuntimeError: every row is in use (nothing has changed).
        """
        if req.table_row is not None:
            raise ValueError(f"request {req.uid} holds row {req.table_row} already")
        row = self.table.alloc_row()
        if prefix_pages:
            self.table.append_pages(row, prefix_pages)
        req.table_row = row
        return row

    def close_row(self, req: Req) -> list[int]:
        """Take ``req``'s row back; returns the pages it mapped, in token order, still in use.

        What becomes of them is the caller's decision: a prefix cache keeps some and gives the
        rest to :meth:`free_pages`.
        """
        if req.table_row is None:
            raise ValueError(f"request {req.uid} holds no page-table row")
        pages = self.table.free_row(req.table_row)
        req.table_row = None
        return pages

    def swap_pages(self, req: Req, first: int, pages: Sequence[int]) -> list[int]:
        """Map ``pages`` in ``req``'s row from entry ``first`` on, in place of the pages there,
        which are returned, still in use (chapter 21: a prefix cache that holds the same
        tokens gives its pages, and the caller frees the request's copies)."""
        row = self.table.page_ids[req.table_row]
        old = row[first:first + len(pages)].tolist()
        if len(old) != len(pages) or first + len(pages) > self.pages_held(req):
            raise ValueError(f"request {req.uid} maps {self.pages_held(req)} pages; entries "
                             f"{first}..{first + len(pages) - 1} are not all among them")
        row[first:first + len(pages)] = pages
        return old

    def free_pages(self, pages: Sequence[int]) -> None:
        """Return pages that no row maps any more (closed rows, evicted cache entries)."""
        self._allocator.free(pages)

    def padding_row(self) -> int:
        """Take a row and one page out of circulation for good; returns the row.

        CUDA graphs (``engine/graph.py``) pad a batch with entries that read and write
        somewhere harmless: the one page of this row, which no request will ever own.
        """
        row = self.table.alloc_row()
        self.table.append_pages(row, self._allocator.alloc(1))
        return row

    # ----------------------------------------------------------------------- counts
    @property
    def num_pages(self) -> int:
        """Pages in the pool, free or not."""
        return self._allocator.num_pages

    @property
    def num_free(self) -> int:
        """Pages free now."""
        return self._allocator.num_free

    @property
    def num_used(self) -> int:
        """Pages mapped by rows, kept by a prefix cache, or set aside."""
        return self._allocator.num_used

    @property
    def num_free_rows(self) -> int:
        """Rows free now: how many more requests could start."""
        return self.table.num_free_rows

    def pages_held(self, req: Req) -> int:
        """Pages ``req``'s row maps (0 without a row)."""
        return 0 if req.table_row is None else self.table.num_pages(req.table_row)
