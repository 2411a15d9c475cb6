"""The scheduler as a process: requests in from the tokenizer, tokens out to the detokenizer.

:func:`run_scheduler` waits for messages only when there is nothing to compute (a new request
never stalls the running ones), runs one step, and sends one frame with a
:class:`~minisgl.message.DetokenizeRequest` per token. :class:`SchedulerIO` is the part that
needs no socket, so a test can drive it directly. A request the scheduler cannot serve leaves
with an :class:`~minisgl.message.AbortRequest` carrying a :class:`~minisgl.message.RequestError`,
never dropped. Under tensor parallelism this process is rank 0, and a failed step ends it: the
ranks could no longer be trusted to agree. Chapter 14 tells the story; chapters 16 and 17 add
errors and tensor parallelism.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter

from minisgl.core import Req
from minisgl.message import (AbortRequest, BackendMessage, DetokenizeRequest, DetokenizerMessage,
                             RequestError, TokenUsage, UserRequest, server_error)
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.prefill import output_room
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.tp import TPLaunch, start_leader
from minisgl.utils.logger import get_logger
from minisgl.utils.counters import SharedCounters
from minisgl.utils.heap import frozen_heap
from minisgl.utils.processes import reporting_readiness, worker_process
from minisgl.utils.queues import ZmqPullQueue, ZmqPushQueue
from minisgl.utils.torch_utils import configure_cpu_threads

logger = get_logger(__name__)

# What the scheduler publishes after each step. running / waiting / kv_pages_in_use are the
# state now; prompt_tokens and generation_tokens are totals since start-up.
SCHEDULER_COUNTERS = ("running", "waiting", "kv_pages_in_use", "prompt_tokens",
                      "generation_tokens", "spec_proposed_tokens", "spec_accepted_tokens")


def scheduler_counters() -> SharedCounters:
    """Counters for :func:`run_scheduler`'s ``stats`` argument."""
    return SharedCounters(SCHEDULER_COUNTERS)

