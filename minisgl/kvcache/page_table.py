"""The page table: which pages of the KV pool hold which request's tokens.

Each running request owns one *row* of a ``[max_reqs, max_pages_per_req]`` table of page ids;
the token at position ``pos`` lives in slot ``page_ids[row, pos // page_size] * page_size +
pos % page_size`` of the pool (:func:`slots_of`). The table is a numpy array on the host: the
scheduler grows and frees rows without touching the device, and a step sends the device only
what its kernels read (the new tokens' slots, the pages of each request), computed here.
Chapter 5 tells the story.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

from minisgl.utils.checks import check_int
from minisgl.utils.torch_utils import host_to_device

Count = TypeVar("Count", int, np.ndarray)  # one request's count, or one per request

# An unused entry. It makes printed tables readable; it is never used as an index, because every
# accessor below checks positions against the row's page count first.
NO_PAGE = -1


def pages_for(num_tokens: Count, page_size: int) -> Count:
    """Pages that ``num_tokens`` tokens occupy (the last one may be partly filled)."""
    return -(-num_tokens // page_size)  # ceiling division


def slots_of(page_ids: np.ndarray, rows: np.ndarray, positions: np.ndarray,
             page_size: int) -> np.ndarray:
    """Pool slot of each token: token ``i`` is at position ``positions[i]`` of row ``rows[i]``.

    Returns int64, the dtype torch indexes with.
    """
    pages = page_ids[rows, positions // page_size].astype(np.int64)
    return pages * page_size + positions % page_size


def expand_ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every integer of the ranges ``starts[i] .. starts[i] + counts[i] - 1``, concatenated,
    and for each the index ``i`` of its range: a few array operations, however many ranges.

    >>> expand_ranges(np.array([5, 0]), np.array([3, 2]))
    (array([5, 6, 7, 0, 1]), array([0, 0, 0, 1, 1]))
    """
    owner = np.repeat(np.arange(len(counts)), counts)  # i, counts[i] times
    first = np.cumsum(counts) - counts  # where each range begins in the output
    return np.arange(len(owner)) - first[owner] + starts[owner], owner


