"""The page table: which pages of the KV pool hold which request's tokens.

Each running request owns one *row* of a ``[max_reqs, max_pages_per_req]`` table of page ids.
Entry ``j`` of a row is the page that holds the request's tokens ``j * page_size`` to
``j * page_size + page_size - 1``. A token at position ``pos`` therefore lives in slot

    page_ids[row, pos // page_size] * page_size + pos % page_size

of the pool: the page it falls in, then the offset inside that page. The pages of one request
can be anywhere in the pool and in any order; only the row remembers their sequence. That
indirection is the whole trick of paged attention, and :func:`slots_of` is the one line that
resolves it.

The table lives on the same device as the pool, because attention kernels read it there. The
counts of how many pages each row holds live on the host: the scheduler decides allocations
there, and checking a range against them costs no device synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# An unused entry. It makes printed tables readable; it is never used as an index, because every
# accessor below checks positions against the row's page count first.
NO_PAGE = -1


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


# --8<-- [start:token_slots]
def slots_of(page_ids: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
             page_size: int) -> torch.Tensor:
    """Pool slot of each token: token ``i`` is at position ``positions[i]`` of row ``rows[i]``.

    Two integer operations and one lookup, for all tokens of a batch at once: which page of
    the row (``pos // page_size``), which page of the pool that is (the lookup), and where in
    that page (``pos % page_size``). Returns int64, the dtype torch indexes with.
    """
    pages = page_ids[rows, positions // page_size].long()
    return pages * page_size + positions % page_size
# --8<-- [end:token_slots]


class PageTable:
    """Rows of page ids, one row per running request, with the rows handed out like pages.

    Args:
        max_reqs: rows, i.e. requests that can run at the same time.
        max_pages_per_req: entries per row; ``max_pages_per_req * page_size`` is the longest
            sequence (prompt and output) one request can reach.
        page_size: token slots per page; must match the pool's.
        device: where the table lives (the pool's device).
    """

    # --8<-- [start:page_table]
    def __init__(self, max_reqs: int, max_pages_per_req: int, *, page_size: int,
                 device: torch.device | str = "cpu") -> None:
        _check_positive(max_reqs=max_reqs, max_pages_per_req=max_pages_per_req,
                        page_size=page_size)
        self.page_size = page_size
        # int32 is what paged attention kernels take for page ids, and half the size of int64.
        self.page_ids = torch.full((max_reqs, max_pages_per_req), NO_PAGE, dtype=torch.int32,
                                   device=device)
        self._num_pages = [0] * max_reqs  # pages held by each row, on the host
        self._in_use = [False] * max_reqs
        self._free_rows = list(range(max_reqs - 1, -1, -1))  # a stack; row 0 is handed out first

    def alloc_row(self) -> int:
        """Give a new request an empty row; returns its index (the request's ``table_idx``)."""
        if not self._free_rows:
            raise RuntimeError(f"all {self.max_reqs} page table rows are in use; "
                               "a request must finish before another can start")
        row = self._free_rows.pop()
        self._in_use[row] = True
        return row

    def free_row(self, row: int) -> list[int]:
        """Release ``row`` for the next request; returns the page ids it held, in order.

        The table only forgets the pages: giving them back to the allocator (or to a prefix
        cache that keeps them) is the caller's decision.
        """
        self._check_row(row)
        pages = self.row_pages(row).tolist()
        self.page_ids[row].fill_(NO_PAGE)
        self._num_pages[row] = 0
        self._in_use[row] = False
        self._free_rows.append(row)
        return pages
    # --8<-- [end:page_table]

    @property
    def max_reqs(self) -> int:
        return self.page_ids.shape[0]

    @property
    def max_pages_per_req(self) -> int:
        return self.page_ids.shape[1]

    @property
    def max_tokens_per_req(self) -> int:
        """The longest sequence a row can map."""
        return self.max_pages_per_req * self.page_size

    @property
    def device(self) -> torch.device:
        return self.page_ids.device

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def num_pages(self, row: int) -> int:
        """Pages ``row`` holds."""
        self._check_row(row)
        return self._num_pages[row]

    def capacity(self, row: int) -> int:
        """Tokens ``row`` can map with the pages it holds (the last page may be part empty)."""
        return self.num_pages(row) * self.page_size

    def row_pages(self, row: int) -> torch.Tensor:
        """The page ids ``row`` holds, in token order (a view into the table)."""
        return self.page_ids[row, : self.num_pages(row)]

    # --8<-- [start:grow_row]
    def pages_needed(self, row: int, num_tokens: int) -> int:
        """How many more pages ``row`` needs so that it can map ``num_tokens`` tokens.

        Pages are only ever added when a token spills past the last one: with 16-token pages,
        a request decoding one token at a time asks for a page every 16 steps.
        """
        if num_tokens > self.max_tokens_per_req:
            raise ValueError(f"{num_tokens} tokens exceed the {self.max_tokens_per_req} that one "
                             f"request can hold ({self.max_pages_per_req} pages of "
                             f"{self.page_size} tokens)")
        pages_for_tokens = -(-num_tokens // self.page_size)  # ceiling division
        return max(0, pages_for_tokens - self.num_pages(row))

    def append_pages(self, row: int, pages: Sequence[int] | torch.Tensor) -> None:
        """Add ``pages`` (fresh from the allocator) after the pages ``row`` already holds."""
        ids = pages.tolist() if isinstance(pages, torch.Tensor) else list(pages)
        held = self.num_pages(row)
        if held + len(ids) > self.max_pages_per_req:
            raise ValueError(f"row {row} holds {held} pages; {len(ids)} more exceed its "
                             f"{self.max_pages_per_req} entries")
        if any(p < 0 for p in ids):
            raise ValueError(f"page ids must be non-negative, got {ids}")
        self.page_ids[row, held : held + len(ids)] = torch.tensor(ids, dtype=torch.int32)
        self._num_pages[row] = held + len(ids)
    # --8<-- [end:grow_row]

    # --8<-- [start:batch_token_slots]
    def token_slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """Pool slots of the tokens at positions ``start .. end - 1`` of ``row``'s request."""
        return self.batch_token_slots([row], [start], [end])

    def batch_token_slots(self, rows: Sequence[int], starts: Sequence[int],
                          ends: Sequence[int]) -> torch.Tensor:
        """Slots of positions ``starts[i] .. ends[i] - 1`` of ``rows[i]``, requests concatenated.

        With ``starts`` at each request's cached length and ``ends`` at its new length, these
        are the slots where a forward pass stores the new tokens' K/V; with ``starts`` at 0,
        the slots attention reads the whole sequence back from.
        """
        if not len(rows) == len(starts) == len(ends):
            raise ValueError(f"rows, starts and ends must have one entry per request, got "
                             f"{len(rows)}, {len(starts)} and {len(ends)}")
        for row, start, end in zip(rows, starts, ends):
            if not 0 <= start <= end <= self.capacity(row):
                raise ValueError(f"positions {start}..{end} are outside row {row}, which maps "
                                 f"tokens 0..{self.capacity(row)} ({self.num_pages(row)} pages)")
        if not rows:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        # The (row, position) of every token, built on the host one request at a time (a
        # batch has far fewer requests than tokens), then sent to the table's device at once.
        token_rows = torch.cat([torch.full((end - start,), row, dtype=torch.int64)
                                for row, start, end in zip(rows, starts, ends)])
        positions = torch.cat([torch.arange(start, end, dtype=torch.int64)
                               for start, end in zip(starts, ends)])
        return slots_of(self.page_ids, token_rows.to(self.device), positions.to(self.device),
                        self.page_size)
    # --8<-- [end:batch_token_slots]

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_reqs or not self._in_use[row]:
            raise ValueError(f"row {row} is not a row in use (rows are 0..{self.max_reqs - 1}, "
                             "handed out by alloc_row)")

    def __repr__(self) -> str:
        return (f"PageTable(max_reqs={self.max_reqs}, max_pages_per_req={self.max_pages_per_req}, "
                f"page_size={self.page_size}, free_rows={self.num_free_rows})")
