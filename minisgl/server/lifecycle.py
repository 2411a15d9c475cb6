"""What the API server needs to end every request, whatever happens to it.

- :class:`ReplyBuffer`: one request's replies its reader has not taken yet, bounded, with the
  time since its reader fell behind;
- :class:`LifecyclePolicy`: when a request must end before its last reply (a slow reader, a
  dead worker or listener, shutdown), and with what error. The router routes; the policy
  decides, and ends requests through the router, which it sees only as :class:`Router`;
- :func:`wait_or_disconnect`: wait for something unless the HTTP client goes away first;
- the errors the API server itself ends requests with, shaped as a worker's
  :class:`~minisgl.message.RequestError`.

Chapter 16 tells the story.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from minisgl.message import RequestError, UserReply
from minisgl.server.protocol import APIError
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

T = TypeVar("T")

DEFAULT_REPLY_BUFFER_SIZE = 1024  # replies (about one per token) held for one slow reader
DEFAULT_SLOW_READER_TIMEOUT_S = 30.0  # how long a reader may stay behind before it is cut off


@dataclass
class ReplyBuffer:
    """One request's replies that its reader has not taken yet: at most ``capacity``.

    The listener :meth:`push`-es replies in; the reader waits on :attr:`event` and
    :meth:`take`-s everything at once. The buffer also keeps the time its oldest reply
    arrived: :meth:`lag` says how long the reader has been behind. A reader that keeps up takes
    each reply within a turn of the event loop, so its lag stays near zero; a client that does
    not read (its socket is full, so the response cannot be written, so the reader does not
    come back for more) lets the lag grow, and the buffer fill.

    Time is passed in (``now``, seconds on any monotonic clock), so the policy can be tested
    without waiting.

    Attributes:
        capacity: the most replies held.
        replies: the replies not taken yet, oldest first.
        event: set while there are replies to take.
        behind_since: when the oldest reply not taken yet arrived; None when there is none.
        finished: the request's last reply has arrived (or the server ended the request).
        failed: the server ended the request with an error (:meth:`fail`).
    """

    capacity: int
    replies: deque[UserReply] = field(default_factory=deque)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    behind_since: float | None = None
    finished: bool = False
    failed: bool = False

    @property
    def full(self) -> bool:
        """Whether the next :meth:`push` would find no room."""
        return len(self.replies) >= self.capacity

    def push(self, reply: UserReply, now: float) -> bool:
        """Keep ``reply`` for the reader and wake it. False when the buffer is full: the
        reply is not kept, and the reader is too slow to be served."""
        if self.full:
            return False
        if not self.replies:
            self.behind_since = now
        self.replies.append(reply)
        self.finished = self.finished or reply.finished
        self.event.set()
        return True

    def take(self) -> list[UserReply]:
        """Every reply not taken yet, oldest first; the reader has caught up."""
        batch = list(self.replies)
        self.replies.clear()
        self.behind_since = None
        self.event.clear()
        return batch

    def lag(self, now: float) -> float:
        """Seconds the oldest reply not taken yet has waited (0 when there is none)."""
        return 0.0 if self.behind_since is None else max(0.0, now - self.behind_since)

    def fail(self, reply: UserReply, now: float) -> None:
        """End the request with ``reply`` (an error): what is buffered is dropped, and the
        reader's next :meth:`take` gets the error alone."""
        self.replies.clear()
        self.replies.append(reply)
        self.behind_since = now
        self.finished = self.failed = True
        self.event.set()


def unavailable_error(reason: str, code: str) -> RequestError:
    """The error every waiting request gets when the server cannot serve any more: a worker
    process died, the reply listener stopped, the server is shutting down."""
    return RequestError(reason, status=503, kind="server_error", code=code)


SHUTTING_DOWN = unavailable_error("the server is shutting down", "shutting_down")


class Router(Protocol):
    """What the policy needs of :class:`~minisgl.server.frontend.RequestRouter`; a protocol,
    so that this module does not import the router, which imports it."""

    @property
    def buffers(self) -> Mapping[int, ReplyBuffer]: ...

    @property
    def listener_error(self) -> BaseException | None: ...

    def fail(self, uid: int, error: RequestError, *, abort: bool = True) -> None: ...

    def forget(self, uid: int) -> None: ...


