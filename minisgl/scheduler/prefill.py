"""The waiting queue, and the choice of which waiting requests the next prefill batch takes.

A request is *admitted*, first come, first served, when it fits a :class:`PrefillBudget`: a
free page-table row, its worst case of pages (:func:`~minisgl.scheduler.utils.lifetime_pages`)
among those not yet promised, and its prompt tokens within ``max_prefill_tokens`` (except the
batch's first request; ``chunking.py`` cuts that one instead). The queue stops at the first
request that does not fit: letting smaller ones jump it again and again would starve a large
one. Chapter 9 tells the story; chapters 10 and 11 add chunks and cached prefixes.
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
        no page to write to. Tokens only shape the batch: its first request may go over.
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

    def remove(self, uid: int) -> Req | None:
        """Take request ``uid`` out of the queue (it was aborted); None if it is not waiting."""
        for req in self.waiting:
            if req.uid == uid:
                self.waiting.remove(req)
                return req
        return None

    def schedule(self, budget: PrefillBudget) -> Batch | None:
        """Admit waiting requests in arrival order while they fit ``budget``; None if none fits.

        Admitted requests leave the queue holding a page-table row (and any cached prefix);
        the scheduler reserves their pages before the batch runs. A request whose prompt the
        budget cuts is the batch's last and stays at the head of the queue; the batch's
        ``chunk_lens`` say how much of each prompt runs now.
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
