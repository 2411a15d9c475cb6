"""Chunked prefill: a prompt longer than what a step has room for is computed over several steps.

The plain token budget (``prefill.PrefillBudget``) bends: the first request of a prefill batch
is taken whatever its length, so one 10,000-token prompt makes one 10,000-token step, and every
request already decoding waits for it. With chunked prefill
(``SchedulerConfig.chunked_prefill``) the budget is a hard limit instead:

- a prefill batch takes waiting requests first come, first served, while tokens are left, and
  the one that does not fit whole is **cut**: it computes the head of its prompt that fits, the
  *chunk*, and the step is full;
- the cut request stays at the head of the waiting queue, **holding** its page-table row, its
  pages and its promise of pages, and the next prefill batch starts with the next chunk of its
  prompt. Only its last chunk samples a real first token; the token sampled after an earlier
  chunk continues a half-read prompt and is thrown away;
- between two chunks, the requests already decoding get a step (see
  :meth:`~minisgl.scheduler.scheduler.Scheduler.schedule_next_batch`): a long prompt slows them
  down, it no longer stops them.

The K/V of a chunk's tokens are exactly those the whole prompt would have produced (each token
attends to the same earlier tokens, some of them now read back from the cache), so the outputs
do not change: only the step in which each token is computed does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from minisgl.core import Batch, Req
from minisgl.scheduler.prefill import PrefillBudget


@dataclass
class ChunkedPrefillBudget(PrefillBudget):
    """A prefill budget whose token limit is hard: a prompt that does not fit is cut to fit.

    Rows and pages are checked as by the plain budget, for the whole request: a request cut
    after its first chunk must be able to finish, so it is promised the pages of its whole
    prompt and answer at once. Only the *tokens* of this step are cut.
    """

    def admits(self, new_tokens: int, pages: int, is_first: bool) -> bool:
        """Whether a new request may start in this batch: a row, its pages, and any token."""
        if self.rows < 1 or pages > self.pages:
            return False
        return self.tokens > 0  # even one token left: the head of its prompt goes in

    def chunk(self, new_tokens: int) -> int:
        """How many of a request's ``new_tokens`` uncomputed tokens this step computes: as many
        as are left in the budget. The rest waits for the next prefill batch."""
        return min(new_tokens, self.tokens)


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

    A seeded request draws its samples from its own generator. A draw after a chunk would move
    that generator on, and every later token of the request would differ from an unchunked
    run; restoring the generator's state afterwards keeps its stream where it was. A request's
    first step makes its generator (``Engine.prepare``): if that step is a cut chunk, the
    generator is dropped again, and the next step makes it afresh from the seed.
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
