"""Chunked prefill: a prompt longer than what a step has room for is computed over several steps.

With ``SchedulerConfig.chunked_prefill`` the token budget is a hard limit: the request that does
not fit whole is **cut** to the head of its prompt that fits, and stays at the head of the
waiting queue holding its row, its pages and its promise of pages. Decoding requests get a step
between two chunks. Only the last chunk samples a real first token. A chunk's K/V are exactly
those of the whole prompt, so outputs do not change. Chapter 10 tells the story.
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
