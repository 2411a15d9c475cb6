"""The other ranks: meeting them, watching them, and giving up on them at once.

- **rendezvous** (:func:`rendezvous`): rank 0 serves a ``TCPStore`` at the group's address, every
  rank writes its pid there and waits, in short polls, until all ``size`` pids are in. Between
  two polls it looks at what could end the wait early: the group aborted (a rank that
  exited), its own parent gone, a signal. Torch's own rendezvous waits for the timeout instead.
- **watching** (:func:`watch_peers`): once the pids are known, a :class:`ProcessWatch` looks
  at every other rank, in a thread of its own, so it sees an exit whatever the main thread is
  blocked in (the rendezvous, a collective, loading weights);
- **abort** (:func:`abort_tp_group`): what the watch calls when a rank exits, the same on every
  backend. Every collective this rank calls from then on raises :class:`PeerExited`; under
  NCCL the communicator is aborted too, which wakes a rank blocked in a collective with the
  dead one (a host waiting for the device, in ``.item()`` or an event, returns then too).
  Gloo needs no more: its socket to the dead rank fails the collective first.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.process import BaseProcess
from urllib.parse import urlsplit

import psutil
import torch.distributed as dist

from minisgl.utils.logger import get_logger
from minisgl.utils.processes import describe_exit

logger = get_logger(__name__)

POLL_S = 0.05  # how often a rank looks for the others: in the rendezvous, and in the watch
STORE_KNOCK_S = 1.0  # one attempt to reach rank 0's store; repeated until the deadline


class PeerExited(RuntimeError):
    """Another rank of the group exited: this rank cannot take part in a collective again."""


PEER_EXIT_WAIT_S = 1.0  # a dead peer's socket can fail a collective a moment before its exit

_abort_reason: str | None = None  # why this process gave up on its group, if it did
_aborted = threading.Event()  # set with _abort_reason
_abort_lock = threading.Lock()  # two watches may see two exits at once
_watch: ProcessWatch | None = None  # the watch over the other ranks, while in a group


def abort_tp_group(reason: str) -> None:
    """Give up on the group, for ``reason`` (the rank that exited); idempotent, thread-safe.

    Called by the watch's thread, or by the launching process when a rank it started exits
    before the group has formed (then the rendezvous gives up at its next poll).
    """
    global _abort_reason
    with _abort_lock:
        if _abort_reason is not None:
            return
        _abort_reason = reason
        _aborted.set()
    logger.error("aborting the tensor-parallel group: %s", reason)
    if dist.is_initialized():
        try:  # NCCL: ncclCommAbort ends the kernels that wait for the dead rank
            dist.group.WORLD.abort()
        except Exception:  # a backend without abort: the check below still holds
            logger.exception("the process group could not be aborted")


def group_aborted() -> bool:
    """The group was aborted: a rank has exited."""
    return _abort_reason is not None


def check_not_aborted() -> None:
    """Raise :class:`PeerExited` if the group was aborted (every collective calls this first)."""
    if _abort_reason is not None:
        raise PeerExited(f"the tensor-parallel group was aborted: {_abort_reason}")


def failure_reason(exc: BaseException) -> str:
    """Why a collective raised ``exc``: the rank that exited, if the watch reports one within
    ``PEER_EXIT_WAIT_S`` seconds, else ``exc`` itself."""
    if _watch is not None or _abort_reason is not None:
        _aborted.wait(PEER_EXIT_WAIT_S)
    return f"{exc}" if _abort_reason is None else f"{_abort_reason} ({exc})"


@contextmanager
def watching_started_ranks(processes: Sequence[BaseProcess]) -> Iterator[None]:
    """While the group forms: a rank this process started that exits aborts the group.

    Rank 0 learns the other ranks' pids at the rendezvous; the ranks it started itself (as
    ``LLM`` does) it can watch from the start, so that a rank that dies on its way there
    (importing, or refused to start) ends rank 0's wait at once.
    """
    _forget_abort()  # a stale abort from an earlier group must not end this one
    watch = ProcessWatch({process.name: process for process in processes}, "minisgl-start-watch")
    try:
        yield
    finally:
        watch.stop()
        if not dist.is_initialized():  # the start failed, the group is gone: so is the abort
            _forget_abort()


def rendezvous(rank: int, size: int, address: str, timeout_s: float
               ) -> tuple[dist.Store, dict[int, int]]:
    """Meet the other ranks at ``address`` (``tcp://HOST:PORT``, rank 0 serves it); returns
    the store (for ``init_process_group``) and every rank's pid.

    Raises:
        PeerExited: the group was aborted while waiting (a rank exited before it joined).
        RuntimeError: this rank's parent exited while waiting.
        TimeoutError: not every rank arrived within ``timeout_s`` seconds.
    """
    where = urlsplit(address)
    if where.scheme != "tcp" or where.hostname is None or where.port is None:
        raise ValueError(f"a rendezvous address is tcp://HOST:PORT, got {address!r}")
    deadline = time.monotonic() + timeout_s
    parent = os.getppid()
    keys = [f"minisgl/pid/{r}" for r in range(size)]
    store: dist.Store | None = None

    def waiting() -> None:  # between two polls: is there still a reason to wait?
        check_not_aborted()
        if os.getppid() != parent:
            raise RuntimeError(f"rank {rank}'s parent process exited during the rendezvous")
        if time.monotonic() > deadline:
            joined = 0 if store is None else sum(store.check([key]) for key in keys)
            raise TimeoutError(f"{joined} of {size} tensor-parallel ranks joined within "
                               f"{timeout_s:.0f} s")
        time.sleep(POLL_S)  # a signal's handler runs here

    # Rank 0 opens the store; the others first knock on its port, in short attempts, until it
    # answers (torch's own client would log an error for each attempt), then connect.
    while rank != 0:
        try:
            socket.create_connection((where.hostname, where.port), STORE_KNOCK_S).close()
            break
        except OSError:  # rank 0 not listening yet
            waiting()
    store = dist.TCPStore(where.hostname, where.port, size, rank == 0,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    store.set(f"minisgl/pid/{rank}", str(os.getpid()))
    while not store.check(keys):
        waiting()
    return store, {r: int(store.get(key)) for r, key in enumerate(keys)}


def watch_peers(pids: dict[int, int], rank: int) -> None:
    """Watch every other rank's process; the first that exits aborts the group."""
    global _watch  # None here: init_tp_group refuses a process that is in a group already
    # A rank we started ourselves is watched as a child: its exit code shows.
    children = {child.pid: child for child in multiprocessing.active_children()}
    _watch = ProcessWatch({f"rank {r}": children.get(pid, pid) for r, pid in pids.items()
                           if r != rank}, f"minisgl-rank{rank}-watch")


Watched = BaseProcess | int  # a rank we started (a child), or a sibling by its pid


class ProcessWatch:
    """A thread that looks at each of ``ranks`` (name -> process) every ``POLL_S`` seconds
    and aborts the group with the first that has exited, once."""

    def __init__(self, ranks: Mapping[str, Watched], thread_name: str) -> None:
        self._ranks = dict(ranks)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (no abort comes after this returns); idempotent."""
        self._stopped.set()
        self._thread.join(5.0)  # bound: the thread wakes at once

    def _run(self) -> None:
        while not self._stopped.wait(POLL_S):
            for name, target in self._ranks.items():
                if not _running(target):
                    if not self._stopped.is_set():
                        abort_tp_group(_how_it_ended(name, target))
                    return


def _running(target: Watched) -> bool:
    """A zombie (exited, not reaped yet) counts as gone."""
    if isinstance(target, BaseProcess):
        return target.is_alive()  # reaps the child if it has exited
    try:
        return psutil.Process(target).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _how_it_ended(name: str, target: Watched) -> str:
    """``rank 1 (pid 42) was killed by SIGKILL``; for a sibling, whose exit code we cannot
    read, only that it exited."""
    pid, code = (target.pid, target.exitcode) if isinstance(target, BaseProcess) else (target, None)
    return f"{name} (pid {pid}) {describe_exit(code)}"


def stop_watching() -> None:
    """Stop the watch and forget an abort (the process leaves its group)."""
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None
    _forget_abort()


def _forget_abort() -> None:
    global _abort_reason
    _abort_reason = None
    _aborted.clear()
