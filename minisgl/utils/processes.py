"""The life of a worker process: started, ready, told to stop, stopped.

:func:`start_process` spawns a worker; each reports once on a queue from
:func:`new_ready_queue` that it is ready or why not (:func:`reporting_readiness`), and
:func:`wait_ready` returns when all are ready or raises with the failed worker's own error.
:class:`ShutdownSignals` turns SIGTERM and SIGINT into a clean return from a worker's loop
(:func:`worker_process` frames it), a worker also returns when its parent dies, and
:func:`stop_processes` signals and reaps them all.
Messages travel on :mod:`minisgl.utils.queues`. Chapter 13 tells the story.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from queue import Empty
from typing import Any, TypeVar

import zmq

from minisgl.utils.logger import get_logger
from minisgl.utils.queues import ZmqPullQueue

logger = get_logger(__name__)

T = TypeVar("T")


# ---------------------------------------------------------------------------------- processes
# Every worker starts in a fresh interpreter ("spawn"), never as a copy of its parent ("fork").
# fork copies the parent's memory but only the thread that called it: the CUDA driver cannot
# run in a forked child once the parent has initialised it, and a lock that another thread
# held at the time (ZMQ's I/O thread, torch's thread pools, logging) stays locked for ever in
# the child. Spawn costs a second or so of start-up and needs a picklable target and arguments;
# it buys a child that holds only what it imports itself.
SPAWN = multiprocessing.get_context("spawn")
# The exit code of a worker started while its parent's main module was still being imported
# (:func:`start_process` ends such a worker with it, before it can do any harm); a code no
# library exits with, so that a worker that exits 1, 2 or 3 on its own is not taken for it.
EXIT_STARTED_WHILE_IMPORTING = 87
GUARD_HINT = ('put the code that starts the engine under `if __name__ == "__main__":` '
              "(a spawned process imports the main module again, and must not start it twice)")


def start_process(target: Callable[..., Any], name: str, *, args: tuple[Any, ...] = (),
                  kwargs: Mapping[str, Any] | None = None) -> BaseProcess:
    """Start ``target(*args, **kwargs)`` in a new process called ``name``, with spawn.

    ``target`` must be importable by name (a module-level function), and ``args``/``kwargs``
    picklable: pass queue addresses, not queues. ``name`` is the process name that the log
    lines show. It is a daemon: it is terminated when its parent exits normally, so
    a crashed launcher leaves fewer orphans behind.

    It runs in a process group of its own. Ctrl-C in a terminal sends SIGINT to every process
    of the foreground group: the parent and, without this, every worker, which would all stop
    at once, whatever the parent meant to do about it (the shell stops one answer, the server
    finishes its requests first). The parent decides alone when its workers stop (it sends
    them SIGTERM).
    """
    if not name:
        raise ValueError("a process needs a name: its log lines show it")
    # A spawned child imports its parent's main module again: a script without the main guard
    # would start its workers a second time, from the child. End the child with a code of its
    # own, which the parent reports with a hint (no report queue exists this early).
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # spawn's bootstrap
        logger.error("not starting %s: this process is still importing its parent's main "
                     "module; %s", name, GUARD_HINT)
        raise SystemExit(EXIT_STARTED_WHILE_IMPORTING)
    process = SPAWN.Process(target=_run_in_own_process_group, name=name, args=(target, *args),
                             kwargs=dict(kwargs or {}), daemon=True)
    process.start()
    logger.debug("started process %s (pid %d)", name, process.pid)
    return process


def _run_in_own_process_group(target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The child's first act, before it imports anything heavy: leave the
    parent's process group (and so the terminal's Ctrl-C), then run ``target``."""
    os.setpgid(0, 0)  # a group of its own, whose id is this process's id
    return target(*args, **kwargs)


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, in words: its exit code, the signal that killed it, or (for a
    process that is not our child, whose code we cannot read) only that it exited."""
    if exitcode is None:
        return "has exited"
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = " (the out-of-memory killer sends it too)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    if exitcode == EXIT_STARTED_WHILE_IMPORTING:
        return (f"exited with code {exitcode}: RuntimeError: An attempt has been made to start "
                "a new process before the current process has finished its bootstrapping phase. "
                f"Hint: {GUARD_HINT}")
    return f"exited with code {exitcode}"


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
    return SPAWN.Queue()


@contextmanager
def reporting_readiness(ready: multiprocessing.Queue, name: str) -> Iterator[None]:
    """Wrap a worker's start-up: report ``ready`` when the block ends, or the error it raised.

    Either report goes on ``ready`` once, tagged with this process's id (which the parent
    knows) and ``name`` (for people). The error's traceback travels as text, so the parent can
    show where the worker failed; the error is then raised again and ends the worker.
    A shutdown signal during start-up is not an error: it is
    passed on without a report.
    """
    try:
        yield
    except ShutdownRequested:
        raise
    except BaseException as exc:
        ready.put((FAILED, os.getpid(), name, "".join(traceback.format_exception(exc))))
        raise
    ready.put((READY, os.getpid(), name, ""))
    logger.info("%s is ready", name)


def wait_ready(queue: multiprocessing.Queue, processes: Sequence[BaseProcess],
               timeout_s: float = 600.0) -> None:
    """Wait until every process in ``processes`` has reported that it is ready.

    Args:
        queue: the queue from :func:`new_ready_queue` the processes were given.
        processes: the workers, started already (an error names one by its process name).
        timeout_s: the most seconds to wait in all (loading a large model takes a while).

    Raises:
        WorkerFailed: a worker reported a start-up error (the message begins with its last
            line, then the traceback), or exited without reporting (how, in words).
        RuntimeError: the time ran out. Either way the other workers are left
            running: stopping them is the caller's decision (usually :func:`stop_processes`).
    """
    waiting = {p.pid: p for p in processes}
    deadline = time.monotonic() + timeout_s
    while waiting:
        try:
            status, pid, reported, text = queue.get(timeout=0.1)
        except Empty:
            # Nobody spoke: has a worker died without a word (killed, or out of memory)?
            dead = [p for p in waiting.values() if not p.is_alive()]
            if dead and queue.empty():
                raise WorkerFailed(f"worker {dead[0].name} (pid {dead[0].pid}) did not get ready: "
                                   f"it {describe_exit(dead[0].exitcode)}")
            if time.monotonic() > deadline:
                late = ", ".join(p.name for p in waiting.values())
                raise RuntimeError(f"worker(s) {late} not ready after {timeout_s:.0f} s")
            continue
        name = waiting.pop(pid).name if pid in waiting else reported
        if status == FAILED:
            error = text.strip().splitlines()[-1]  # the traceback's last line, shown first
            raise WorkerFailed(f"worker {name} (pid {pid}) failed to start: {error}\n"
                               f"{text.rstrip()}")
        logger.debug("worker %s (pid %d) is ready", reported, pid)  # the name it gave itself


class WorkerFailed(RuntimeError):
    """A worker reported a start-up error, or exited, before it was ready."""


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
        for sig in (signal.SIGTERM, signal.SIGINT):  # a worker's main runs in its main thread
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

    def receive(self, queue: ZmqPullQueue[T], poll_s: float = 0.1) -> list[T]:
        """Every message that has arrived on ``queue``, once one has, however long it takes,
        unless a shutdown signal comes first (then :class:`ShutdownRequested` is raised).

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
                    return [queue.get(timeout_s=poll_s), *queue.drain()]
                except TimeoutError:
                    if self.orphaned:
                        raise ShutdownRequested("the parent process has exited") from None


@contextmanager
def worker_process(name: str) -> Iterator[ShutdownSignals]:
    """A worker's main, around its start-up and loop: yields its :class:`ShutdownSignals`.

    A :class:`ShutdownRequested` ends the block quietly; however it ends, every queue the
    process opened is closed (linger 0: frames not handed over yet are dropped), and so is its
    ZMQ context, which would otherwise wait for the sockets for ever.
    """
    signals = ShutdownSignals()
    try:
        yield signals
    except ShutdownRequested:
        pass
    finally:
        zmq.Context.instance().destroy(linger=0)
    logger.info("%s stopped", name)


def stop_processes(processes: Iterable[BaseProcess], timeout_s: float = 5.0) -> None:
    """Ask every process to stop (SIGTERM, which a worker turns into a clean return), then
    reap each with :func:`stop_process` (which kills what does not exit in time)."""
    processes = list(processes)
    for process in processes:
        process.terminate()  # nothing happens to one that has exited
    for process in processes:
        stop_process(process, timeout_s)
