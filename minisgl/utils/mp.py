"""Processes and the queues between them.

The served engine is four kinds of process (API server, tokenizer, scheduler, detokenizer).
This module holds what they share to talk and to live:

- **Queues.** A one-way ZMQ PUSH -> PULL channel carrying one family of messages, serialized
  with the codec of the class it is typed with (``message_type.dumps`` and ``.loads``; every
  :class:`minisgl.message.Message` brings msgpack's, so this module imports no message).
  :class:`ZmqPushQueue` / :class:`ZmqPullQueue` block (the workers' loops);
  :class:`ZmqAsyncPushQueue` / :class:`ZmqAsyncPullQueue` are awaited (the API server's event
  loop). Both ends name the message class they carry and check it, so a message
  sent to the wrong process fails at once, with both names in the error.
- **Addresses.** :func:`ipc_address` makes a fresh ``ipc://`` address (a Unix socket file) in a
  private temporary directory.
- **Processes.** :func:`start_process` starts a worker with the *spawn* start method;
  :func:`stop_process` makes sure it is gone and reaped.
- **Readiness.** Each worker reports once, on a queue from :func:`new_ready_queue`,
  that it is ready or why it could not start (:func:`reporting_readiness`); the parent's
  :func:`wait_ready` returns when all are ready and raises, with the worker's traceback, when one
  fails or dies first.
- **Counters.** :class:`SharedCounters`: named integers in shared memory that a
  worker writes after each step and the API server reads for ``/metrics``.
- **Shutdown.** :class:`ShutdownSignals` turns SIGTERM and SIGINT into a clean return from a
  worker's loop; :func:`stop_processes` sends the signal and reaps every worker. A worker also
  returns when its parent has died, busy or not, and
  ``start_process(..., own_process_group=True)`` keeps a terminal's Ctrl-C for the parent.

A frame (one ZMQ message) holds one message or a list of them (``put_many``); the pulling side
returns them one by one, so a receiver never unwraps batches itself.
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from queue import Empty
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

T = TypeVar("T")

_SCHEMES = ("ipc://", "tcp://", "inproc://")
# A Unix socket path must fit in sockaddr_un.sun_path: 108 bytes on Linux, 104 on macOS.
_MAX_IPC_PATH = 103


# ---------------------------------------------------------------------------------- addresses
_ipc_dir: str | None = None  # this process's private directory, made on first use


def ipc_address(name: str, directory: str | os.PathLike[str] | None = None) -> str:
    """A fresh ``ipc://`` address for a queue called ``name``.

    The socket file lives in ``directory``, or else in a private temporary directory that this
    process makes on first use and removes when it exits. A random suffix keeps two addresses
    (and two servers on one machine) apart. Pass the address string to the child processes;
    each opens its own end of the queue.
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


def _private_ipc_dir() -> str:
    global _ipc_dir
    if _ipc_dir is None:
        _ipc_dir = tempfile.mkdtemp(prefix="minisgl-")
        atexit.register(shutil.rmtree, _ipc_dir, ignore_errors=True)
    return _ipc_dir


