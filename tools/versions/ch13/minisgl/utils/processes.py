"""The life of a worker process: started and stopped.

:func:`start_process` starts a worker with the *spawn* start method; :func:`stop_process` makes
sure it is gone and reaped.

What the processes say to each other travels on :mod:`minisgl.utils.queues`; this module is
only about the processes themselves.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Mapping
from multiprocessing.process import BaseProcess
from typing import Any

from minisgl.utils.logger import get_logger

logger = get_logger(__name__)


# ---------------------------------------------------------------------------------- processes
# Every worker starts in a fresh interpreter ("spawn"), never as a copy of its parent ("fork").
# fork copies the parent's memory but only the thread that called it: the CUDA driver cannot
# run in a forked child once the parent has initialised it, and a lock that another thread
# held at the time (ZMQ's I/O thread, torch's thread pools, logging) stays locked for ever in
# the child. Spawn costs a second or so of start-up and needs a picklable target and arguments;
# it buys a child that holds only what it imports itself.
SPAWN = multiprocessing.get_context("spawn")


def start_process(target: Callable[..., Any], name: str, *, args: tuple[Any, ...] = (),
                  kwargs: Mapping[str, Any] | None = None, daemon: bool = True) -> BaseProcess:
    """Start ``target(*args, **kwargs)`` in a new process called ``name``, with spawn.

    ``target`` must be importable by name (a module-level function), and ``args``/``kwargs``
    picklable: pass queue addresses, not queues. ``name`` is the process name that the log
    lines show. A daemon process (the default) is terminated when its parent exits normally, so
    a crashed launcher leaves fewer orphans behind.
    """
    if not name:
        raise ValueError("a process needs a name: its log lines show it")
    process = SPAWN.Process(target=target, name=name, args=args, kwargs=dict(kwargs or {}),
                             daemon=daemon)
    process.start()
    logger.debug("started process %s (pid %d)", name, process.pid)
    return process


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
