"""The page table: which pages of the KV pool hold which request's tokens.

Each running request owns one *row* of a ``[max_reqs, max_pages_per_req]`` table of page ids;
the token at position ``pos`` lives in slot ``page_ids[row, pos // page_size] * page_size +
pos % page_size`` of the pool (:func:`slots_of`). The table lives on the pool's device, where
attention kernels read it, and as a numpy copy on the host, where the scheduler grows and frees
rows without waiting for the device; appended pages reach the device table in one copy at its
next read. Chapter 5 tells the story.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from minisgl.utils.checks import check_int
from minisgl.utils.torch_utils import host_to_device

# An unused entry. It makes printed tables readable; it is never used as an index, because every
# accessor below checks positions against the row's page count first (host_slots excepted: its
# caller has just checked the same rows through gather_host_pages).
NO_PAGE = -1


def slots_of(page_ids: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
             page_size: int) -> torch.Tensor:
    """Pool slot of each token: token ``i`` is at position ``positions[i]`` of row ``rows[i]``.

    Returns int64, the dtype torch indexes with.
    """
    pages = page_ids[rows, positions // page_size].long()
    return pages * page_size + positions % page_size


def expand_ranges(starts: torch.Tensor, counts: torch.Tensor,
                  total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every integer of the ranges ``starts[i] .. starts[i] + counts[i] - 1``, concatenated,
    and for each the index ``i`` of its range.

    Runs on the device of ``starts`` and ``counts``: the host sends two numbers per range, not
    one per token. ``total`` (``counts.sum()``, which the host knows) fixes the output's size,
    so the device never has to report it back.

    >>> expand_ranges(torch.tensor([5, 0]), torch.tensor([3, 2]), total=5)
    (tensor([5, 6, 7, 0, 1]), tensor([0, 0, 0, 1, 1]))
    """
    owner = torch.repeat_interleave(counts, output_size=total)  # i, counts[i] times
    first = torch.cumsum(counts, 0) - counts  # where each range begins in the output
    values = torch.arange(total, device=counts.device) - first[owner] + starts[owner]
    return values, owner


def expand_host_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """:func:`expand_ranges` on the host, in numpy: every integer of the ranges
    ``starts[i] .. starts[i] + counts[i] - 1``, concatenated (int64)."""
    first = np.cumsum(counts) - counts  # where each range begins in the output
    return np.repeat(starts - first, counts) + np.arange(int(counts.sum()))