# A step that raises fails the requests it was serving, and the scheduler goes on;
# this many failed steps in a row mean it cannot recover, and the process exits (the API server
# then reports it unhealthy and fails every waiting request).
MAX_FAILED_STEPS = 3


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
        self.prompt_tokens = self.generation_tokens = 0  # served since start-up
        self._failed_steps = 0  # steps in a row that raised

    def receive(self, messages: list[BackendMessage]) -> list[DetokenizerMessage]:
        """Add and abort requests, in the order the messages came.

        Returns the aborts to pass on to the detokenizer, as the last message for their uid:
        one for each request an abort actually dropped (one that dropped nothing has sent, or
        will send, its last token), every abort that carries an error (the client must hear
        why), and one with its own error for each request the scheduler refuses.
        """
        forward: list[DetokenizerMessage] = []
        for message in messages:
            if isinstance(message, UserRequest):
                error = self._add(message)
                if error is not None:
                    forward.append(AbortRequest(message.uid, error=error))
            elif isinstance(message, AbortRequest):
                if self.scheduler.abort(message.uid) is not None:
                    self.live.pop(message.uid, None)
                    forward.append(message)
                elif message.error is not None:
                    forward.append(message)
            else:  # the queue only lets BackendMessage through; a new kind needs code here
                logger.error("the scheduler cannot handle a %s; dropped", type(message).__name__)
        return forward

    def _add(self, message: UserRequest) -> RequestError | None:
        """Queue a request; the error to answer it with if it cannot be served."""
        limit = self.scheduler.max_seq_len  # the model's context, or what the KV pool holds
        # The rule (output_room): a prompt of at most `limit` tokens, and prompt + max_tokens
        # at most limit + 1, since the last token sampled is never stored. Said as it is.
        most = output_room(0, limit)  # prompt + max_tokens, at most
        if len(message.input_ids) > limit:
            return RequestError(
                f"the prompt is {len(message.input_ids)} tokens long; this server serves "
                f"prompts of at most {limit} tokens, and prompt plus max_tokens of at most "
                f"{most} tokens", param="prompt", code="context_length_exceeded")
        room = output_room(len(message.input_ids), limit)
        if message.strict_max_tokens and message.sampling_params.max_tokens > room:
            # A limit the client chose is refused, as OpenAI does; a default one is lowered.
            return RequestError(
                f"max_tokens is {message.sampling_params.max_tokens}, but a prompt of "
                f"{len(message.input_ids)} tokens leaves room for at most {room}: this server "
                f"serves prompt plus max_tokens of at most {most} tokens",
                param="max_tokens", code="context_length_exceeded")
        try:
            req = Req(message.uid, message.input_ids, message.sampling_params)
            self.scheduler.add(req)
        except ValueError as exc:  # the scheduler's own checks: a token id outside the vocab
            logger.warning("request %d refused: %s", message.uid, exc)
            return RequestError(str(exc), param="prompt")
        except Exception as exc:  # a bug: answer this request, serve the others
            logger.exception("request %d could not be added", message.uid)
            return server_error("the scheduler could not accept the request", exc)
        self.live[req.uid] = req
        return None

    def step(self) -> list[DetokenizerMessage]:
        """Run one scheduler step; one message for each token the host read in it.

        The step's ``read`` names those requests: with overlap, the tokens are those of the
        batch launched the step before. A token still on the device is in ``in_flight``, not
        in ``output_ids``, so the token read is the last of ``output_ids``. The counters are
        published after every step, failed or not: one shared-memory write.
        """
        live = list(self.live)
        try:
            read = self.scheduler.step().read
            # A request appears once per token it took: once a step, or more under speculative
            # decoding (chapter 23), where its n-th of k entries is its (k - n)-th last token.
            after = Counter(read)
            messages = []
            for req in read:
                after[req] -= 1
                if self.live.get(req.uid) is req:
                    messages.append(self._new_token(req, back=after[req]))
            self._failed_steps = 0
            self.generation_tokens += len(messages)  # one message per token
            self.prompt_tokens += sum(m.prompt_tokens for m in messages)
        except Exception as exc:  # noqa: BLE001 - fail the requests, not the process
            messages = self._fail(live, exc)
        if self.stats is not None:
            self.stats.update(**self.scheduler.gauges(), prompt_tokens=self.prompt_tokens,
                              generation_tokens=self.generation_tokens)
        return messages

    def _new_token(self, req: Req, back: int = 0) -> DetokenizeRequest:
        """The message for ``req``'s token ``back`` places before its newest: its first
        carries the stop strings and the prompt's length, its last the finish reason and
        usage."""
        num_prompt, num_output = len(req.prompt_ids), len(req.output_ids) - back
        first, last = num_output == 1, req.finish_reason is not None and back == 0
        if last:
            del self.live[req.uid]
        return DetokenizeRequest(req.uid, req.output_ids[num_output - 1],
                                 finish_reason=req.finish_reason if last else None,
                                 usage=TokenUsage(num_prompt, num_output) if last else None,
                                 stop=req.params.stop if first else (),
                                 prompt_tokens=num_prompt if first else 0,
                                 logprobs=req.output_logprobs[num_output - 1]
                                 if req.output_logprobs else None,  # chapter 21
                                 **({"prompt_ids": tuple(req.prompt_ids),
                                     "prompt_logprobs": tuple(req.prompt_logprobs)}
                                    if first and req.params.prompt_logprobs is not None else {}))

    def _fail(self, uids: list[int], exc: Exception) -> list[DetokenizerMessage]:
        """A step raised: end every request that was live before it with an error.

        Which request made it fail cannot be told, and their state may be half-updated, so all
        of them are aborted, each with an error for its client. Later requests are served as
        usual, unless :data:`MAX_FAILED_STEPS` steps in a row fail: then the error is raised.
        """
        self._failed_steps += 1
        logger.error("a scheduler step failed; failing its %d request(s)", len(uids),
                     exc_info=exc)
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise RuntimeError(f"{self._failed_steps} scheduler steps in a row failed; "
                               "giving up") from exc
        error = server_error("the scheduler failed while serving this request", exc)
        for uid in uids:
            try:
                self.scheduler.abort(uid)
            except Exception:  # keep freeing the others
                logger.exception("request %d could not be aborted", uid)
            self.live.pop(uid, None)
        return [AbortRequest(uid, error=error) for uid in uids]


def run_scheduler(config: SchedulerConfig, inbox: str, detokenizer_addr: str,
                  ready: multiprocessing.Queue,
                  stats: SharedCounters | None = None, tp: TPLaunch | None = None) -> None:
    """The scheduler process: serve requests from ``inbox`` until SIGTERM or SIGINT (or until
    its parent dies: ``signals.requested`` is checked after every step).

    Args:
        config: the engine's and the scheduler's settings.
        inbox: the address this process binds, where the tokenizers send
            :class:`UserRequest` and :class:`AbortRequest` messages.
        detokenizer_addr: the detokenizer's inbox, where the tokens go.
        ready: a queue from :func:`~minisgl.utils.processes.new_ready_queue` to report start-up on.
        stats: counters named :data:`SCHEDULER_COUNTERS` to publish, or None.
        tp: the tensor-parallel group this process leads as rank 0, or None.
    """
    # the process that computes gets the cores (shared with the other ranks under TP)
    configure_cpu_threads("model", processes=1 if tp is None else tp.size)
    with worker_process("scheduler") as signals:
        scheduler = None
        try:
            with signals.interruptible(), reporting_readiness(ready, "scheduler"):
                receive = ZmqPullQueue(inbox, BackendMessage, bind=True)
                send = ZmqPushQueue(detokenizer_addr, DetokenizerMessage, bind=False)
                scheduler = Scheduler(config) if tp is None else start_leader(config, tp)
                io = SchedulerIO(scheduler, stats)
            with frozen_heap():  # start-up's objects stay out of the collector's full passes
                while not signals.requested:
                    # idle: sleep until a message (or a signal) comes; busy: take what has arrived
                    messages = receive.drain() if scheduler.has_work else signals.receive(receive)
                    out = io.receive(messages) if messages else []
                    if scheduler.has_work:
                        out += io.step()
                    send.put_many(out)  # one frame per step
        finally:
            if scheduler is not None:
                scheduler.close()