def _open_socket(context: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    if not isinstance(address, str) or not address.startswith(_SCHEMES):
        raise ValueError(f"a queue address must start with one of {_SCHEMES}, got {address!r}")
    socket = context.socket(kind)
    # Linger 0: closing a socket (or the interpreter exiting) never waits for a peer that may
    # be dead already. A sender that must flush says so in close().
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.bind(address) if bind else socket.connect(address)
    except zmq.ZMQError as exc:
        socket.close()
        verb = "bind" if bind else "connect"
        raise OSError(f"cannot {verb} a queue to {address}: {exc}") from exc
    return socket


def _check_type(message: Any, message_type: type, address: str) -> None:
    if not isinstance(message, message_type):
        raise TypeError(f"the queue at {address} carries {message_type.__name__}; "
                        f"got a {type(message).__name__}")


def _frame(messages: list[Any], message_type: type, address: str) -> bytes:
    for message in messages:
        _check_type(message, message_type, address)
    return message_type.dumps(messages[0] if len(messages) == 1 else messages)


def _unframe(frame: bytes, message_type: type, address: str) -> list[Any]:
    value = message_type.loads(frame)
    messages = value if isinstance(value, list) else [value]
    for message in messages:
        _check_type(message, message_type, address)
    return messages


class _Queue:
    """What both ends and both flavours share: the socket, the type it carries, closing."""

    _socket: zmq.Socket

    def __init__(self, context: zmq.Context, kind: int, address: str,
                 message_type: type, bind: bool) -> None:
        if not (isinstance(message_type, type) and callable(getattr(message_type, "dumps", None))
                and callable(getattr(message_type, "loads", None))):
            raise TypeError(f"message_type must be a class with dumps() and loads() (a message "
                            f"family), got {message_type!r}")
        self.address = address
        self.message_type = message_type
        self._socket = _open_socket(context, kind, address, bind)

    @property
    def closed(self) -> bool:
        return self._socket.closed

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket. Outgoing messages not yet handed to the peer are kept for at most
        ``linger_s`` seconds: 0 (the default) at shutdown, when the peer may be gone; a second
        or two for a sender that exits right after its last ``put``."""
        if not self._socket.closed:
            self._socket.close(linger=int(linger_s * 1000))

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


class ZmqPushQueue(_Queue, Generic[T]):
    """The sending end of a queue of ``message_type`` messages.

    Args:
        address: where the queue lives (see :func:`ipc_address`).
        message_type: the class (usually a message family) every message must be.
        bind: True on the end that creates the address; the other end connects. Bind on the
            long-lived receiver, so senders can come and go.
    """

    def __init__(self, address: str, message_type: type[T], *, bind: bool) -> None:
        super().__init__(zmq.Context.instance(), zmq.PUSH, address, message_type, bind)

    def put(self, message: T) -> None:
        """Send one message. Returns once ZMQ has queued it; the receiver gets it later."""
        self._socket.send(_frame([message], self.message_type, self.address), copy=False)

    def put_many(self, messages: Iterable[T]) -> None:
        """Send several messages in one frame (one serialization, one wake-up for the peer)."""
        batch = list(messages)
        if batch:
            self._socket.send(_frame(batch, self.message_type, self.address), copy=False)


class ZmqPullQueue(_Queue, Generic[T]):
    """The receiving end of a queue of ``message_type`` messages (blocking).

    Messages come out one at a time and in the order they were sent by each sender, whether
    they travelled alone or in a ``put_many`` frame.
    """

    def __init__(self, address: str, message_type: type[T], *, bind: bool) -> None:
        super().__init__(zmq.Context.instance(), zmq.PULL, address, message_type, bind)
        self._ready: deque[T] = deque()  # the rest of a frame that held several messages

    def get(self, timeout_s: float | None = None) -> T:
        """The next message; waits up to ``timeout_s`` seconds (None: for ever).

        Raises:
            TimeoutError: nothing arrived in time.
        """
        if not self._ready:
            if timeout_s is not None and not self._socket.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no message on {self.address} within {timeout_s} s")
            self._receive(self._socket.recv())
        return self._ready.popleft()

    def drain(self) -> list[T]:
        """Every message that has already arrived, in order; never waits."""
        while self._socket.poll(0):
            self._receive(self._socket.recv())
        messages = list(self._ready)
        self._ready.clear()
        return messages

    def empty(self) -> bool:
        """True when :meth:`get` would have to wait."""
        return not self._ready and not self._socket.poll(0)

    def _receive(self, frame: bytes) -> None:
        self._ready.extend(_unframe(frame, self.message_type, self.address))


class ZmqAsyncPushQueue(_Queue, Generic[T]):
    """:class:`ZmqPushQueue` for an asyncio event loop: ``await queue.put(message)``."""

    def __init__(self, address: str, message_type: type[T], *, bind: bool) -> None:
        super().__init__(zmq.asyncio.Context.instance(), zmq.PUSH, address, message_type, bind)

    async def put(self, message: T) -> None:
        """Send one message; yields to the event loop only if ZMQ's buffer is full."""
        await self._socket.send(_frame([message], self.message_type, self.address), copy=False)

    async def put_many(self, messages: Iterable[T]) -> None:
        """Send several messages in one frame."""
        batch = list(messages)
        if batch:
            await self._socket.send(_frame(batch, self.message_type, self.address), copy=False)


class ZmqAsyncPullQueue(_Queue, Generic[T]):
    """:class:`ZmqPullQueue` for an asyncio event loop: ``message = await queue.get()``.

    While it waits, the event loop runs other coroutines (other HTTP requests): that is the
    point of the async flavour. Use one queue from one event loop.
    """

    def __init__(self, address: str, message_type: type[T], *, bind: bool) -> None:
        super().__init__(zmq.asyncio.Context.instance(), zmq.PULL, address, message_type, bind)
        self._ready: deque[T] = deque()

    async def get(self, timeout_s: float | None = None) -> T:
        """The next message; waits up to ``timeout_s`` seconds (None: for ever).

        Raises:
            TimeoutError: nothing arrived in time.
        """
        if not self._ready:
            if timeout_s is None:
                frame = await self._socket.recv()
            else:
                try:
                    frame = await asyncio.wait_for(self._socket.recv(), timeout_s)
                except asyncio.TimeoutError:  # an alias of TimeoutError from Python 3.11
                    raise TimeoutError(f"no message on {self.address} within {timeout_s} s"
                                       ) from None
            self._ready.extend(_unframe(frame, self.message_type, self.address))
        return self._ready.popleft()


def close_queues(*queues: _Queue | None) -> None:
    """A worker's last act: close the queues it opened (None for one it never got to), then
    the process's ZMQ context, which would otherwise wait for its sockets forever."""
    for queue in queues:
        if queue is not None:
            queue.close()  # linger 0: frames not handed over yet are dropped
    zmq.Context.instance().term()


# ---------------------------------------------------------------------------------- processes
# Every worker starts in a fresh interpreter ("spawn"), never as a copy of its parent ("fork").
# fork copies the parent's memory but only the thread that called it: the CUDA driver cannot
# run in a forked child once the parent has initialised it, and a lock that another thread
# held at the time (ZMQ's I/O thread, torch's thread pools, logging) stays locked for ever in
# the child. Spawn costs a second or so of start-up and needs a picklable target and arguments;
# it buys a child that holds only what it imports itself.
_SPAWN = multiprocessing.get_context("spawn")


def start_process(target: Callable[..., Any], name: str, *, args: tuple[Any, ...] = (),
                  kwargs: Mapping[str, Any] | None = None, daemon: bool = True,
                  own_process_group: bool = False) -> BaseProcess:
    """Start ``target(*args, **kwargs)`` in a new process called ``name``, with spawn.

    ``target`` must be importable by name (a module-level function), and ``args``/``kwargs``
    picklable: pass queue addresses, not queues. ``name`` is the process name that the log
    lines show. A daemon process (the default) is terminated when its parent exits normally, so
    a crashed launcher leaves fewer orphans behind.

    ``own_process_group`` puts the process in a process group of its own. Ctrl-C
    in a terminal sends SIGINT to every process of the foreground group: the parent and,
    without this, every worker, which would all stop at once, whatever the parent meant to do
    about it (the shell stops one answer, the server finishes its requests first). The parent
    then decides alone when its workers stop (it sends them SIGTERM).
    """
    if not name:
        raise ValueError("a process needs a name: its log lines show it")
    if own_process_group:
        args, target = (target, *args), _run_in_own_process_group
    process = _SPAWN.Process(target=target, name=name, args=args, kwargs=dict(kwargs or {}),
                             daemon=daemon)
    process.start()
    logger.debug("started process %s (pid %d)", name, process.pid)
    return process


def _run_in_own_process_group(target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The child's first act, before it imports anything heavy: leave the parent's process
    group (and so the terminal's Ctrl-C), then run ``target``."""
    os.setpgid(0, 0)  # a group of its own, whose id is this process's id
    return target(*args, **kwargs)


def stop_process(process: BaseProcess, timeout_s: float = 5.0) -> int | None:
    """Wait for ``process`` to exit, escalating if it does not; returns its exit code.

    Waits ``timeout_s`` seconds for a clean exit, then sends SIGTERM and waits again, then
    SIGKILL. The process is always reaped (joined), so it does not linger as a zombie. The exit
    code is negative when a signal ended the process (-15 for SIGTERM, -9 for SIGKILL).
    """
    process.join(timeout_s)
    if process.is_alive():
        logger.warning("process %s did not exit within %.1f s: terminating it",
                       process.name, timeout_s)
        process.terminate()
        process.join(timeout_s)
    if process.is_alive():
        logger.warning("process %s ignored SIGTERM: killing it", process.name)
        process.kill()
        process.join()
    return process.exitcode


# ---------------------------------------------------------------------------------- readiness
READY = "ready"
FAILED = "failed"


def new_ready_queue() -> multiprocessing.Queue:
    """A queue the workers report their start-up on; pass it to each as its ``ready`` argument.

    It comes from the spawn context, like the workers, so it can be handed to them.
    """
    return _SPAWN.Queue()


@contextmanager
def reporting_readiness(ready: multiprocessing.Queue | None, name: str) -> Iterator[None]:
    """Wrap a worker's start-up: report ``ready`` when the block ends, or the error it raised.

    Either report goes on ``ready`` once, tagged with this process's id (which the parent
    knows) and ``name`` (for people). The error's traceback travels as text, so the parent can
    show where the worker failed; the error is then raised again and ends the worker.
    ``ready=None`` reports nothing. A shutdown signal during start-up is not an error: it is
    passed on without a report.
    """
    try:
        yield
    except ShutdownRequested:
        raise
    except BaseException as exc:
        if ready is not None:
            text = "".join(traceback.format_exception(exc))
            ready.put((FAILED, os.getpid(), name, text))
        raise
    if ready is not None:
        ready.put((READY, os.getpid(), name, ""))
    logger.info("%s is ready", name)


def wait_ready(queue: multiprocessing.Queue, processes: Sequence[BaseProcess],
               names: Sequence[str] | None = None, timeout_s: float = 600.0) -> None:
    """Wait until every process in ``processes`` has reported that it is ready.

    Args:
        queue: the queue from :func:`new_ready_queue` the processes were given.
        processes: the workers, started already.
        names: what to call each process in an error (default: its process name).
        timeout_s: the most seconds to wait in all (loading a large model takes a while).

    Raises:
        RuntimeError: a worker reported a start-up error (its traceback is in the message), a
            worker exited without reporting, or the time ran out. The other workers are left
            running: stopping them is the caller's decision (usually :func:`stop_processes`).
    """
    names = [p.name for p in processes] if names is None else list(names)
    if len(names) != len(processes):
        raise ValueError(f"{len(names)} names for {len(processes)} processes")
    waiting = {p.pid: (p, name) for p, name in zip(processes, names)}
    deadline = time.monotonic() + timeout_s
    while waiting:
        try:
            status, pid, reported, text = queue.get(timeout=0.1)
        except Empty:
            # Nobody spoke: has a worker died without a word (killed, or out of memory)?
            dead = [(p, name) for p, name in waiting.values() if not p.is_alive()]
            if dead and queue.empty():
                process, name = dead[0]
                raise RuntimeError(f"worker {name} (pid {process.pid}) exited with code "
                                   f"{process.exitcode} before it was ready")
            if time.monotonic() > deadline:
                late = ", ".join(name for _, name in waiting.values())
                raise RuntimeError(f"worker(s) {late} not ready after {timeout_s:.0f} s")
            continue
        _, name = waiting.pop(pid, (None, reported))
        if status == FAILED:
            raise RuntimeError(f"worker {name} (pid {pid}) failed to start:\n{text.rstrip()}")
        logger.debug("worker %s (pid %d) is ready", name, pid)


# ---------------------------------------------------------------------------------- counters
class SharedCounters:
    """Named 64-bit integers in shared memory: one process writes them, others read them.

    The workers publish their state this way (the scheduler: requests running and waiting, KV
    pages in use, tokens served) and the API server reads it for ``/metrics``, without a
    message and without asking. Make it in the parent, before starting the worker, and pass it
    to the worker as an argument: the memory is shared, not copied.

    A lock keeps a group of values written together (:meth:`update`) consistent for a reader
    that takes them together (:meth:`snapshot`).
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        if not self.names or len(set(self.names)) != len(self.names):
            raise ValueError(f"counters need distinct names, got {self.names!r}")
        self._index = {name: i for i, name in enumerate(self.names)}
        self._values = _SPAWN.Array("q", len(self.names))  # "q": signed 64-bit, zeroed

    def update(self, **values: int) -> None:
        """Set the named counters, all at once."""
        with self._values.get_lock():
            for name, value in values.items():
                self._values[self._slot(name)] = value

    def add(self, **deltas: int) -> None:
        """Add to the named counters (totals: tokens served so far)."""
        with self._values.get_lock():
            for name, delta in deltas.items():
                self._values[self._slot(name)] += delta

    def __getitem__(self, name: str) -> int:
        return self._values[self._slot(name)]

    def snapshot(self) -> dict[str, int]:
        """Every counter, read at one instant."""
        with self._values.get_lock():
            return dict(zip(self.names, self._values[:]))

    def _slot(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no counter named {name!r}; the counters are "
                           f"{', '.join(self.names)}") from None

    def __repr__(self) -> str:
        return f"SharedCounters({self.snapshot()})"


# ---------------------------------------------------------------------------------- shutdown
class ShutdownRequested(BaseException):
    """Raised in a worker that got SIGTERM or SIGINT while it was waiting (or starting).

    A BaseException, like KeyboardInterrupt: an ``except Exception`` somewhere in the
    libraries it runs through must not swallow it.
    """


class ShutdownSignals:
    """SIGTERM and SIGINT as a clean way out of a worker's loop.

    A worker makes one at the top of its main function (it installs the handlers) and checks
    :attr:`requested` between two pieces of work. A signal that arrives while the worker is
    inside :meth:`interruptible` (loading a model, waiting in :meth:`receive` for its next
    message) raises :class:`ShutdownRequested` there, so an idle worker does not wait for a
    message that will never come; elsewhere it only sets the flag, so a step is never cut in
    half.
    """

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self._interruptible = False
        self._parent = os.getppid()
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)

    @property
    def requested(self) -> bool:
        """A shutdown signal came, or the parent has died.

        A busy worker never waits in :meth:`receive`, where an idle one notices its parent's
        death; checking here, once per turn of its loop, makes a busy worker notice too, so a
        launcher killed with SIGKILL (no clean-up of its own) leaves no worker running for
        nobody.
        """
        return self.signum is not None or self.orphaned

    @property
    def orphaned(self) -> bool:
        """The process that started this one has exited (we were handed to another parent)."""
        return os.getppid() != self._parent

    def _on_signal(self, signum: int, frame: Any) -> None:
        first = self.signum is None
        self.signum = signum
        if first and self._interruptible:
            raise ShutdownRequested(signal.Signals(signum).name)

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block a shutdown signal may interrupt (raising :class:`ShutdownRequested`)."""
        if self.requested:
            raise ShutdownRequested(signal.Signals(self.signum).name if self.signum is not None
                                    else "the parent process has exited")
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def receive(self, queue: ZmqPullQueue[T], poll_s: float = 0.1) -> T:
        """The next message on ``queue``, however long it takes, unless a shutdown signal
        comes first (then :class:`ShutdownRequested` is raised).

        Why not one blocking ``get``: the kernel may hand the signal to any thread of the
        process (torch's, the tokenizer library's), and then the main thread's wait is not
        interrupted; Python runs the handler only once the main thread runs Python code again.
        Waking every ``poll_s`` seconds gives it that chance. It is also the moment to notice
        that the parent has died without stopping us (killed with SIGKILL): an orphan worker
        shuts down too, instead of waiting for ever.
        """
        with self.interruptible():
            while True:
                try:
                    return queue.get(timeout_s=poll_s)
                except TimeoutError:
                    if self.orphaned:
                        raise ShutdownRequested("the parent process has exited") from None


def stop_processes(processes: Iterable[BaseProcess], timeout_s: float = 5.0) -> None:
    """Ask every process to stop (SIGTERM, which a worker turns into a clean return), then
    reap each with :func:`stop_process` (which kills what does not exit in time)."""
    processes = list(processes)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        stop_process(process, timeout_s)