class PageTable:
    """Rows of page ids, one row per running request, with the rows handed out like pages.

    Args:
        max_reqs: rows, i.e. requests that can run at the same time.
        max_pages_per_req: entries per row; ``max_pages_per_req * page_size`` is the longest
            sequence (prompt and output) one request can reach.
        page_size: token slots per page; must match the pool's.
        device: where the slots and page ids it hands the kernels go (the pool's device).
    """

    def __init__(self, max_reqs: int, max_pages_per_req: int, *, page_size: int,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("max_reqs", max_reqs), ("max_pages_per_req", max_pages_per_req),
                            ("page_size", page_size)):
            check_int(name, value, at_least=1)
        self.page_size = page_size
        self.max_reqs, self.max_pages_per_req = max_reqs, max_pages_per_req
        self.max_tokens_per_req = max_pages_per_req * page_size  # the longest sequence a row maps
        self.device = torch.empty(0, device=device).device  # "cuda" named as "cuda:0", say
        # int32 is what paged attention kernels take for page ids, and half the size of int64.
        self.page_ids = np.full((max_reqs, max_pages_per_req), NO_PAGE, dtype=np.int32)
        self._held = [0] * max_reqs  # pages each row holds (plain ints: read for every request)
        self._in_use = [False] * max_reqs
        self._free_rows = list(range(max_reqs - 1, -1, -1))  # a stack; row 0 is handed out first

    def alloc_row(self) -> int:
        """Give a new request an empty row; returns its index (the request's ``table_row``)."""
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
        held = self._held[self._checked(row)]
        pages = self.page_ids[row, :held].tolist()
        self.page_ids[row, :held] = NO_PAGE
        self._held[row] = 0
        self._in_use[row] = False
        self._free_rows.append(row)
        return pages

    def truncate_row(self, row: int, num_pages: int) -> list[int]:
        """Keep only the first ``num_pages`` pages of ``row``; returns the pages dropped, in
        order, still in use (chapter 23: the pages of rejected guesses go back).

        As with :meth:`free_row`, giving them back is the caller's decision.
        """
        held = self._held[self._checked(row)]
        if not 0 <= num_pages <= held:
            raise ValueError(f"row {row} holds {held} pages; it cannot keep {num_pages}")
        dropped = self.page_ids[row, num_pages:held].tolist()
        self.page_ids[row, num_pages:held] = NO_PAGE
        self._held[row] = num_pages
        return dropped

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def num_pages(self, row: int) -> int:
        """Pages ``row`` holds."""
        return self._held[self._checked(row)]

    def row_pages(self, row: int) -> np.ndarray:
        """The page ids ``row`` holds, in token order (a view into the table)."""
        return self.page_ids[row, : self.num_pages(row)]

    def pages_needed(self, row: int | None, num_tokens: int) -> int:
        """How many more pages ``row`` needs so that it can map ``num_tokens`` tokens (``None``:
        a request without a row yet, which holds no page)."""
        if num_tokens > self.max_tokens_per_req:
            raise ValueError(f"{num_tokens} tokens exceed the {self.max_tokens_per_req} that one "
                             f"request can hold ({self.max_pages_per_req} pages of "
                             f"{self.page_size} tokens)")
        held = 0 if row is None else self._held[self._checked(row)]
        return max(0, pages_for(num_tokens, self.page_size) - held)

    def append_pages(self, row: int, pages: Sequence[int] | torch.Tensor) -> None:
        """Add ``pages`` (fresh from the allocator) after the pages ``row`` already holds.

        The ids are not checked again here: the allocator hands out only ids of its pool.
        """
        ids = pages.tolist() if isinstance(pages, torch.Tensor) else list(pages)
        self.extend_rows([row], [len(ids)], ids)

    def extend_rows(self, rows: Sequence[int], counts: Sequence[int],
                    pages: Sequence[int]) -> None:
        """:meth:`append_pages` for several rows at once: row ``rows[i]`` gets the next
        ``counts[i]`` ids of ``pages``, in order, in one numpy write."""
        held = [self._held[self._checked(row)] for row in rows]
        for row, first, count in zip(rows, held, counts):
            if first + count > self.max_pages_per_req:
                raise ValueError(f"row {row} holds {first} pages; {count} more exceed its "
                                 f"{self.max_pages_per_req} entries")
        for row, first, count in zip(rows, held, counts):
            self._held[row] = first + count
        starts = np.asarray(rows, dtype=np.int64) * self.max_pages_per_req + held
        entries, _ = expand_ranges(starts, np.asarray(counts, dtype=np.int64))
        self.page_ids.reshape(-1)[entries] = pages

    def locate(self, rows: Sequence[int], starts: Sequence[int],
               ends: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The positions ``starts[i] .. ends[i] - 1`` of ``rows[i]``, requests concatenated,
        and the pool slot of each (both int64, on the host).

        With ``starts`` at each request's cached length and ``ends`` at its new length, the
        slots are where a forward pass stores the new tokens' K/V; with ``starts`` at 0, the
        slots attention reads the whole sequence back from.
        """
        size, held = self.page_size, self._held
        for row, start, end in zip(rows, starts, ends):
            if not 0 <= start <= end <= held[self._checked(row)] * size:
                raise ValueError(f"positions {start}..{end} are outside row {row}, which maps "
                                 f"tokens 0..{held[row] * size} ({held[row]} pages): "
                                 "reserve pages for them first")
        starts = np.asarray(starts, dtype=np.int64)
        positions, owner = expand_ranges(starts, np.asarray(ends, dtype=np.int64) - starts)
        rows = np.asarray(rows, dtype=np.int64)[owner]
        return positions, slots_of(self.page_ids, rows, positions, size)

    def token_slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """Pool slots of the tokens at positions ``start .. end - 1`` of ``row``'s request."""
        return self.batch_token_slots([row], [start], [end])

    def batch_token_slots(self, rows: Sequence[int], starts: Sequence[int],
                          ends: Sequence[int]) -> torch.Tensor:
        """:meth:`locate`'s slots, on the device."""
        _, slots = self.locate(rows, starts, ends)
        return host_to_device(torch.from_numpy(slots), self.device)

    def _checked(self, row: int) -> int:
        """``row``, once it is known to be a row in use."""
        if not 0 <= row < self.max_reqs or not self._in_use[row]:
            raise ValueError(f"row {row} is not a row in use (rows are 0..{self.max_reqs - 1}, "
                             "handed out by alloc_row)")
        return row
