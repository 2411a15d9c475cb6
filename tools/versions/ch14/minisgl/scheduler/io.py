"""The scheduler as a process: requests in from the tokenizer, tokens out to the detokenizer.

Chapters 9 to 12 drive the scheduler from a loop in the caller's own process (``LLM``). Served,
it runs in a process of its own, and its loop is :func:`run_scheduler`:

1. wait for messages only when there is nothing to compute; otherwise take whatever has
   arrived without waiting, so that a new request never stalls the running ones;
2. add the new requests, abort the cancelled ones;
3. run one step of the (chapter 12, overlapping) scheduler;
4. send one frame holding a :class:`~minisgl.message.DetokenizeRequest` for every token the
   step produced; the last token of a request carries its ``finish_reason`` and ``usage``.

:class:`SchedulerIO` is the part of that loop that needs no socket (turning messages into
requests, and a step's results into messages), so that a test can drive it directly.

The scheduler publishes its state after every step in a
:class:`~minisgl.utils.counters.SharedCounters` with the names :data:`SCHEDULER_COUNTERS`,
which the API server reads for ``/metrics``.
"""

from __future__ import annotations

import multiprocessing

import zmq

from minisgl.core import Req
from minisgl.message import (
    AbortRequest,
    BackendMessage,
    DetokenizeRequest,
    DetokenizerMessage,
    TokenUsage,
    UserRequest,
)
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.utils.logger import get_logger
from minisgl.utils.counters import SharedCounters
from minisgl.utils.heap import frozen_heap
from minisgl.utils.processes import ShutdownRequested, ShutdownSignals, reporting_readiness
from minisgl.utils.queues import ZmqPullQueue, ZmqPushQueue

logger = get_logger(__name__)

# What the scheduler publishes after each step. running / waiting / kv_pages_in_use are the
# state now; prompt_tokens and generation_tokens are totals since start-up.
SCHEDULER_COUNTERS = ("running", "waiting", "kv_pages_in_use", "prompt_tokens",
                      "generation_tokens")


def scheduler_counters() -> SharedCounters:
    """Counters for :func:`run_scheduler`'s ``stats`` argument."""
    return SharedCounters(SCHEDULER_COUNTERS)


