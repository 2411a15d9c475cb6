"""What the API server needs to end every request, whatever happens to it.

- :class:`ReplyBuffer`: one request's replies its reader has not taken yet, bounded, with the
  time since its reader fell behind (the router cuts off a reader that stays behind);
- :func:`wait_or_disconnect`: wait for something unless the HTTP client goes away first;
- the errors the API server itself ends requests with, shaped as a worker's
  :class:`~minisgl.message.RequestError`.

Chapter 16 tells the story.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from minisgl.message import RequestError, UserReply

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

    Time is passed in (``now``, seconds on any monotonic clock), so the rules can be tested
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
