"""The launcher: start every worker process, wait for them, serve, and stop them all on the way out.

``python -m minisgl`` runs :func:`main`: the API server (this process) sends requests to
tokenizer ``uid % N``, then the scheduler (``--tp N``: N ranks), then the detokenizer, which
replies to the API server. :func:`launch` checks the arguments and binds the port before any
weight is read, finds the checkpoint once, starts the workers with spawn and waits for each to
report ready (or stops them all and reports the one that failed), serves until a signal or a
dead worker (then status 1, after answering 503 for ``WORKER_DIED_GRACE_S``), and stops every
worker whatever the way out. Workers live in their own process groups, so Ctrl-C reaches the
launcher alone. Chapters 15 and 16 tell the story.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.args import ServerArgs, parse_args
from minisgl.server.lifecycle import SHUTTING_DOWN
from minisgl.utils.hf import ModelPathError, default_model, load_hf_config, resolve_model_path
from minisgl.utils.logger import configure_logging, get_logger
from minisgl.utils.counters import SharedCounters
from minisgl.utils.processes import (describe_exit, new_ready_queue, start_process, stop_processes,
                                     wait_ready)
from minisgl.utils.queues import ipc_address
from minisgl.utils.torch_utils import configure_cpu_threads, resolve_device

if TYPE_CHECKING:
    from minisgl.server.frontend import RequestRouter

logger = get_logger(__name__)

# What ``--shell`` runs instead of the HTTP server: it gets a way to connect a frontend, the
# model's directory and the answer's token limit. ``python -m minisgl`` passes the terminal
# chat of ``minisgl.shell``; the shell sits above the server, so the server never imports it.
ShellRunner = Callable[[Callable[[], "RequestRouter"], Path, int], None]

# uvicorn cancels what still runs this long after the shutdown timeout; by then the
# frontend has ended every request, so it is only a last resort.
UVICORN_GRACE_S = 5.0
# Exit statuses by the shell's convention: 128 + the signal's number.
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM
# A worker died while serving: the server answers with 503 for this long, then exits with
# EXIT_WORKER_DIED, and whatever supervises it can start a new one.
WORKER_DIED_GRACE_S = 2.0
EXIT_WORKER_DIED = 1


@dataclass
class Workers:
    """The worker processes of one server, and what the API server needs from them.

    Attributes:
        processes: the workers started so far by name (for errors and ``/health``), in start
            order.
        tokenizer_addrs: each tokenizer's inbox; the API server sends request ``uid`` to
            ``tokenizer_addrs[uid % N]``.
        frontend_addr: the API server's own inbox, which the detokenizer sends replies to.
        counters: the shared counters each worker publishes (scheduler, detokenizer).
    """

    tokenizer_addrs: list[str]
    frontend_addr: str
    counters: list[SharedCounters]
    processes: dict[str, BaseProcess] = field(default_factory=dict)

    def snapshot(self) -> dict[str, int]:
        """Every worker counter by name (``/metrics``)."""
        return {name: value for counters in self.counters
                for name, value in counters.snapshot().items()}

    def health(self) -> str | None:
        """None while every worker runs; else which one stopped (``/health``)."""
        for name, process in self.processes.items():
            if not process.is_alive():
                return f"the {name} process (pid {process.pid}) {describe_exit(process.exitcode)}"
        return None

    def stop(self) -> None:
        """SIGTERM every worker, then reap each (killing any that does not exit in time)."""
        stop_processes(self.processes.values())
        logger.info("stopped %d worker process(es)", len(self.processes))


def start_workers(args: ServerArgs, config: SchedulerConfig) -> Workers:
    """Start the scheduler, the detokenizer and the tokenizers; return once all are ready.

    Raises:
        RuntimeError: a worker failed to start (its traceback is in the message) or was not
            ready within ``args.startup_timeout_s``. Every worker started is stopped first.
    """
    from minisgl.scheduler.io import run_scheduler, scheduler_counters
    from minisgl.scheduler.tp import TPLaunch, check_tp, follower_counters, run_tp_follower
    from minisgl.tokenizer.server import detokenizer_counters, run_detokenizer, run_tokenizer

    model_path = str(config.model_path)
    check_tp(model_path, args.tp)  # a model that cannot be split fails here, at once
    tp = TPLaunch.new(args.tp) if args.tp > 1 else None
    scheduler_addr, detokenizer_addr = ipc_address("scheduler"), ipc_address("detokenizer")
    workers = Workers(tokenizer_addrs=[ipc_address(f"tokenizer-{k}")
                                       for k in range(args.num_tokenizers)],
                      frontend_addr=ipc_address("frontend"),
                      counters=[scheduler_counters(), detokenizer_counters()])
    ready = new_ready_queue()

    def start(label: str, target: Callable[..., None], *task_args: object,
              **kwargs: object) -> None:
        workers.processes[label] = start_process(target, f"minisgl-{label}", args=task_args,
                                                 kwargs=kwargs | {"ready": ready})

    try:
        start("scheduler", run_scheduler, config, scheduler_addr, detokenizer_addr,
              stats=workers.counters[0], tp=tp)
        for rank in range(1, args.tp):  # the other ranks, each its own scheduler
            workers.counters.append(follower_counters(rank))
            start(f"scheduler-rank{rank}", run_tp_follower, config, tp, rank,
                  stats=workers.counters[-1])
        start("detokenizer", run_detokenizer, model_path, detokenizer_addr,
              workers.frontend_addr, stats=workers.counters[1], scheduler_addr=scheduler_addr)
        for k, inbox in enumerate(workers.tokenizer_addrs):
            start(f"tokenizer-{k}", run_tokenizer, model_path, inbox, scheduler_addr,
                  name=f"tokenizer-{k}")
        wait_ready(ready, list(workers.processes.values()), args.startup_timeout_s)
        logger.info("workers: %s", ", ".join(f"{name} (pid {process.pid})"
                                             for name, process in workers.processes.items()))
    except BaseException:  # a failed worker, a timeout, Ctrl-C while loading: none may linger
        workers.stop()
        raise
    return workers


def launch(args: ServerArgs, shell: ShellRunner | None = None) -> int:
    """Run the server (or, with ``--shell``, ``shell``) described by ``args``; returns the exit
    status."""
    if args.shell and shell is None:
        raise ValueError("--shell needs the terminal front end: run python -m minisgl --shell")
    resolve_device(args.device)  # CUDA asked for where there is none: fail before anything starts
    from minisgl.server.api_server import create_app
    from minisgl.server.frontend import RequestRouter

    if args.shell:  # the terminal is for the conversation: by default, warnings and errors only
        os.environ.setdefault("MINISGL_LOG_LEVEL", "WARNING")  # the workers inherit it
        configure_logging()
    listener = None if args.shell else bind_port(args.host, args.port)
    if args.model is None:  # the book's default model, found or built here, never downloaded
        args = dataclasses.replace(args, model=str(default_model()))
    workers: Workers | None = None
    with _signal_handler(_raise_terminated, signal.SIGTERM):
        try:
            model_path = resolve_model_path(args.model)  # a hub id is downloaded here, once
            workers = start_workers(args, args.scheduler_config(str(model_path)))

            def frontend() -> RequestRouter:
                return RequestRouter.connect(
                    workers.tokenizer_addrs, workers.frontend_addr, health=workers.health,
                    reply_buffer_size=args.reply_buffer_size,
                    slow_reader_timeout_s=args.slow_reader_timeout_s)

            if shell is not None and args.shell:
                shell(frontend, model_path, args.shell_max_tokens)
                return 0
            config = load_hf_config(model_path)
            app = create_app(frontend, args.model_name, model_root=str(model_path),
                             aliases=[args.model], vocab_size=config.get("vocab_size"),
                             max_seq_len=args.engine_options.get(
                                 "max_seq_len", config.get("max_position_embeddings")),
                             metrics=workers.snapshot, health=workers.health)
            logger.info("minisgl serving %s on %s", args.model_name, args.url)
            return serve_http(app, listener, args.shutdown_timeout_s, health=workers.health)
        except KeyboardInterrupt:
            logger.info("interrupted (SIGINT): shutting down")
            return EXIT_SIGINT
        except _Terminated:
            logger.info("terminated (SIGTERM): shutting down")
            return EXIT_SIGTERM
        finally:
            # A second Ctrl-C must not leave workers half-stopped.
            with _signal_handler(signal.SIG_IGN, signal.SIGINT, signal.SIGTERM):
                if workers is not None:
                    workers.stop()
                if listener is not None:
                    listener.close()


def main(argv: Sequence[str] | None = None, shell: ShellRunner | None = None) -> int:
    """``python -m minisgl``: parse the command line, launch, return the exit status."""
    args = parse_args(argv)
    configure_cpu_threads("helper")  # the launcher serves HTTP; the scheduler computes
    try:
        return launch(args, shell)
    except (ModelPathError, OSError, RuntimeError, ValueError) as exc:  # start-up failures
        logger.error("%s", exc)
        return 1


# --------------------------------------------------------------------------- HTTP
def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` but not listening yet.

    Binding first makes a busy port fail at once; connections are refused (not queued) until
    uvicorn starts listening, so a client polling ``/health`` sees the server only when it is
    ready.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # A server restarted right after the last one stopped can take the port back at once.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                      "choose another --port or --host") from None
    return sock


def serve_http(app: Any, sock: socket.socket, shutdown_timeout_s: float = 5.0,
               health: Callable[[], str | None] | None = None) -> int:
    """Run uvicorn on ``sock`` until SIGINT or SIGTERM, or until ``health`` says a worker has
    died (then, ``WORKER_DIED_GRACE_S`` seconds later, return ``EXIT_WORKER_DIED``); 0 when
    uvicorn stops by itself.

    uvicorn catches both signals to shut down gracefully, then raises the signal again with
    our handlers back in place, so the launcher's clean-up runs after it.
    """
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                            lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout_s + UVICORN_GRACE_S)
    server = OrderlyServer(config, shutdown_timeout_s, health)
    server.run(sockets=[sock])
    # uvicorn raises the signal again as it returns, but a SIGINT raised then goes through
    # asyncio's own SIGINT handler, and in rare runs no KeyboardInterrupt came out of it (the
    # launcher exited 0 after Ctrl-C). The signal it noted decides instead.
    if server.stopped_by == signal.SIGINT:
        raise KeyboardInterrupt
    if server.stopped_by == signal.SIGTERM:
        raise _Terminated
    if server.worker_died is not None:
        logger.error("%s: the server cannot serve without it, and stops", server.worker_died)
        return EXIT_WORKER_DIED
    return 0


class OrderlyServer(uvicorn.Server):
    """uvicorn's server, with the frontend told when shutting down starts.

    uvicorn's own graceful shutdown waits for the connections in flight, then cancels them: a
    client is cut off without an error, and one long stream holds the shutdown for the whole
    wait. Here the requests in flight get ``shutdown_timeout_s`` seconds to finish; then every
    request still waiting is ended with "the server is shutting down" (an error body, or an
    error event and ``[DONE]``), so their connections close at once, and uvicorn returns. A
    second Ctrl-C ends them at once.
    """

    def __init__(self, config: uvicorn.Config, shutdown_timeout_s: float,
                 health: Callable[[], str | None] | None = None) -> None:
        super().__init__(config)
        self._health = health
        self.worker_died: str | None = None  # which worker died, once one has
        self._died_at = 0.0
        self._shutdown_timeout_s = shutdown_timeout_s
        self.stopped_by: int | None = None  # the first signal that stopped the server

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (10 a second): a dead worker stops the server, after a grace in
        which the frontend's watchdog answers every waiting and new request with 503."""
        if self.worker_died is None and self._health is not None:
            self.worker_died = self._health()
            self._died_at = time.monotonic()
        if self.worker_died is not None and \
                time.monotonic() - self._died_at > WORKER_DIED_GRACE_S:
            return True
        return await super().on_tick(counter)

    def _end_requests(self) -> None:
        frontend = getattr(self.config.app.state, "frontend", None)
        if frontend is not None:
            frontend.fail_all(SHUTTING_DOWN)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn stops accepting connections, then waits for those in flight: they have
        # shutdown_timeout_s seconds to end by themselves.
        timer = asyncio.get_running_loop().call_later(self._shutdown_timeout_s,
                                                      self._end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.stopped_by is None:
            self.stopped_by = sig
        super().handle_exit(sig, frame)
        if self.force_exit:  # a second Ctrl-C: no more waiting. uvicorn's handlers are only
            # installed while it serves, so the loop runs (in this thread, between bytecodes).
            asyncio.get_running_loop().call_soon_threadsafe(self._end_requests)


# --------------------------------------------------------------------------- signals
class _Terminated(BaseException):
    """SIGTERM in the launcher: like KeyboardInterrupt, it unwinds to the clean-up."""


def _raise_terminated(signum: int, frame: object) -> None:
    """SIGTERM's handler in the launcher: by default SIGTERM would end the process on the spot,
    skipping every ``finally`` and leaving the workers behind."""
    raise _Terminated()


@contextmanager
def _signal_handler(handler: Any, *signals: int) -> Iterator[None]:
    """``handler`` handles ``signals`` while the block runs; then the previous handlers do."""
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, earlier in previous.items():
            signal.signal(sig, earlier)
