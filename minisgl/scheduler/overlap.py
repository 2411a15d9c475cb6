"""Overlap scheduling: the host plans step N+1 while the device still runs step N.

In :meth:`~minisgl.scheduler.scheduler.Scheduler.step` the host and the device take
turns: the host schedules a batch, reserves its pages and packs its input; the device runs it;
the host waits for the sampled tokens (``tolist()`` blocks), appends them and retires the
finished requests; only then does it start planning the next step. On a GPU the host's share is
pure idle time for the device.

:class:`OverlapScheduler` reorders the work so that the two run side by side. One call of
:meth:`OverlapScheduler.step`:

1. schedules and prepares batch N+1 while batch N is still *in flight* (launched, its tokens
   not yet read on the host);
2. launches batch N+1. A request of batch N+1 whose last token is batch N's sample has no real
   token on the host yet: its input id is gathered on the device from batch N's output tensor;
3. only then reads batch N's tokens on the host (the device is busy with N+1 meanwhile),
   appends them, and retires the requests that finished. Batch N's results are consumed one
   step late.

How a request whose next token is still on the device takes part in scheduling: when its batch
is launched, a *placeholder* (:data:`PENDING`) is appended to its ``output_ids``, so that its
length, ``new_len`` and page needs are those it will have; step 3 replaces the placeholder with
the real token.

The classic subtlety is a request that finishes in step N while it is already in batch N+1:

- a request that reaches ``max_tokens`` in step N is known to finish before its token is read
  (its length says so), so it never enters batch N+1: it waits, holding its pages, for step 3;
- a request that samples an end-of-sequence or stop token in step N cannot be known to finish
  until step 3, and by then batch N+1 has computed one more token for it. That token is dropped
  (its placeholder is removed), and the request's pages go back only once batch N+1 has been
  processed, because batch N+1 still writes into them.

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
from minisgl.scheduler.chunking import cut_reqs, unsampled
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.utils import StepResult
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

# A token id no vocabulary has: stands in ``output_ids`` for a sample still on the device.
PENDING = -1


def num_sampled(output_ids: list[int]) -> int:
    """How many of ``output_ids`` are real tokens. Placeholders only ever trail them (a
    request's pending sample is its last token), so this looks at the end, not the whole list."""
    n = len(output_ids)
    while n and output_ids[n - 1] == PENDING:
        n -= 1
    return n


@dataclass
class InFlight:
    """A launched batch whose sampled tokens the host has not read yet.

    Attributes:
        batch: the batch.
        tokens: its ``[B]`` sampled token ids on the device (input ids of the next batch are
            gathered from it).
        host_tokens: the same ids being copied to the host (on CUDA, a view of one of the
            scheduler's two pinned buffers).
        ready: on CUDA, an event recorded after that copy; None on a CPU.
        slots: for each request of the batch, the index in ``output_ids`` of its placeholder,
            or None when it sampled nothing real (a chunk of a prompt that goes on).
    """

    batch: Batch
    tokens: torch.Tensor
    host_tokens: torch.Tensor
    ready: torch.cuda.Event | None
    slots: list[int | None]

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
        # batch whose tokens are not processed yet. uid -> request.
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
        """As :meth:`Scheduler.check_integrity` (retiring requests count as live), and
        placeholders exist only for the batch in flight."""
        super().check_integrity()
        flight = self._in_flight
        # A finished (zombie) or aborted request's sample in flight is dropped: no placeholder.
        pending = 0 if flight is None else sum(
            slot is not None and not req.is_finished and req.table_row is not None
            for req, slot in zip(flight.batch.reqs, flight.slots))
        placeholders = sum(req.output_ids.count(PENDING) for req in self.admitted_reqs())
        if placeholders != pending:
            raise RuntimeError(f"{placeholders} placeholder token(s) for {pending} sample(s) "
                               "in flight")

    def abort(self, uid: int) -> Req | None:
        """As :meth:`Scheduler.abort`; a request finishing in the batch in flight is not
        live any more, so aborting it returns None."""
        req = super().abort(uid)
        if req is not None and PENDING in req.output_ids:
            # Its sample in flight is dropped: the batch in flight skips aborted requests.
            req.output_ids = [t for t in req.output_ids if t != PENDING]
        return req

    # ------------------------------------------------------------------ one step
    def step(self) -> StepResult:
        """Launch the next batch, then process the one launched before it (see the module)."""
        if not self.overlap:
            return super().step()
        batch = self.schedule_next_batch()
        if batch is None:
            if self._in_flight is None:
                if self.prefill.runnable:
                    raise RuntimeError(f"{self.num_waiting} request(s) wait but none can be "
                                       f"admitted with nothing running: {self.prefill_budget()}")
                return self._report(None, 0, [])
            # Nothing new to launch (maybe pages are held by requests finishing in flight):
            # drain the batch in flight, so that the next step sees its results.
            finished = self._process(self._in_flight)
            self._in_flight = None
            return self._report(None, 0, finished)
        num_tokens = batch.num_tokens
        new_lens = tuple(batch.new_lens)
        new_pages = self.prepare_batch(batch)
        previous, self._in_flight = self._in_flight, self._launch(batch, self._in_flight)
        # The device now runs this batch; meanwhile the host reads the previous one's tokens.
        finished = [] if previous is None else self._process(previous)
        result = self._report(batch, num_tokens, finished, new_pages=new_pages,
                              new_lens=new_lens)
        self.num_steps += 1
        return result

    def _launch(self, batch: Batch, previous: InFlight | None) -> InFlight:
        """Run ``batch`` on the engine without waiting for its tokens; placeholders for them."""
        engine = self.engine
        with torch.no_grad(), unsampled(cut_reqs(batch)):
            ctx = engine.prepare(batch)
            self._fill_pending_inputs(batch, ctx.input_ids, previous)
            logits = engine.run(ctx)
            tokens = engine.sample(batch, logits)
        for req, computed in zip(batch.reqs, batch.new_lens):
            req.cached_len += computed
        host, ready = self._copy_to_host(tokens)
        slots: list[int | None] = []
        for req in batch.reqs:
            if req.new_len > 0:  # only a chunk of its prompt ran: no real sample
                slots.append(None)
                continue
            slots.append(len(req.output_ids))
            req.output_ids.append(PENDING)
            if len(req.output_ids) >= req.params.max_tokens:
                # Its last token is in flight: it finishes whatever it samples. It must not run
                # again (it would need a slot past its lifetime), so it leaves the running set.
                self.decode.remove(req.uid)
                self._retiring[req.uid] = req
            elif batch.is_prefill:
                self.decode.add([req])
        return InFlight(batch, tokens, host, ready, slots)

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

    def _fill_pending_inputs(self, batch: Batch, input_ids: torch.Tensor,
                             previous: InFlight | None) -> None:
        """Replace the placeholders among ``input_ids`` with the previous batch's samples,
        gathered on the device: the host does not know them yet."""
        if previous is None:
            return
        source = {id(req): i for i, (req, slot) in enumerate(zip(previous.batch.reqs,
                                                                  previous.slots))
                  if slot is not None}
        dst: list[int] = []
        src: list[int] = []
        offset = 0
        for req, n in zip(batch.reqs, batch.new_lens):
            # Only a decode token can be pending: it is the request's last, and only token.
            if req.output_ids and req.output_ids[-1] == PENDING:
                assert n == 1 and id(req) in source, req
                dst.append(offset)
                src.append(source[id(req)])
            offset += n
        if dst:
            # Both index lists in one copy the host does not wait for.
            index = torch.tensor([dst, src], dtype=torch.int64).to(input_ids.device,
                                                                   non_blocking=True)
            input_ids[index[0]] = previous.tokens[index[1]]

    def _process(self, flight: InFlight) -> list[Req]:
        """Read ``flight``'s tokens, put them in place of the placeholders, retire the finished.

        A request that finishes here while it runs in the batch now in flight is a *zombie*:
        its extra placeholder is dropped now, and its pages go back when that batch is
        processed.
        """
        finished: list[Req] = []
        for req, slot, token in zip(flight.batch.reqs, flight.slots, flight.wait(), strict=True):
            if slot is None:
                continue
            if req.is_finished:  # a zombie: its real last token came from the batch before
                self._release_retired(req)
                continue
            if req.table_row is None:  # aborted while in flight: its sample is dropped
                continue
            assert req.output_ids[slot] == PENDING, (req, slot)
            tail = req.output_ids[slot + 1:]  # the next batch's placeholder, if it runs there
            del req.output_ids[slot:]
            if req.append_token(token, self.eos_token_ids) is None:
                req.output_ids.extend(tail)
                continue
            finished.append(req)
            self.decode.remove(req.uid)
            logger.debug("request %d finished (%s) after %d token(s)", req.uid,
                         req.finish_reason, len(req.output_ids))
            if tail:  # it runs in the batch in flight: keep its pages until that one is done
                self._retiring[req.uid] = req
            else:
                self._release_retired(req)
        return finished

    def _release_retired(self, req: Req) -> None:
        self._retiring.pop(req.uid, None)
        if req.table_row is not None:
            self.cache.release(req)
        self._live_uids.discard(req.uid)
