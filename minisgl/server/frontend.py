"""The frontend's router: the API server's link to the workers, and the state that ties
requests to their replies.

:class:`RequestRouter` numbers requests (the *uid*), pushes each to tokenizer ``uid % N`` and
runs the one *listener* task that pulls every :class:`~minisgl.message.UserReply` from the
detokenizer and hands it to its request's :class:`~minisgl.server.lifecycle.ReplyBuffer`.
It knows nothing of HTTP (:mod:`minisgl.server.api_server` and :mod:`minisgl.shell` use it).

Chapter 15 tells the story; chapter 16 adds the rules that end a request before its last
reply (a slow reader, a dead worker or listener, shutdown) and the watchdog that applies them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortRequest,
    FrontendMessage,
    RequestError,
    SerializationError,
    TextLogprobs,
    TokenizeRequest,
    TokenizerMessage,
    UserReply,
)
from minisgl.server.lifecycle import (
    DEFAULT_REPLY_BUFFER_SIZE,
    DEFAULT_SLOW_READER_TIMEOUT_S,
    SHUTTING_DOWN,
    ReplyBuffer,
    unavailable_error,
)
from minisgl.server.protocol import APIError
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)


class _Outbox(Protocol):
    async def put(self, message: TokenizerMessage) -> None: ...


class _Inbox(Protocol):
    async def get(self) -> FrontendMessage: ...


@dataclass
class FrontendStats:
    """Counters the router keeps for ``/metrics`` (totals since start)."""

    submitted: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0  # ended with an error (a worker's, or the frontend's own)
    slow_readers: int = 0  # cut off for reading too slowly


class RequestRouter:
    """Sends requests to the tokenizer workers, routes every reply to its request, and ends
    every request whose last reply will not come, or should not be waited for.

    Many HTTP requests are in flight at once, but replies come back through a single queue.
    Each request gets a *uid* and a :class:`~minisgl.server.lifecycle.ReplyBuffer`; one
    listener task reads the queue and pushes each reply into its uid's buffer, which wakes that
    request's reader, waiting on its own buffer only.

    :meth:`replies` owns a request's state, and frees it (aborting the request) however its
    reader stops. Every other way a request ends early ends it with :meth:`fail`:

    - a reader that stays behind longer than ``slow_reader_timeout_s``, or lets
      ``reply_buffer_size`` replies pile up, is cut off (:meth:`cut_off`), which also catches a
      reader that walked away without closing its generator;
    - a *watchdog* task (:meth:`check`) asks ``health`` a few times a second: once a worker
      process has died, every waiting request ends with an error and new ones are refused
      (HTTP 503), instead of waiting for replies that will never come. So does a listener
      that stopped;
    - :meth:`fail_all` ends every waiting request at once: the server is shutting down.

    Args:
        tokenizers: one outgoing queue per tokenizer worker; request ``uid`` goes to
            ``tokenizers[uid % len(tokenizers)]``, and so does its abort, which therefore can
            never overtake it.
        inbox: the queue the detokenizer sends every :class:`UserReply` to.
        reply_buffer_size: the most replies held for one reader.
        slow_reader_timeout_s: the longest a reader may stay behind.
        health: returns None while every worker runs, else what is wrong; None: not checked.

    Use it from one event loop. :meth:`start` (or the first :meth:`submit`) starts the listener
    and the watchdog; it has to run inside the loop, which is why the app builds the router in
    its lifespan.
    """

    def __init__(self, tokenizers: Sequence[_Outbox], inbox: _Inbox, *,
                 reply_buffer_size: int = DEFAULT_REPLY_BUFFER_SIZE,
                 slow_reader_timeout_s: float = DEFAULT_SLOW_READER_TIMEOUT_S,
                 health: Callable[[], str | None] | None = None) -> None:
        if not tokenizers:
            raise ValueError("RequestRouter needs at least one tokenizer queue")
        self._tokenizers = list(tokenizers)
        self._inbox = inbox
        self.reply_buffer_size = reply_buffer_size
        self.slow_reader_timeout_s = slow_reader_timeout_s
        self._health = health
        self._next_uid = 0
        self._pending: dict[int, ReplyBuffer] = {}
        self._listener: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # abort sends still in flight
        self.stats = FrontendStats()
        self.unavailable: RequestError | None = None  # set once the frontend cannot serve

    @classmethod
    def connect(cls, tokenizer_addrs: Sequence[str], inbox_addr: str,
                **options: Any) -> RequestRouter:
        """A router on real ZMQ queues: it binds ``inbox_addr`` and connects to each
        tokenizer's inbox. ``options`` are the constructor's keyword arguments."""
        from minisgl.utils.queues import ZmqAsyncPullQueue, ZmqAsyncPushQueue

        inbox = ZmqAsyncPullQueue(inbox_addr, FrontendMessage, bind=True)
        tokenizers = [ZmqAsyncPushQueue(addr, TokenizerMessage, bind=False)
                      for addr in tokenizer_addrs]
        return cls(tokenizers, inbox, **options)

    @property
    def num_live(self) -> int:
        """Requests whose replies the frontend still waits for (``/metrics`` shows it)."""
        return len(self._pending)

    @property
    def num_buffered(self) -> int:
        """Replies received and not taken by their readers yet, over all requests."""
        return sum(len(buffer.replies) for buffer in self._pending.values())

    def start(self) -> None:
        """Start the listener and the watchdog (once); call from inside the event loop."""
        if self._listener is None:
            loop = asyncio.get_running_loop()
            self._listener = loop.create_task(self._listen())
            self._watchdog = loop.create_task(self._watch())

    # ----------------------------------------------------------------- requests out
    async def submit(self, params: SamplingParams, *, text: str | None = None,
                     input_ids: list[int] | None = None,
                     messages: list[dict[str, Any]] | None = None,
                     strict_max_tokens: bool = False,
                     tools: list[dict[str, Any]] | None = None) -> int:
        """Number a new request, send it to its tokenizer and return its uid.

        Exactly one of ``text``, ``input_ids`` and ``messages`` is the prompt. Read the replies
        with :meth:`replies` (or :meth:`collect`). ``strict_max_tokens``: the client chose
        ``params.max_tokens``, so a prompt that leaves less room is refused, not shortened.
        ``tools``: with ``messages``, the functions the chat template presents (chapter 22).

        Raises:
            APIError: the server cannot serve (a worker died, it is shutting down: 503).
        """
        if self.unavailable is not None:  # a worker died, the server is shutting down
            raise APIError.of(self.unavailable)
        self.start()
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        request = TokenizeRequest(uid, params, text=text, input_ids=input_ids, messages=messages,
                                  strict_max_tokens=strict_max_tokens, tools=tools)
        # The buffer exists before the request leaves, so no reply can find it missing.
        self._pending[uid] = ReplyBuffer(self.reply_buffer_size)
        try:
            await self._tokenizer_of(uid).put(request)
        except BaseException:
            self._pending.pop(uid, None)
            raise
        self.stats.submitted += 1
        return uid

    def abort(self, uid: int) -> None:
        """Forget request ``uid`` and, unless it has finished, tell the workers to drop it.

        Synchronous on purpose: it is called while a cancelled stream unwinds, where nothing
        may be awaited. The send runs as a task of its own. Aborting a request that is not
        waited on any more (finished, aborted already) does nothing.
        """
        buffer = self._pending.pop(uid, None)
        if buffer is None or buffer.finished:
            return
        self.stats.aborted += 1
        logger.info("aborting request %d", uid)
        self._send_abort(uid)

    def _send_abort(self, uid: int) -> None:
        task = asyncio.get_running_loop().create_task(
            self._tokenizer_of(uid).put(AbortRequest(uid)))
        self._background.add(task)  # a task nobody references may be garbage-collected
        task.add_done_callback(self._background.discard)

    def _tokenizer_of(self, uid: int) -> _Outbox:
        return self._tokenizers[uid % len(self._tokenizers)]

    # ----------------------------------------------------------------- replies in
    async def _listen(self) -> None:
        """The one reader of the inbox: hand each reply to its request's buffer."""
        while True:
            try:  # no bound needed: a dead worker is seen by the watchdog (chapter 16)
                reply = await self._inbox.get()
            except (SerializationError, TypeError) as exc:  # a bad frame: drop it, go on
                logger.error("dropping a message the frontend cannot read: %s", exc)
                continue
            buffer = self._pending.get(reply.uid)
            if buffer is not None and buffer.full:
                # Replies that arrived while the loop was busy come out of the inbox back to
                # back, with no pause for readers (ZMQ hands over what it holds at once): a
                # full buffer is the reader's fault only once it has had a turn to take.
                await asyncio.sleep(0)
            self._dispatch(reply)

    def _dispatch(self, reply: UserReply) -> None:
        buffer = self._pending.get(reply.uid)
        if buffer is None or buffer.failed:  # aborted, failed or finished: nobody waits
            logger.debug("dropping a reply for request %d, which nobody waits for", reply.uid)
            return
        if reply.error is not None:
            self.stats.failed += 1
        if not buffer.push(reply, time.monotonic()):  # the reader is too slow
            self.cut_off(reply.uid, buffer)

    async def replies(self, uid: int) -> AsyncIterator[UserReply]:
        """Request ``uid``'s replies, in order, up to and including its last one.

        This generator owns the request's state. The state is freed as soon as
        the last reply is taken, *before* it is yielded: a caller that stops there (``break``
        on the finished reply) never resumes the generator, and must leave nothing behind.
        Any other way out (the caller breaks early and closes it, a cancelled task, an
        exception) runs the ``finally``, which frees the state and aborts the request.
        """
        buffer = self._pending.get(uid)
        if buffer is None:
            raise KeyError(f"request {uid} is not waiting for replies (finished, aborted, "
                           "or never submitted)")
        try:
            while True:
                await buffer.event.wait()  # set by every reply, and by the watchdog's failure
                for reply in buffer.take():
                    if reply.finished:
                        self._pending.pop(uid, None)
                        if reply.error is None:
                            self.stats.finished += 1
                    yield reply
                    if reply.finished:
                        return
        finally:
            self.abort(uid)  # nothing to do if the last reply was taken

    async def collect(self, uid: int) -> tuple[str, UserReply, list[TextLogprobs]]:
        """Wait for the whole of request ``uid``: its text, its last reply (which carries
        the error, if the request failed) and its tokens' logprobs (chapter 21; none unless
        it asked)."""
        parts: list[str] = []
        logprobs: list[TextLogprobs] = []
        last: UserReply | None = None
        async with aclosing(self.replies(uid)) as replies:
            async for reply in replies:
                parts.append(reply.prompt_text + reply.delta)  # the prompt: echo only
                logprobs += reply.prompt_logprobs
                if reply.logprobs is not None:
                    logprobs.append(reply.logprobs)
                last = reply
        assert last is not None and last.finished, f"request {uid} ended without a last reply"
        return "".join(parts), last, logprobs

    # ----------------------------------------------------------------- ending requests
    def fail(self, uid: int, error: RequestError, *, abort: bool = True) -> None:
        """End request ``uid`` with ``error``: its reader gets it as the last reply, what was
        buffered is dropped, later replies are ignored, and (``abort``) the workers are told
        to drop the request."""
        buffer = self._pending.get(uid)
        if buffer is None or buffer.failed:
            return
        if abort and not buffer.finished:
            self._send_abort(uid)
        buffer.fail(UserReply.failure(uid, error), time.monotonic())
        self.stats.failed += 1

    def cut_off(self, uid: int, buffer: ReplyBuffer) -> None:
        """End request ``uid``, whose reader reads too slowly, and tell the workers."""
        lag = buffer.lag(time.monotonic())
        logger.warning("request %d: its client reads too slowly (%d replies unread, the "
                       "oldest for %.1f s): aborting it", uid, len(buffer.replies), lag)
        self.stats.slow_readers += 1
        self.fail(uid, RequestError(
            f"the client read its stream too slowly: {len(buffer.replies)} replies waited "
            f"unread, the oldest for {lag:.1f} s", status=408, kind="timeout_error",
            code="slow_reader"))

    def fail_all(self, error: RequestError) -> None:
        """End every waiting request with ``error``, and refuse new ones with it.

        For when the server cannot serve any more: a worker died (an abort would go nowhere)
        or the server is shutting down (its workers are stopped next), so no abort is sent.
        """
        if self.unavailable is None:
            self.unavailable = error
            level = logging.INFO if error is SHUTTING_DOWN else logging.ERROR
            if self._pending or level == logging.ERROR:
                logger.log(level, "ending %d waiting request(s): %s", len(self._pending),
                           error.message)
        for uid in list(self._pending):
            self.fail(uid, error, abort=False)

    def check(self, now: float) -> None:
        """What the watchdog does, a few times a second: fail every request if a worker or
        the reply listener has died; cut off readers that have been behind too long; free
        requests whose reader has not even come for the error they were ended with."""
        listener = self._listener  # without it, no reply reaches anyone
        if listener is not None and listener.done() and not listener.cancelled():
            self.fail_all(unavailable_error(f"the API server's reply listener stopped: "
                                            f"{listener.exception()!r}", "listener_died"))
        if self._health is not None and (problem := self._health()) is not None:
            self.fail_all(unavailable_error(problem, "worker_died"))
        for uid, buffer in list(self._pending.items()):
            if buffer.lag(now) <= self.slow_reader_timeout_s:
                continue
            if buffer.failed:  # abandoned: nobody reads this request any more
                self._pending.pop(uid, None)
            else:
                self.cut_off(uid, buffer)

    async def _watch(self) -> None:
        interval = min(0.25, self.slow_reader_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self.check(time.monotonic())
            except Exception:  # the watchdog must outlive a bad health check
                logger.exception("the frontend's watchdog failed")

    async def close(self) -> None:
        """End what still waits (the server is shutting down), stop the listener and the
        watchdog, let the abort sends finish, close the queues."""
        self.fail_all(SHUTTING_DOWN)
        for task in (self._listener, self._watchdog):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._listener = self._watchdog = None
        if self._background:
            await asyncio.wait(self._background, timeout=1.0)
        for queue in (*self._tokenizers, self._inbox):
            close = getattr(queue, "close", None)
            if close is not None:
                close()
