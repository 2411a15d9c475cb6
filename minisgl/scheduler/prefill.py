"""The waiting queue, and the choice of which waiting requests the next prefill batch takes.

A request that arrives waits here until the scheduler can *admit* it: give it a page-table row
and promise it every KV page it could ever need. Admission happens when a prefill batch is
formed, first come, first served, under three limits that a :class:`PrefillBudget` tracks:

- **rows**: a page-table row per running request (``max_running_reqs`` in all);
- **pages**: the request's worst case (prompt plus ``max_tokens``, see
  :func:`~minisgl.scheduler.utils.lifetime_pages`) must fit in the pages not yet promised to
  the requests already running;
- **tokens**: the batch's prompt tokens must fit the per-step budget ``max_prefill_tokens``,
  except for the batch's first request, which is always taken (a longer prompt would otherwise
  wait forever; chunked prefill cuts it into chunks instead).

With chunked prefill (``chunking.py``) the token budget is a hard limit: the request
that does not fit whole computes the *chunk* of its prompt that does, and stays at the head of
the queue, holding its row and pages, until a later batch has computed the rest.

The queue stops at the first request that does not fit. A later, smaller request could have
fitted, but letting it jump the queue again and again would starve the large one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from minisgl.core import Batch, Req
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.utils import lifetime_pages


@dataclass
class PrefillBudget:
    """What the prefill batch being formed may still take.

    Attributes:
        tokens: prompt tokens it may still compute (starts at ``max_prefill_tokens``).
        pages: KV pages not yet promised to any request (free ones, plus those the prefix
            cache could evict, minus what running requests may still need).
        rows: free page-table rows.
    """

    tokens: int
    pages: int
    rows: int

    def admits(self, new_tokens: int, pages: int, is_first: bool) -> bool:
        """Whether a request that computes ``new_tokens`` and needs ``pages`` fits.

        Rows and pages are hard limits: break them and a running request would one day find
        no page to write to. The token budget only shapes the batch, so the first request of a
        batch may go over it.
        """
        if self.rows < 1 or pages > self.pages:
            return False
        return is_first or new_tokens <= self.tokens

    def take(self, new_tokens: int, pages: int) -> None:
        """Account for a request just admitted."""
        self.tokens -= new_tokens
        self.pages -= pages
        self.rows -= 1

    def chunk(self, new_tokens: int) -> int:
        """How many of a request's ``new_tokens`` uncomputed tokens this step computes.

        All of them: this budget never cuts a prompt.
        :class:`~minisgl.scheduler.chunking.ChunkedPrefillBudget` cuts it to the tokens left.
        """
        return new_tokens

    def resume(self, req: Req) -> int:
        """Spend the tokens of the next chunk of ``req``, whose prompt an earlier batch cut.

        Its row and pages were accounted for when it was admitted: only tokens are spent.
        Returns the chunk's length.
        """
        chunk = self.chunk(req.new_len)
        self.tokens -= chunk
        return chunk


class PrefillManager:
    """The queue of waiting requests, and the prefill batches formed from it.

    Args:
        cache: where admitted requests get their row and pages.
    """

    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        self.waiting: deque[Req] = deque()

    def add(self, req: Req) -> None:
        """Queue a new request behind those already waiting."""
        self.waiting.append(req)

    def remove(self, uid: int) -> Req | None:
        """Take request ``uid`` out of the queue (it was aborted); None if it is not waiting."""
        for req in self.waiting:
            if req.uid == uid:
                self.waiting.remove(req)
                return req
        return None

    @property
    def runnable(self) -> bool:
        """Whether any request is waiting (it may still not fit this step)."""
        return bool(self.waiting)

    def schedule(self, budget: PrefillBudget) -> Batch | None:
        """Admit waiting requests in arrival order while they fit ``budget``; None if none fits.

        Admitted requests leave the queue holding a page-table row (and any cached prefix);
        the scheduler reserves their pages before the batch runs. A request whose prompt the
        budget cuts is the batch's last; it stays at the head of the queue, and
        the batch's ``chunk_lens`` say how much of each prompt runs now.
        """
        admitted: list[Req] = []
        chunk_lens: list[int] = []
        while self.waiting:
            req = self.waiting[0]
            chunk = self._try_admit(req, budget, is_first=not admitted)
            if chunk == 0:
                break
            admitted.append(req)
            chunk_lens.append(chunk)
            if chunk < req.new_len:  # cut: the rest of its prompt goes first in the next batch
                break
            self.waiting.popleft()
        if not admitted:
            return None
        is_cut = chunk_lens[-1] < admitted[-1].new_len
        return Batch(admitted, "prefill", chunk_lens=chunk_lens if is_cut else None)

    def _try_admit(self, req: Req, budget: PrefillBudget, is_first: bool) -> int:
        """Take ``req`` into the batch if it fits; the tokens it computes now, 0 if it does not."""
        if req.table_row is not None:  # cut by an earlier batch: its row and pages are its own
            assert is_first, f"request {req.uid} holds a row but is not at the head of the queue"
            return budget.resume(req)
        match = self.cache.match(req)  # always empty with the naive cache
        # Lock the match straight away. Its pages that were evictable counted in
        # the budget as room for anyone; now they are this request's, so they are charged.
        drop = self.cache.lock(match)
        new_tokens = req.num_tokens - match.num_tokens
        # A matched prefix's pages are the cache's already: the request needs only the rest.
        pages = lifetime_pages(req, self.cache.page_size) - len(match.pages) + drop
        if not budget.admits(new_tokens, pages, is_first):
            self.cache.unlock(match)
            return 0
        self.cache.admit(req, match)
        chunk = budget.chunk(new_tokens)
        budget.take(chunk, pages)
        return chunk