class PageTable:
    """Rows of page ids, one row per running request, with the rows handed out like pages.

    Args:
        max_reqs: rows, i.e. requests that can run at the same time.
        max_pages_per_req: entries per row; ``max_pages_per_req * page_size`` is the longest
            sequence (prompt and output) one request can reach.
        page_size: token slots per page; must match the pool's.
        device: where the table lives (the pool's device).
    """

    def __init__(self, max_reqs: int, max_pages_per_req: int, *, page_size: int,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("max_reqs", max_reqs), ("max_pages_per_req", max_pages_per_req),
                            ("page_size", page_size)):
            check_int(name, value, at_least=1)
        self.page_size = page_size
        self.max_reqs, self.max_pages_per_req = max_reqs, max_pages_per_req
        self.max_tokens_per_req = max_pages_per_req * page_size  # the longest sequence a row maps
        # int32 is what paged attention kernels take for page ids, and half the size of int64.
        self._page_ids = torch.full((max_reqs, max_pages_per_req), NO_PAGE, dtype=torch.int32,
                                    device=device)
        self.device = self._page_ids.device
        # The same table on the host, and how many pages each row holds (plain ints: read for
        # every request of every step).
        self._host_ids = np.full((max_reqs, max_pages_per_req), NO_PAGE, dtype=np.int32)
        self._held = [0] * max_reqs
        # (row, first entry, count) appended since the device table was last written.
        self._unwritten: list[tuple[int, int, int]] = []
        self._in_use = [False] * max_reqs
        self._free_rows = list(range(max_reqs - 1, -1, -1))  # a stack; row 0 is handed out first

    @property
    def page_ids(self) -> torch.Tensor:
        """The ``[max_reqs, max_pages_per_req]`` device table, every appended page written in."""
        if self._unwritten:
            self._write_appended()
        return self._page_ids

    def _write_appended(self) -> None:
        """Write every page appended since the last call into the device table, all at once.

        One copy the host does not wait for, and one scatter, instead of a copy and a wait per
        request per step. Entries are never written twice between two calls (rows only grow,
        and ``free_row`` writes first), so the scatter has no conflicting duplicates.
        """
        rows, firsts, counts = np.array(self._unwritten, dtype=np.int64).T
        self._unwritten.clear()
        entries = expand_host_ranges(rows * self.max_pages_per_req + firsts, counts)
        packed = np.stack([entries, self._host_ids.reshape(-1)[entries]])  # int64 [2, n]
        packed = host_to_device(torch.from_numpy(packed), self.device)
        self._page_ids.view(-1)[packed[0]] = packed[1].to(torch.int32)

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
        held = self._held[self._checked(row)]
        self._held[row] = 0
        pages = self._host_ids[row, :held].tolist()  # the host copy: the device is never waited for
        if held:
            self._host_ids[row, :held] = NO_PAGE
            self.page_ids[row, :held].fill_(NO_PAGE)
        self._in_use[row] = False
        self._free_rows.append(row)
        return pages

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def num_pages(self, row: int) -> int:
        """Pages ``row`` holds."""
        return self._held[self._checked(row)]

    def capacity(self, row: int) -> int:
        """Tokens ``row`` can map with the pages it holds (the last page may be part empty)."""
        return self.num_pages(row) * self.page_size

    def gather_host_pages(self, rows: np.ndarray, counts: np.ndarray, out: np.ndarray) -> int:
        """The first ``counts[i]`` page ids of row ``rows[i]``, requests concatenated, written
        into ``out`` from the host copy; returns how many were written.

        The host twin of a paged kernel's ``indices`` array: it neither waits for the device
        nor allocates device memory, which is what a CUDA graph's replay needs.

        Raises:
            ValueError: a row holds fewer pages than asked for.
        """
        written = 0
        for row, count in zip(rows.tolist(), counts.tolist()):  # a row's pages are contiguous
            if count > self._held[row]:
                raise ValueError(f"page-table row {row} holds {self._held[row]} pages, too few "
                                 f"for {count}: reserve them first")
            out[written: written + count] = self._host_ids[row, :count]
            written += count
        return written

    def host_slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """:func:`slots_of` on the host copy: the pool slot of position ``positions[i]`` of
        row ``rows[i]``. Unchecked, for the replay's staging: every position must be within the
        pages its row holds, as :meth:`gather_host_pages` has checked for the same rows."""
        pages = self._host_ids[rows, positions // self.page_size].astype(np.int64)
        return pages * self.page_size + positions % self.page_size

    def row_pages(self, row: int) -> torch.Tensor:
        """The page ids ``row`` holds, in token order (a view into the device table)."""
        return self.page_ids[row, : self.num_pages(row)]

    def pages_needed(self, row: int, num_tokens: int) -> int:
        """How many more pages ``row`` needs so that it can map ``num_tokens`` tokens."""
        if num_tokens > self.max_tokens_per_req:
            raise ValueError(f"{num_tokens} tokens exceed the {self.max_tokens_per_req} that one "
                             f"request can hold ({self.max_pages_per_req} pages of "
                             f"{self.page_size} tokens)")
        pages_for_tokens = -(-num_tokens // self.page_size)  # ceiling division
        return max(0, pages_for_tokens - self._held[self._checked(row)])

    def append_pages(self, row: int, pages: Sequence[int] | torch.Tensor) -> None:
        """Add ``pages`` (fresh from the allocator) after the pages ``row`` already holds.

        The ids are not checked again here: the allocator hands out only ids of its pool.
        """
        ids = pages.tolist() if isinstance(pages, torch.Tensor) else list(pages)
        self._extend([row], [len(ids)], ids)

    def extend_rows(self, rows: Sequence[int], counts: Sequence[int],
                    pages: Sequence[int]) -> None:
        """:meth:`append_pages` for several rows at once: row ``rows[i]`` gets the next
        ``counts[i]`` ids of ``pages``, in order, in one numpy write."""
        self._extend(rows, counts, pages)

    def _extend(self, rows: Sequence[int], counts: Sequence[int], pages: Sequence[int]) -> None:
        held = [self._held[self._checked(row)] for row in rows]
        for row, first, count in zip(rows, held, counts):
            if first + count > self.max_pages_per_req:
                raise ValueError(f"row {row} holds {first} pages; {count} more exceed its "
                                 f"{self.max_pages_per_req} entries")
        for row, first, count in zip(rows, held, counts):
            if count:  # the host copy now; the device table at its next read (see page_ids)
                self._held[row] = first + count
                self._unwritten.append((row, first, count))
        starts = np.asarray(rows, dtype=np.int64) * self.max_pages_per_req + held
        entries = expand_host_ranges(starts, np.asarray(counts, dtype=np.int64))
        self._host_ids.reshape(-1)[entries] = pages

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
        size, held = self.page_size, self._held
        for row, start, end in zip(rows, starts, ends):
            if not 0 <= start <= end <= held[self._checked(row)] * size:
                raise ValueError(f"positions {start}..{end} are outside row {row}, which maps "
                                 f"tokens 0..{held[row] * size} ({held[row]} pages): "
                                 "reserve pages for them first")
        if not rows:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        # Three numbers per request cross to the device in one copy; the (row, position) of
        # every token is expanded there.
        counts = [end - start for start, end in zip(starts, ends)]
        spans = torch.tensor([list(rows), list(starts), counts], dtype=torch.int64)
        spans = host_to_device(spans, self.device)
        positions, owner = expand_ranges(spans[1], spans[2], total=sum(counts))
        return slots_of(self.page_ids, spans[0][owner], positions, self.page_size)

    def _checked(self, row: int) -> int:
        """``row``, once it is known to be a row in use."""
        if not 0 <= row < self.max_reqs or not self._in_use[row]:
            raise ValueError(f"row {row} is not a row in use (rows are 0..{self.max_reqs - 1}, "
                             "handed out by alloc_row)")
        return row

    def __repr__(self) -> str:
        return (f"PageTable(max_reqs={self.max_reqs}, max_pages_per_req={self.max_pages_per_req}, "
                f"page_size={self.page_size}, free_rows={self.num_free_rows})")