class SchedulerIO:
    """A scheduler fed with messages, whose steps come out as messages.

    Args:
        scheduler: the scheduler.
        stats: counters to publish after each step, or None.

    Attributes:
        live: uid -> request, for every request added and not finished or aborted yet.
    """

    def __init__(self, scheduler: Scheduler, stats: SharedCounters | None = None) -> None:
        self.scheduler = scheduler
        self.stats = stats
        self.live: dict[int, Req] = {}
        self._sent: dict[int, int] = {}  # uid -> tokens sent to the detokenizer so far
        self._last_uids: tuple[int, ...] = ()  # the previous step's batch

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def receive(self, messages: list[BackendMessage]) -> list[DetokenizerMessage]:
        """Add and abort requests, in the order the messages came.

        Returns the aborts to pass on to the detokenizer: one for each request an abort
        actually dropped. It is the last message the detokenizer gets for that uid, so it can
        forget the request. An abort that dropped nothing is not passed on: the request has
        finished (its last token went out already) or finishes in the batch in flight (its
        last token will).
        """
        forward: list[DetokenizerMessage] = []
        for message in messages:
            if isinstance(message, UserRequest):
                self._add(message)
            elif isinstance(message, AbortRequest):
                if self.scheduler.abort(message.uid) is not None:
                    self.live.pop(message.uid, None)
                    self._sent.pop(message.uid, None)
                    forward.append(message)
            else:  # the queue only lets BackendMessage through; a new kind needs code here
                logger.error("the scheduler cannot handle a %s; dropped", type(message).__name__)
        return forward

    def _add(self, message: UserRequest) -> None:
        try:
            req = Req(message.uid, message.input_ids, message.sampling_params)
            self.scheduler.add(req)
        except ValueError as exc:  # chapter 16 answers the client with the error
            logger.error("request %d dropped: %s", message.uid, exc)
            return
        self.live[req.uid] = req
        self._sent[req.uid] = 0

    def step(self) -> list[DetokenizerMessage]:
        """Run one scheduler step; one message per token it produced.

        With overlap (chapter 12) a step reads the tokens of the batch launched the step
        before, so the requests that may have a new token are those of this step's batch and
        of the previous one. A request's ``output_ids`` hold only tokens the host has read:
        one still on the device is not there yet.
        """
        result = self.scheduler.step()
        finished = {req.uid: req for req in result.finished}
        messages: list[DetokenizerMessage] = []
        for uid in dict.fromkeys((*self._last_uids, *result.uids, *finished)):
            req = self.live.get(uid)
            if req is not None:
                messages += self._new_tokens(req, finished.get(uid) is req)
        self._last_uids = result.uids
        self._publish()
        return messages

    def _new_tokens(self, req: Req, finished: bool) -> list[DetokenizeRequest]:
        out = req.output_ids
        real = len(out)
        sent = self._sent[req.uid]
        assert real > sent or not finished, f"request {req.uid} finished without a new token"
        messages = []
        for i in range(sent, real):
            last = finished and i == real - 1
            first = i == 0
            messages.append(DetokenizeRequest(
                req.uid, out[i],
                finish_reason=req.finish_reason if last else None,
                usage=TokenUsage(len(req.prompt_ids), real) if last else None,
                stop=req.params.stop if first else (),
                prompt_tokens=len(req.prompt_ids) if first else 0,
            ))
        if self.stats is not None and real > sent:
            self.stats.add(generation_tokens=real - sent,
                           prompt_tokens=len(req.prompt_ids) if sent == 0 else 0)
        self._sent[req.uid] = real
        if finished:
            del self.live[req.uid], self._sent[req.uid]
        return messages

    def _publish(self) -> None:
        if self.stats is None:
            return
        cache = self.scheduler.cache
        self.stats.update(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            # Held by requests; pages the prefix cache keeps but could evict are not in use.
            kv_pages_in_use=cache.pages_in_use - cache.prefix_cache.num_evictable_pages,
        )


def run_scheduler(config: SchedulerConfig, inbox: str, detokenizer_addr: str,
                  ready: multiprocessing.Queue | None = None,
                  stats: SharedCounters | None = None) -> None:
    """The scheduler process: serve requests from ``inbox`` until SIGTERM or SIGINT.

    Args:
        config: the engine's and the scheduler's settings.
        inbox: the address this process binds, where the tokenizers send
            :class:`UserRequest` and :class:`AbortRequest` messages.
        detokenizer_addr: the detokenizer's inbox, where the tokens go.
        ready: a queue from :func:`~minisgl.utils.processes.new_ready_queue` to report start-up on,
            or None.
        stats: counters named :data:`SCHEDULER_COUNTERS` to publish, or None.
    """
    signals = ShutdownSignals()
    receive = send = None
    try:
        with signals.interruptible(), reporting_readiness(ready, "scheduler"):
            receive = ZmqPullQueue(inbox, BackendMessage, bind=True)
            send = ZmqPushQueue(detokenizer_addr, DetokenizerMessage, bind=False)
            io = SchedulerIO(Scheduler(config), stats)
        with frozen_heap():  # start-up's objects stay out of the collector's full passes
            while not signals.requested:
                messages = []
                if not io.has_work:  # idle: sleep until a message (or a signal) comes
                    messages.append(signals.receive(receive))
                out = io.receive(messages + receive.drain())
                if io.has_work:
                    out += io.step()
                send.put_many(out)  # one frame per step
    except ShutdownRequested:
        pass
    finally:
        for queue in (receive, send):
            if queue is not None:
                queue.close()  # linger 0: frames not handed over yet are dropped
        zmq.Context.instance().term()
    logger.info("scheduler stopped")
