"""The queues between the engine's processes.

A queue is a one-way ZMQ PUSH -> PULL channel carrying one family of messages: the blocking
:class:`ZmqPushQueue` / :class:`ZmqPullQueue` serve the workers' loops, the awaited
:class:`ZmqAsyncPushQueue` / :class:`ZmqAsyncPullQueue` the API server's event loop. A queue is
typed with a class that brings ``dumps`` and ``loads`` (a :class:`minisgl.message.Message`
family), so this module imports no message, and both ends check what they carry. A frame holds
one message or a list (``put_many``); the pulling side returns them one by one. Chapter 13 tells
the story.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import re
import shutil
import tempfile
import uuid
from collections import deque
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

T = TypeVar("T")

_SCHEMES = ("ipc://", "tcp://", "inproc://")
# A Unix socket path must fit in sockaddr_un.sun_path: 108 bytes on Linux, 104 on macOS.
_MAX_IPC_PATH = 103


# ---------------------------------------------------------------------------------- addresses
def ipc_address(name: str, directory: str | os.PathLike[str] | None = None) -> str:
    """A fresh ``ipc://`` address for a queue called ``name``.

    The socket file lives in ``directory``, or else in a private temporary directory that this
    process makes on first use and removes when it exits. A random suffix keeps two servers on
    one machine apart.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"ipc_address name must be letters, digits, '_', '.' or '-', "
                         f"got {name!r}")
    base = os.fspath(directory) if directory is not None else _private_ipc_dir()
    path = os.path.join(base, f"{name}-{uuid.uuid4().hex[:8]}")
    if len(path.encode()) > _MAX_IPC_PATH:
        raise ValueError(f"the socket path {path!r} is {len(path.encode())} bytes; a Unix socket "
                         f"path may have at most {_MAX_IPC_PATH}: pass a shorter directory")
    return "ipc://" + path