class LifecyclePolicy:
    """Ends every request whose last reply will not come, or should not be waited for.

    The router delivers replies and never decides that a request is over before its last
    one; this class does, and ends it with :meth:`RequestRouter.fail
    <minisgl.server.frontend.RequestRouter.fail>`:

    - a reader that stays behind longer than ``slow_reader_timeout_s``, or lets
      ``reply_buffer_size`` replies pile up (the router calls :meth:`cut_off` when a reply
      finds no room), has its request ended with an error (which also catches a reader that
      walked away without closing its generator);
    - a *watchdog* task checks ``health`` a few times a second: once a worker process has
      died, every waiting request ends with an error and new ones are refused (HTTP 503),
      instead of waiting for replies that will never come. So does a listener that stopped;
    - :meth:`fail_all` ends every waiting request at once: the server is shutting down.

    Args:
        router: the router whose requests it watches (the router makes its own policy).
        reply_buffer_size: the most replies held for one reader.
        slow_reader_timeout_s: the longest a reader may stay behind.
        health: returns None while every worker runs, else what is wrong; None: not checked.
    """

    def __init__(self, router: Router, *,
                 reply_buffer_size: int = DEFAULT_REPLY_BUFFER_SIZE,
                 slow_reader_timeout_s: float = DEFAULT_SLOW_READER_TIMEOUT_S,
                 health: Callable[[], str | None] | None = None) -> None:
        self.router = router
        self.reply_buffer_size = reply_buffer_size
        self.slow_reader_timeout_s = slow_reader_timeout_s
        self._health = health
        self._watchdog: asyncio.Task[None] | None = None
        self.unavailable: RequestError | None = None  # set once the frontend cannot serve
        self.slow_readers = 0  # requests cut off for reading too slowly, for /metrics

    def admit(self) -> ReplyBuffer:
        """A new request's reply buffer, or (once the server cannot serve) its refusal.

        Raises:
            APIError: a worker died, the listener stopped, the server is shutting down (503).
        """
        if self.unavailable is not None:
            raise APIError.of(self.unavailable)
        return ReplyBuffer(self.reply_buffer_size)

    def cut_off(self, uid: int, buffer: ReplyBuffer) -> None:
        """End request ``uid``, whose reader reads too slowly, and tell the workers."""
        lag = buffer.lag(time.monotonic())
        logger.warning("request %d: its client reads too slowly (%d replies unread, the "
                       "oldest for %.1f s): aborting it", uid, len(buffer.replies), lag)
        self.slow_readers += 1
        self.router.fail(uid, RequestError(
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
            waiting = len(self.router.buffers)
            if waiting or level == logging.ERROR:
                logger.log(level, "ending %d waiting request(s): %s", waiting, error.message)
        for uid in list(self.router.buffers):
            self.router.fail(uid, error, abort=False)

    def check(self, now: float) -> None:
        """What the watchdog does, a few times a second: fail every request if a worker or
        the reply listener has died; cut off readers that have been behind too long; free
        requests whose reader has not even come for the error they were ended with."""
        stopped = self.router.listener_error
        if stopped is not None:
            self.fail_all(unavailable_error(
                f"the API server's reply listener stopped: {stopped!r}", "listener_died"))
        problem = self._health() if self._health is not None else None
        if problem is not None:
            self.fail_all(unavailable_error(problem, "worker_died"))
        for uid, buffer in list(self.router.buffers.items()):
            if buffer.lag(now) <= self.slow_reader_timeout_s:
                continue
            if buffer.failed:  # abandoned: nobody reads this request any more
                self.router.forget(uid)
            else:
                self.cut_off(uid, buffer)

    def start(self) -> None:
        """Start the watchdog (once); call from inside the event loop."""
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        interval = min(0.25, self.slow_reader_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self.check(time.monotonic())
            except Exception:  # the watchdog must outlive a bad health check
                logger.exception("the frontend's watchdog failed")

    async def close(self) -> None:
        """End what still waits (the server is shutting down) and stop the watchdog."""
        self.fail_all(SHUTTING_DOWN)
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


class _Request(Protocol):
    async def receive(self) -> dict[str, Any]: ...


async def wait_for_disconnect(request: _Request) -> None:
    """Return when the client of ``request`` disconnects.

    The request's body has been read already, so the only message the server can still
    receive for it is ``http.disconnect``: waiting for it costs nothing (no polling), and it
    comes as soon as the connection closes.
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_or_disconnect(awaitable: Awaitable[T], request: _Request) -> T:
    """The result of ``awaitable``, unless ``request``'s client disconnects first.

    Raises:
        ClientDisconnected: the client went first. ``awaitable`` has been cancelled by then,
            and has finished unwinding: whatever it held (a request's reply buffer, its place
            in the scheduler, through the ``finally`` of the replies it was reading) is freed.
    """
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this coroutine itself is cancelled (the server shutting down)
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()
