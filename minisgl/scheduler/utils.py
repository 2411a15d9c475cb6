"""Small pieces the scheduler's parts share: a request's worst-case KV need, and a step's report.

:func:`lifetime_tokens` / :func:`lifetime_pages` are the most KV a request can ever occupy; the
scheduler admits a request only when that much is free, so a running request never finds the
pool empty. :class:`StepResult` is what one step did. Chapter 9 tells the story.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.attention.utils import pages_for
from minisgl.core import Phase, Req


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


@dataclass(frozen=True)
class StepResult:
    """What one scheduler step did.

    Attributes:
        step: the step's number, from 0.
        phase: ``"prefill"`` or ``"decode"``; None when there was nothing to run.
        uids: the requests of the batch, in batch order.
        num_tokens: tokens fed to the model (prompt tokens in a prefill, one per request in a
            decode step).
        new_pages: KV pages allocated for this step.
        pages_in_use: KV pages held after the step (finished requests' pages already returned).
        num_pages: KV pages the scheduler manages in all.
        waiting: uids still in the waiting queue after this step, in arrival order.
        running: uids holding KV pages after this step (they decode in the next decode step).
        finished: requests that finished in this step; each has its ``finish_reason``.
        new_lens: tokens each request of the batch computed, in batch order (a request whose
            prompt was cut computed only a chunk of it).
    """

    step: int
    phase: Phase | None
    uids: tuple[int, ...]
    num_tokens: int
    new_pages: int
    pages_in_use: int
    num_pages: int
    waiting: tuple[int, ...]
    running: tuple[int, ...]
    finished: tuple[Req, ...]
    new_lens: tuple[int, ...] = ()

    @property
    def idle(self) -> bool:
        """True when the step ran nothing (no request was waiting or running)."""
        return self.phase is None
