"""Hands out the pages of the KV pool, and takes them back.

The allocator knows no tensors and no requests, only the page ids ``0 .. num_pages - 1``.
Allocation is all or nothing, and freeing checks every id before it changes anything, so a
double free is reported where it happens. Chapter 5 tells the story.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisgl.utils.checks import check_int, is_int


class OutOfPagesError(RuntimeError):
    """Raised by :meth:`PageAllocator.alloc` when fewer pages are free than were asked for."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"asked for {requested} KV page(s) but only {free} are free; "
                         "finish or evict requests first (nothing was allocated)")
        self.requested = requested
        self.free = free


class PageAllocator:
    """A free list over the page ids ``0 .. num_pages - 1``.

    Free pages sit on a stack (a list whose end is the top): ``n`` pages cost ``O(n)`` either
    way. A byte per page makes the double-free check ``O(1)`` per page.
    """

    def __init__(self, num_pages: int) -> None:
        check_int("num_pages", num_pages, at_least=1)
        self.num_pages = num_pages  # pages under management, free or not
        # Reversed, so a fresh pool hands out 0, 1, 2, ...: printed page tables read easily.
        self._free_stack: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray([1]) * num_pages

    @property
    def num_free(self) -> int:
        """Pages that :meth:`alloc` can hand out right now."""
        return len(self._free_stack)

    @property
    def num_used(self) -> int:
        """Pages handed out and not yet freed."""
        return self.num_pages - len(self._free_stack)

    def is_free(self, page: int) -> bool:
        """Whether ``page`` (a valid id) is currently free."""
        return bool(self._is_free[page])

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages and return their ids; all ``n`` or, if too few are free, none.

        Raises:
            OutOfPagesError: fewer than ``n`` pages are free. The allocator is unchanged, so the
                caller can free or evict something and try again.
        """
        if not (type(n) is int and n >= 0):  # the hot path: no helper call per step
            raise ValueError(f"alloc: the number of pages must be an integer >= 0, got {n!r}")
        rest = len(self._free_stack) - n  # the free pages left below the n taken
        if rest < 0:
            raise OutOfPagesError(requested=n, free=len(self._free_stack))
        pages = self._free_stack[rest:]
        del self._free_stack[rest:]
        pages.reverse()  # top of the stack first: the most recently freed page is reused first
        for page in pages:
            self._is_free[page] = 0
        return pages

    def free(self, pages: Sequence[int] | torch.Tensor) -> None:
        """Return ``pages`` to the pool; a bad call changes nothing.

        Raises:
            ValueError: an id outside ``0 .. num_pages - 1``, a page that is already free (a
                double free), or the same id twice in ``pages``.
        """
        ids = pages.tolist() if isinstance(pages, torch.Tensor) else list(pages)
        unknown = [p for p in ids if not (is_int(p) and 0 <= p < self.num_pages)]
        if unknown:
            raise ValueError(f"free: page id(s) {unknown[:8]} are not in 0..{self.num_pages - 1}")
        already_free = [p for p in ids if self._is_free[p]]
        if already_free:
            raise ValueError(f"free: page(s) {already_free[:8]} are already free (double free)")
        if len(set(ids)) != len(ids):
            repeated = sorted({p for p in ids if ids.count(p) > 1})
            raise ValueError(f"free: page(s) {repeated[:8]} appear more than once in one call")
        for page in reversed(ids):  # so the next alloc returns them in the order given here
            self._is_free[page] = 1
            self._free_stack.append(page)

