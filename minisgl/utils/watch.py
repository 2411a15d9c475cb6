"""Watching processes: which one exited, and how, noticed the moment it happens.

A process's *exit handle* is a file descriptor that becomes readable when the process exits:
the sentinel ``multiprocessing`` keeps for a child, or a pidfd (Linux) for any other process,
such as a sibling rank (:func:`exit_handle`). :class:`ProcessWatch` waits on those handles in a
thread of its own, so it sees an exit whatever the watching process's main thread is blocked
in (a rendezvous, a collective, loading weights), and calls back once, with the first process
that exited. :func:`describe_exit` says how a process ended, in words.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import psutil

from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

# The exit code of a worker started while its parent's main module was still being imported
# (``processes.start_process`` ends such a worker with it, before it can do any harm); a code
# no library exits with, so that a worker that exits 1, 2 or 3 on its own is not taken for it.
EXIT_STARTED_WHILE_IMPORTING = 87
GUARD_HINT = ('put the code that starts the engine under `if __name__ == "__main__":` '
              "(a spawned process imports the main module again, and must not start it twice)")
# Where there is no pidfd (not Linux), how often a process that is not a child is looked at.
POLL_S = 0.2


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


@dataclass(frozen=True)
class Exited:
    """A watched process that exited: its name, its pid and (for a child) its exit code."""

    name: str
    pid: int
    exitcode: int | None

    def __str__(self) -> str:
        return f"{self.name} (pid {self.pid}) {describe_exit(self.exitcode)}"


Watched = BaseProcess | int  # a child of ours, or any process by its pid


def exit_handle(target: Watched) -> int | None:
    """A descriptor that turns readable when ``target`` exits; None where there is none (a
    non-child without pidfd support: it is polled instead). Raises ProcessLookupError for a
    pid that is already gone."""
    if isinstance(target, BaseProcess):
        return target.sentinel
    return os.pidfd_open(target) if hasattr(os, "pidfd_open") else None


class ProcessWatch:
    """A thread that waits for any watched process to exit and reports the first, once.

    ``on_exit`` runs in the watch's thread, with the :class:`Exited` process; it must be
    quick and thread-safe (set a flag, abort a process group). Watching more processes later
    (:meth:`watch`) wakes the thread, which then waits on them too.
    """

    def __init__(self, on_exit: Callable[[Exited], None], name: str = "minisgl-watch") -> None:
        self._on_exit = on_exit
        self._watched: list[tuple[str, Watched, int | None]] = []
        self._owned: list[int] = []  # the pidfds this watch opened (a sentinel is not ours)
        self._lock = threading.Lock()
        self._wake_read, self._wake_write = os.pipe()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, name: str, target: Watched) -> None:
        """Watch ``target`` (a child process, or a pid), called ``name`` in reports."""
        try:
            handle = exit_handle(target)
        except ProcessLookupError:  # gone before we looked: report it all the same
            handle = None
        with self._lock:
            if handle is not None and not isinstance(target, BaseProcess):
                self._owned.append(handle)
            self._watched.append((name, target, handle))
        os.write(self._wake_write, b"w")

    def stop(self) -> None:
        """Stop watching (no report comes after this returns); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        os.write(self._wake_write, b"s")
        self._thread.join(5.0)  # bound: the thread wakes at once on the pipe
        for fd in (*self._owned, self._wake_read, self._wake_write):
            os.close(fd)

    def _run(self) -> None:
        while not self._stopped:
            with self._lock:
                watched = list(self._watched)
            polled = any(handle is None for _, _, handle in watched)
            handles = [h for _, _, h in watched if h is not None] + [self._wake_read]
            ready = wait(handles, timeout=POLL_S if polled else None)
            if self._wake_read in ready:
                os.read(self._wake_read, 64)
            for name, target, handle in watched:
                if (handle in ready) if handle is not None else not _running(target):
                    if not self._stopped:
                        self._report(name, target)
                    return

    def _report(self, name: str, target: Watched) -> None:
        if isinstance(target, BaseProcess):
            target.join(1.0)  # the sentinel fired: reaping is immediate
            exited = Exited(name, target.pid, target.exitcode)
        else:
            exited = Exited(name, target, None)
        try:
            self._on_exit(exited)
        except Exception:  # the watch must report, whatever its callback does
            logger.exception("reporting that %s failed", exited)


def _running(target: Watched) -> bool:
    """Polled where no exit handle exists: a zombie (exited, not reaped yet) counts as gone."""
    pid = target.pid if isinstance(target, BaseProcess) else target
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
