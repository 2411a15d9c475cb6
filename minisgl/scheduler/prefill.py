"""The waiting queue, and the choice of which waiting requests the next prefill batch takes.

A request is *admitted*, first come, first served, when it fits a :class:`PrefillBudget`: a
free page-table row, its worst case of pages (:func:`lifetime_pages`) among those not yet
promised, and its prompt tokens within ``max_prefill_tokens`` (except the batch's first
request). The queue stops at the first request that does not fit: letting smaller ones jump it
again and again would starve a large one. Chapter 9 tells the story.

With ``SchedulerConfig.chunked_prefill`` the token budget is a hard limit
(:class:`ChunkedPrefillBudget`): the request that does not fit whole is **cut** to the head of
its prompt that fits, and stays at the head of the queue holding its row, its pages and its
promise of pages. Decoding requests get a step between two chunks. Only the last chunk samples
a real first token. A chunk's K/V are exactly those of the whole prompt, so outputs do not
change. Chapter 10 tells that story; chapter 11 adds cached prefixes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from minisgl.kvcache.page_table import pages_for
from minisgl.core import Batch, Req
from minisgl.scheduler.cache import CacheManager


def lifetime_tokens(req: Req) -> int:
    """The most tokens whose K/V ``req`` will ever keep in the pool.

    Its prompt plus ``max_tokens - 1`` outputs: the last token it samples is returned to the
    caller but never fed back through the model, so it never needs a slot.
    """
    return len(req.prompt_ids) + req.params.max_tokens - 1


def lifetime_pages(req: Req, page_size: int) -> int:
    """Pages ``req`` holds at most, on its last step, if it runs to ``max_tokens``."""
    return pages_for(lifetime_tokens(req), page_size)


def output_room(prompt_len: int, max_seq_len: int) -> int:
    """The largest ``max_tokens`` a prompt of ``prompt_len`` tokens leaves room for within
    ``max_seq_len``: :func:`lifetime_tokens` solved for ``max_tokens`` (the last sample needs
    no slot, hence the + 1)."""
    return max_seq_len - prompt_len + 1


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
        return self.rows > 0 and pages <= self.pages and (is_first or new_tokens <= self.tokens)

    def take(self, new_tokens: int, pages: int) -> None:
        """Account for a request just admitted."""
        self.tokens -= new_tokens
        self.pages -= pages
        self.rows -= 1

    def chunk(self, new_tokens: int) -> int:
        """How many of a request's ``new_tokens`` uncomputed tokens this step computes.

        All of them: this budget never cuts a prompt.
        :class:`ChunkedPrefillBudget` cuts it to the tokens left.
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


@dataclass
class ChunkedPrefillBudget(PrefillBudget):
    """A prefill budget whose token limit is hard: a prompt that does not fit is cut to fit.

    Rows and pages are checked for the whole request: one cut after its first chunk must be
    able to finish. Only the *tokens* of this step are cut.
    """

    def admits(self, new_tokens: int, pages: int, is_first: bool) -> bool:
        """Whether a new request may start in this batch: a row, its pages, and any token."""
        # Even one token left: the head of its prompt goes in, as a first request's would.
        return self.tokens > 0 and super().admits(new_tokens, pages, is_first=True)

    def chunk(self, new_tokens: int) -> int:
        """How many of a request's ``new_tokens`` uncomputed tokens this step computes: as many
        as are left in the budget. The rest waits for the next prefill batch."""
        return min(new_tokens, self.tokens)


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
            if any(req.prompt_ids == other.prompt_ids and self._computes_shared_pages(other)
                   for other in admitted):
                break  # chapter 21: next batch, it will share the pages this one computes
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

    def _computes_shared_pages(self, req: Req) -> bool:
        """Whether admitted ``req`` computes whole pages of its prompt that the cache can hand
        to a request with the same prompt (chapter 21): it matched fewer than it could. The
        last prompt token is always computed, so a prompt can match up to the page before."""
        page_size = self.cache.page_size
        return req.cached_len < (len(req.prompt_ids) - 1) // page_size * page_size

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


def is_mid_prefill(req: Req) -> bool:
    """Whether ``req`` waits in the queue with part of its prompt computed.

    A waiting request holds a page-table row only between two chunks of its prompt: a request
    admitted whole leaves the queue in the step it is admitted.
    """
    return req.table_row is not None and req.cached_len < len(req.prompt_ids)


def cut_reqs(batch: Batch) -> list[Req]:
    """The requests of ``batch`` that compute only part of what they have left (before it runs).

    They sample no real token this step: their prompt goes on in a later chunk.
    """
    return [req for req, n in zip(batch.reqs, batch.new_lens) if n < req.new_len]


@contextmanager
def unsampled(reqs: Sequence[Req]) -> Iterator[None]:
    """Run a step in which the tokens sampled for ``reqs`` are thrown away, as if never drawn.

    A seeded request's draw after a chunk would move its generator on, and every later token
    would differ from an unchunked run, so its state is restored. A generator made in this
    step (``Engine.prepare``) is dropped, and the next step makes it afresh from the seed.
    """
    saved: list[tuple[Req, torch.Tensor | None]] = [
        (req, None if req.generator is None else req.generator.get_state()) for req in reqs]
    try:
        yield
    finally:
        for req, state in saved:
            if state is None:
                req.generator = None
            else:
                req.generator.set_state(state)