@functools.cache  # one private directory per process, made on first use
def _private_ipc_dir() -> str:
    path = tempfile.mkdtemp(prefix="minisgl-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache  # once per context
def _wait_for_lingering_frames_at_exit(context: zmq.Context) -> None:
    """Make this process's exit destroy ``context``: a closed socket's frames are delivered
    during its linger only while the context lives on and is then terminated, and Python's exit
    never terminates one (the frames would die with the process)."""
    # destroy() closes the sockets still open, each with its own linger (0 for ours), then
    # terminates the context, which waits for the lingering frames.
    atexit.register(context.destroy)


class _Queue(Generic[T]):
    """What both ends and both flavours share: the socket, the type it carries, closing.

    A subclass names its socket ``_kind`` and, for asyncio, its ``_context`` class.
    """

    _kind: int
    _context: type[zmq.Context] = zmq.Context

    def __init__(self, address: str, message_type: type[T], *, bind: bool) -> None:
        if not isinstance(address, str) or not address.startswith(_SCHEMES):
            raise ValueError(f"a queue address must start with one of {_SCHEMES}, got {address!r}")
        self.address = address
        self.message_type = message_type
        self._socket = self._context.instance().socket(self._kind)
        # Linger 0: closing a socket (or the interpreter exiting) never waits for a peer that
        # may be dead already. A sender that must flush says so in close().
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(address) if bind else self._socket.connect(address)
        except zmq.ZMQError as exc:
            self._socket.close()
            verb = "bind" if bind else "connect"
            raise OSError(f"cannot {verb} a queue to {address}: {exc}") from exc
        self._ready: deque[T] = deque()  # a pull end: the rest of a frame that held several

    def _frame(self, messages: list[Any]) -> bytes:
        self._checked(messages)
        return self.message_type.dumps(messages[0] if len(messages) == 1 else messages)

    def _unframe(self, frame: bytes) -> list[Any]:
        value = self.message_type.loads(frame)
        return self._checked(value if isinstance(value, list) else [value])

    def _checked(self, messages: list[Any]) -> list[Any]:
        for message in messages:
            if not isinstance(message, self.message_type):
                raise TypeError(f"the queue at {self.address} carries "
                                f"{self.message_type.__name__}; got a {type(message).__name__}")
        return messages

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket. Outgoing messages not yet handed to the peer are kept for at most
        ``linger_s`` seconds: 0 (the default) at shutdown, when the peer may be gone; a second
        or two for a sender that exits right after its last ``put``, whose exit then waits for
        them (at most that long)."""
        if not self._socket.closed:
            self._socket.close(linger=int(linger_s * 1000))
            if linger_s > 0:
                _wait_for_lingering_frames_at_exit(self._socket.context)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> Any:
        # A socket cannot cross a process boundary; under spawn, process arguments are pickled.
        raise TypeError(f"a {type(self).__name__} cannot be sent to another process: pass its "
                        f"address ({self.address}) and open a queue there")

    def __repr__(self) -> str:
        return f"{type(self).__name__}[{self.message_type.__name__}]({self.address})"


class ZmqPushQueue(_Queue[T]):
    """The sending end of a queue of ``message_type`` messages.

    Args:
        address: where the queue lives (see :func:`ipc_address`).
        message_type: the class (usually a message family) every message must be.
        bind: True on the end that creates the address; the other end connects. Bind on the
            long-lived receiver, so senders can come and go.
    """

    _kind = zmq.PUSH

    def put(self, message: T) -> None:
        """Send one message. Returns once ZMQ has queued it; the receiver gets it later.

        Bound: it blocks only once ZMQ's send queue is full (1,000 messages) for a receiver that
        stopped reading; a receiver that died is a worker the launcher's watch sees, and the
        launcher then ends this process (SIGTERM, SIGKILL after its grace period).
        """
        self._socket.send(self._frame([message]), copy=False)

    def put_many(self, messages: Iterable[T]) -> None:
        """Send several messages in one frame (one serialization, one wake-up for the peer)."""
        batch = list(messages)
        if batch:
            self._socket.send(self._frame(batch), copy=False)


class ZmqPullQueue(_Queue[T]):
    """The receiving end of a queue of ``message_type`` messages (blocking).

    Messages come out one at a time and in the order they were sent by each sender, whether
    they travelled alone or in a ``put_many`` frame.
    """

    _kind = zmq.PULL

    def get(self, timeout_s: float | None = None) -> T:
        """The next message; waits up to ``timeout_s`` seconds (None: for ever).

        Raises:
            TimeoutError: nothing arrived in time.
        """
        if not self._ready:
            if timeout_s is not None and not self._socket.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no message on {self.address} within {timeout_s} s")
            self._ready.extend(self._unframe(self._socket.recv()))
        return self._ready.popleft()

    def drain(self) -> list[T]:
        """Every message that has already arrived, in order; never waits."""
        while self._socket.poll(0):
            self._ready.extend(self._unframe(self._socket.recv()))
        messages = list(self._ready)
        self._ready.clear()
        return messages


class ZmqAsyncPushQueue(_Queue[T]):
    """:class:`ZmqPushQueue` for an asyncio event loop: ``await queue.put(message)``."""

    _kind = zmq.PUSH
    _context = zmq.asyncio.Context

    async def put(self, message: T) -> None:
        """Send one message; yields to the event loop only if ZMQ's buffer is full."""
        await self._socket.send(self._frame([message]), copy=False)


class ZmqAsyncPullQueue(_Queue[T]):
    """:class:`ZmqPullQueue` for an asyncio event loop: ``message = await queue.get()``.

    While it waits, the event loop runs other coroutines. Use one queue from one event loop.
    """

    _kind = zmq.PULL
    _context = zmq.asyncio.Context

    async def get(self, timeout_s: float | None = None) -> T:
        """The next message; waits up to ``timeout_s`` seconds (None: for ever).

        Raises:
            TimeoutError: nothing arrived in time.
        """
        if not self._ready:
            try:  # wait_for(..., None) waits for ever
                frame = await asyncio.wait_for(self._socket.recv(), timeout_s)
            except asyncio.TimeoutError:  # an alias of TimeoutError from Python 3.11
                raise TimeoutError(f"no message on {self.address} within {timeout_s} s") from None
            self._ready.extend(self._unframe(frame))
        return self._ready.popleft()

