"""The frontend: the API server's link to the workers, and the state that ties requests to
their replies.

The API server is one asyncio event loop and two ZMQ queues: it pushes a
:class:`~minisgl.message.TokenizeRequest` to a tokenizer worker for every HTTP request, and it
pulls :class:`~minisgl.message.UserReply` messages (new text) from the detokenizer for all of
them at once. :class:`RequestRouter` numbers requests (the *uid*), sends each to tokenizer
``uid % N``, and runs the one *listener* task that reads every reply and hands it to the
request it belongs to (a buffer and an :class:`asyncio.Event` per uid).

It knows nothing of HTTP: :mod:`minisgl.server.api_server` turns its replies into responses,
and the interactive shell (:mod:`minisgl.shell`) uses it directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortRequest,
    FrontendMessage,
    SerializationError,
    TokenizeRequest,
    TokenizerMessage,
    UserReply,
)
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)


# =========================================================================== the frontend
class _Outbox(Protocol):
    async def put(self, message: TokenizerMessage) -> None: ...


class _Inbox(Protocol):
    async def get(self) -> FrontendMessage: ...


@dataclass
class _Pending:
    """A request the frontend is waiting on: replies not read yet, and a flag to wake it."""

    replies: list[UserReply] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class FrontendStats:
    """Counters the frontend keeps for ``/metrics`` (totals since start)."""

    submitted: int = 0
    finished: int = 0
    aborted: int = 0


class RequestRouter:
    """Sends requests to the tokenizer workers and routes every reply to its request.

    Many HTTP requests are in flight at once, but replies come back through a single queue.
    Each request gets a *uid*, a reply buffer and an :class:`asyncio.Event`; one listener task
    reads the queue, appends each reply to its uid's buffer and sets that uid's event, and the
    request's handler, waiting on its own event only, takes its buffer when woken.

    Args:
        tokenizers: one outgoing queue per tokenizer worker; request ``uid`` goes to
            ``tokenizers[uid % len(tokenizers)]``, and so does its abort, which therefore can
            never overtake it.
        inbox: the queue the detokenizer sends every :class:`UserReply` to.

    Use it from one event loop. :meth:`start` (or the first :meth:`submit`) starts the listener;
    it has to run inside the loop, which is why the app builds the router in its lifespan.
    """

    def __init__(self, tokenizers: Sequence[_Outbox], inbox: _Inbox) -> None:
        if not tokenizers:
            raise ValueError("RequestRouter needs at least one tokenizer queue")
        self._tokenizers = list(tokenizers)
        self._inbox = inbox
        self._next_uid = 0
        self._pending: dict[int, _Pending] = {}
        self._listener: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # abort sends still in flight
        self.stats = FrontendStats()

    @classmethod
    def connect(cls, tokenizer_addrs: Sequence[str], inbox_addr: str) -> RequestRouter:
        """A router on real ZMQ queues: it binds ``inbox_addr`` and connects to each
        tokenizer's inbox."""
        from minisgl.utils.queues import ZmqAsyncPullQueue, ZmqAsyncPushQueue

        inbox = ZmqAsyncPullQueue(inbox_addr, FrontendMessage, bind=True)
        tokenizers = [ZmqAsyncPushQueue(addr, TokenizerMessage, bind=False)
                      for addr in tokenizer_addrs]
        return cls(tokenizers, inbox)

    @property
    def num_live(self) -> int:
        """Requests whose replies the frontend still waits for (``/metrics`` shows it)."""
        return len(self._pending)

    def start(self) -> None:
        """Start the listener task (once); call from inside the event loop."""
        if self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(self._listen())
            self._listener.add_done_callback(_report_listener_exit)

    # ----------------------------------------------------------------- requests out
    async def submit(self, params: SamplingParams, *, text: str | None = None,
                     input_ids: list[int] | None = None,
                     messages: list[dict[str, Any]] | None = None) -> int:
        """Number a new request, send it to its tokenizer and return its uid.

        Exactly one of ``text``, ``input_ids`` and ``messages`` is the prompt. Read the replies
        with :meth:`replies` (or :meth:`collect`).
        """
        self.start()
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        request = TokenizeRequest(uid, params, text=text, input_ids=input_ids, messages=messages)
        # The buffer exists before the request leaves, so no reply can find it missing.
        self._pending[uid] = _Pending()
        try:
            await self._tokenizer_of(uid).put(request)
        except BaseException:
            self._pending.pop(uid, None)
            raise
        self.stats.submitted += 1
        return uid

    def abort(self, uid: int) -> None:
        """Forget request ``uid`` and tell the workers to drop it.

        Synchronous on purpose: it is called while a cancelled stream unwinds, where nothing
        may be awaited. The send runs as a task of its own.
        """
        self._pending.pop(uid, None)
        self.stats.aborted += 1
        logger.info("aborting request %d", uid)
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
            try:
                reply = await self._inbox.get()
            except (SerializationError, TypeError) as exc:  # a bad frame: drop it, go on
                logger.error("dropping a message the frontend cannot read: %s", exc)
                continue
            self._dispatch(reply)

    def _dispatch(self, reply: UserReply) -> None:
        pending = self._pending.get(reply.uid)
        if pending is None:  # aborted, or finished already: nobody waits for it
            logger.debug("dropping a reply for request %d, which nobody waits for", reply.uid)
            return
        pending.replies.append(reply)
        pending.event.set()

    async def replies(self, uid: int) -> AsyncIterator[UserReply]:
        """Request ``uid``'s replies, in order, up to and including its last one."""
        pending = self._pending[uid]
        try:
            while True:
                await pending.event.wait()
                # Take the whole buffer at once: replies that arrive while we yield these go
                # into a fresh list and set the event again, so none is missed.
                pending.event.clear()
                batch, pending.replies = pending.replies, []
                for reply in batch:
                    yield reply
                    if reply.finished:
                        self.stats.finished += 1
                        return
        finally:
            self._pending.pop(uid, None)

    async def collect(self, uid: int) -> tuple[str, UserReply]:
        """Wait for the whole of request ``uid``: its text and its last reply."""
        parts: list[str] = []
        last: UserReply | None = None
        async for reply in self.replies(uid):
            parts.append(reply.delta)
            last = reply
        assert last is not None and last.finished, f"request {uid} ended without a last reply"
        return "".join(parts), last

    async def close(self) -> None:
        """Stop the listener, let the abort sends finish, close the queues."""
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        if self._background:
            await asyncio.wait(self._background, timeout=1.0)
        for queue in (*self._tokenizers, self._inbox):
            close = getattr(queue, "close", None)
            if close is not None:
                close()


def _report_listener_exit(task: asyncio.Task[None]) -> None:
    # Without its listener the frontend is deaf: every request would wait for ever. Say so.
    if not task.cancelled() and task.exception() is not None:
        logger.error("the frontend's reply listener died: %r", task.exception())
