"""Overlap scheduling: the host plans step N+1 while the device still runs step N.

In :meth:`~minisgl.scheduler.scheduler.Scheduler.step` the host and the device take
turns: the host schedules a batch, reserves its pages and launches it; the device runs it; the
host waits for the sampled tokens (``tolist()`` blocks), appends them and retires the finished
requests; only then does it start planning the next step. On a GPU the host's share is pure idle
time for the device.

:class:`OverlapScheduler` runs the same step, and changes only *when* the host reads a batch's
tokens: one step late. A step schedules, prepares and launches batch N+1 exactly as the
synchronous step does (``Engine.forward``), and only then reads batch N's tokens, while the
device is busy with N+1. Batch N's results are consumed one step late.

A step can be launched before the host has read the tokens it feeds because the host does not
need them: the engine gathers every step's input ids on the device from its token pool, into
which each step's samples were written right after sampling (``engine/token_pool.py``). What
the host needs is each request's *length*, and that it knows: a sampled token the host has not
read counts in ``Req.in_flight``, so ``num_tokens``, ``new_len`` and the page reservation are
those the request will have, while ``output_ids`` holds only tokens the host has read.

The classic subtlety is a request that finishes in step N while it is already in batch N+1:

- a request that reaches ``max_tokens`` in step N is known to finish before its token is read
  (its length says so), so it never enters batch N+1: it waits, holding its pages, for its
  token to be read;
- a request that samples an end-of-sequence or stop token in step N cannot be known to finish
  until its token is read, and by then batch N+1 has computed one more token for it. That token
  is dropped, and the request's pages go back only once batch N+1 has been read, because batch
  N+1 still writes into them: until then it is a *zombie*.

Either way a request keeps its pages for at most one step longer than without overlap, and the
tokens are the same: each request's tokens depend only on its own earlier tokens.

The switch is the config's ``overlap`` field: ``SchedulerConfig(..., overlap=False)`` runs
the synchronous step, for ablation (``LLM(path, overlap=False)`` passes it through).
Left at None, overlap is on unless the environment variable ``MINISGL_DISABLE_OVERLAP`` is set.
It is on for CPU as well: nothing runs asynchronously there, but the same code path runs,
results one step late, so the CPU tests exercise it.

Overlap only pays if the host never waits for the device while it plans: one copy to the device
that waits for the queue to drain (``torch.tensor(..., device="cuda")`` does) and the host is
back to taking turns with the device. So every copy on this path is issued without waiting
(``non_blocking=True``), and the tokens come back through a pinned buffer and an event.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Batch, Req
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.utils import StepResult
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)


@dataclass
class InFlight:
    """A launched batch whose sampled tokens the host has not read yet.

    Attributes:
        batch: the batch (its ``completes`` says which requests sampled a real token).
        host_tokens: the ``[B]`` sampled ids being copied to the host (on CUDA, a view of one
            of the scheduler's two pinned buffers).
        ready: on CUDA, an event recorded after that copy; None on a CPU.
    """

    batch: Batch
    host_tokens: torch.Tensor
    ready: torch.cuda.Event | None

    def wait(self) -> list[int]:
        """The sampled ids on the host (blocks until the device has produced them)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_tokens.tolist()


class OverlapScheduler(Scheduler):
    """A :class:`Scheduler` whose host work for one step overlaps the device's previous step.

    Args:
        config: as for :class:`Scheduler`; its ``overlap`` field switches overlap on (True,
            the default unless ``MINISGL_DISABLE_OVERLAP`` is set) or off (False: the
            synchronous step).

    Attributes:
        overlap: whether :meth:`step` overlaps (the config's value). It may be switched between
            two runs, while nothing is waiting, running or in flight (``has_work`` False): a
            benchmark compares both on one engine that way.

    With overlap on, the :class:`StepResult` of a step describes the batch it *launched*, and
    its ``finished`` lists the requests that finished in the batch before it (whose tokens
    this step read). A step that launches nothing, but still had a batch in flight, reports
    ``phase`` None with the requests that batch finished.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        assert isinstance(config.overlap, bool), "SchedulerConfig resolves overlap"
        self.overlap = config.overlap
        self._in_flight: InFlight | None = None
        # Out of the running set, still holding pages: they finish (or have finished) in a
        # batch whose tokens are not read yet. uid -> request.
        self._retiring: dict[int, Req] = {}
        # CUDA: where the sampled ids land on the host, allocated once (pinned memory is slow
        # to allocate). Two, used in turn: the batch launched now copies into one while the
        # host reads the other's. A batch never holds more requests than the table has rows.
        self._host_buffers: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        if self.engine.device.type == "cuda":
            self._host_buffers = [
                (torch.empty(config.max_running_reqs, dtype=torch.int64, pin_memory=True),
                 torch.cuda.Event()) for _ in range(2)]
        self._launches = 0

    # ------------------------------------------------------------------ bookkeeping
    @property
    def has_work(self) -> bool:
        return super().has_work or self._in_flight is not None

    def admitted_reqs(self) -> list[Req]:
        return super().admitted_reqs() + list(self._retiring.values())

    @property
    def num_live(self) -> int:
        return super().num_live + len(self._retiring)

    def check_integrity(self) -> None:
        """As :meth:`Scheduler.check_integrity` (retiring requests count as live), and every
        request's ``in_flight`` counts exactly its samples in the batch in flight."""
        super().check_integrity()
        flight = self._in_flight
        unread = set() if flight is None else {
            req for req, complete in zip(flight.batch.reqs, flight.batch.completes) if complete}
        for req in self.admitted_reqs():
            if req.in_flight != (req in unread):
                raise RuntimeError(f"request {req.uid} counts {req.in_flight} token(s) in "
                                   f"flight; the batch in flight holds {int(req in unread)}")

    def abort(self, uid: int) -> Req | None:
        """As :meth:`Scheduler.abort`; a request finishing in the batch in flight is not
        live any more, so aborting it returns None."""
        req = super().abort(uid)
        if req is not None:
            req.in_flight = 0  # its sample in flight is never read: the batch skips it
        return req

    # ------------------------------------------------------------------ one step
    def process_batch(self, batch: Batch, next_tokens: torch.Tensor) -> list[Req]:
        """Start bringing ``batch``'s tokens to the host; read those of the batch before it.

        Called, as in the synchronous step, right after ``batch`` was launched: the device now
        runs it, and the host reads the previous batch's tokens meanwhile.
        """
        if not self.overlap:
            return super().process_batch(batch, next_tokens)
        for req, complete in zip(batch.reqs, batch.completes):
            if not complete:  # only a chunk of its prompt ran
                continue
            if len(req.output_ids) + req.in_flight >= req.params.max_tokens:
                # Its last token is in flight: it finishes whatever it samples. It must not run
                # again (it would need a slot past its lifetime), so it leaves the running set.
                self.decode.remove(req.uid)
                self._retiring[req.uid] = req
            elif batch.is_prefill:
                self.decode.add([req])
        previous = self._in_flight
        self._in_flight = InFlight(batch, *self._copy_to_host(next_tokens))
        return [] if previous is None else self._read(previous)

    def idle_step(self) -> StepResult:
        """Nothing to launch: read the batch in flight (maybe its requests hold the pages a
        waiting one needs), so that the next step sees its results."""
        if self._in_flight is None:
            return super().idle_step()
        previous, self._in_flight = self._in_flight, None
        return self._report(None, 0, self._read(previous))

    def _copy_to_host(self, tokens: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``tokens`` to the host; the host view and the event that says it is
        there (on a CPU: the tokens themselves and None)."""
        if tokens.device.type != "cuda":
            return tokens, None
        # Buffer k % 2 was last used two launches ago; that batch's tokens were read in the
        # step that launched the batch after it, so the buffer is free again. Pinned
        # (page-locked) memory is what lets the copy run without the host waiting for it.
        buffer, ready = self._host_buffers[self._launches % 2]
        self._launches += 1
        host = buffer[: tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        ready.record()
        return host, ready

    def _read(self, flight: InFlight) -> list[Req]:
        """Read ``flight``'s tokens, append them, retire the finished; returns those.

        A request that finishes here while it runs in the batch now in flight is a *zombie*:
        its pages go back when that batch is read, and that batch's token for it is dropped.
        """
        finished: list[Req] = []
        for req, complete, token in zip(flight.batch.reqs, flight.batch.completes,
                                        flight.wait(), strict=True):
            if not complete or req.table_row is None:  # a cut chunk, or aborted since its launch
                continue
            if req.is_finished:  # a zombie: its real last token came from the batch before
                req.in_flight -= 1
                self._release_retired(req)
                continue
            if req.append_token(token, self.eos_token_ids) is None:
                continue
            finished.append(req)
            self.decode.remove(req.uid)
            logger.debug("request %d finished (%s) after %d token(s)", req.uid,
                         req.finish_reason, len(req.output_ids))
            if req.in_flight:  # it runs in the batch in flight: keep its pages until that one
                self._retiring[req.uid] = req
            else:
                self._release_retired(req)
        return finished

    def _release_retired(self, req: Req) -> None:
        self._retiring.pop(req.uid, None)
        self.cache.release(req)
        self._live_uids.discard(req.uid)
