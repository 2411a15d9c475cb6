"""The launcher: start every worker process, wait for them, serve, and stop them all on the way out.

``python -m minisgl`` runs :func:`main`. The processes and who talks to whom::

    API server (this process) --> tokenizer k (k = uid % N) --> scheduler --> detokenizer
        ^                                                                       |
        +------------------------------ UserReply -------------------------------+

Start-up order (:func:`launch`):

1. check the arguments, and bind the HTTP port without listening yet: a port already in use
   fails now, not after a minute of loading weights;
2. find the checkpoint (a hub id is downloaded here, once, so that the workers all read the
   same local directory);
3. start the workers with spawn (scheduler first: loading the model takes longest) and wait
   until each has reported ready, or stop them all and report the one that failed;
4. serve HTTP with uvicorn (or run the shell) until SIGINT or SIGTERM;
5. stop every worker, whatever the way out: a normal return, a signal or an error.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING

from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.args import ServerArgs, parse_args
from minisgl.utils.hf import ModelPathError, resolve_model_path
from minisgl.utils.logger import configure_logging, get_logger
from minisgl.utils.counters import SharedCounters
from minisgl.utils.processes import new_ready_queue, start_process, stop_processes, wait_ready
from minisgl.utils.queues import ipc_address

if TYPE_CHECKING:
    from minisgl.server.frontend import RequestRouter

logger = get_logger(__name__)

# What ``--shell`` runs instead of the HTTP server: it gets a way to connect a frontend, the
# model's directory and the answer's token limit. ``python -m minisgl`` passes the terminal
# chat of ``minisgl.shell``; the shell sits above the server, so the server never imports it.
ShellRunner = Callable[[Callable[[], "RequestRouter"], Path, int], None]

# Seconds uvicorn lets requests in flight finish after SIGINT/SIGTERM before cancelling them.
GRACEFUL_SHUTDOWN_S = 5
# Exit statuses by the shell's convention: 128 + the signal's number.
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM


@dataclass
class Workers:
    """The worker processes of one server, and what the API server needs from them.

    Attributes:
        processes: the workers started so far, in start order.
        names: a name for each, for errors and ``/health``.
        tokenizer_addrs: each tokenizer's inbox; the API server sends request ``uid`` to
            ``tokenizer_addrs[uid % N]``.
        frontend_addr: the API server's own inbox, which the detokenizer sends replies to.
        counters: the shared counters each worker publishes (scheduler, detokenizer).
    """

    tokenizer_addrs: list[str]
    frontend_addr: str
    counters: list[SharedCounters]
    processes: list[BaseProcess] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def snapshot(self) -> dict[str, int]:
        """Every worker counter by name (``/metrics``)."""
        values: dict[str, int] = {}
        for counters in self.counters:
            values.update(counters.snapshot())
        return values

    def health(self) -> str | None:
        """None while every worker runs; else which one stopped (``/health``)."""
        for process, name in zip(self.processes, self.names):
            if not process.is_alive():
                return f"the {name} process (pid {process.pid}) exited with code " \
                       f"{process.exitcode}"
        return None

    def stop(self) -> None:
        """SIGTERM every worker, then reap each (killing any that does not exit in time)."""
        stop_processes(self.processes)
        logger.info("stopped %d worker process(es)", len(self.processes))


def start_workers(args: ServerArgs, config: SchedulerConfig) -> Workers:
    """Start the scheduler, the detokenizer and the tokenizers; return once all are ready.

    Raises:
        RuntimeError: a worker failed to start (its traceback is in the message) or was not
            ready within ``args.startup_timeout_s``. Every worker started is stopped first.
    """
    from minisgl.scheduler.io import run_scheduler, scheduler_counters
    from minisgl.tokenizer.server import detokenizer_counters, run_detokenizer, run_tokenizer

    model_path = str(config.model_path)
    scheduler_addr, detokenizer_addr = ipc_address("scheduler"), ipc_address("detokenizer")
    workers = Workers(tokenizer_addrs=[ipc_address(f"tokenizer-{k}")
                                       for k in range(args.num_tokenizers)],
                      frontend_addr=ipc_address("frontend"),
                      counters=[scheduler_counters(), detokenizer_counters()])
    ready = new_ready_queue()

    def start(label: str, target: Callable[..., None], *task_args: object,
              **kwargs: object) -> None:
        workers.processes.append(start_process(target, f"minisgl-{label}", args=task_args,
                                               kwargs=kwargs | {"ready": ready}))
        workers.names.append(label)

    try:
        start("scheduler", run_scheduler, config, scheduler_addr, detokenizer_addr,
              stats=workers.counters[0])
        start("detokenizer", run_detokenizer, model_path, detokenizer_addr,
              workers.frontend_addr, stats=workers.counters[1], scheduler_addr=scheduler_addr)
        for k, inbox in enumerate(workers.tokenizer_addrs):
            start(f"tokenizer-{k}", run_tokenizer, model_path, inbox, scheduler_addr,
                  name=f"tokenizer-{k}")
        wait_ready(ready, workers.processes, workers.names, args.startup_timeout_s)
    except BaseException:  # a failed worker, a timeout, Ctrl-C while loading: none may linger
        workers.stop()
        raise
    return workers


def launch(args: ServerArgs, shell: ShellRunner | None = None) -> int:
    """Run the server (or, with ``--shell``, ``shell``) described by ``args``; returns the exit
    status."""
    if args.shell and shell is None:
        raise ValueError("--shell needs the terminal front end: run python -m minisgl --shell")
    from minisgl.server.api_server import create_app
    from minisgl.server.frontend import RequestRouter

    if args.shell:  # the terminal is for the conversation: by default, warnings and errors only
        os.environ.setdefault("MINISGL_LOG_LEVEL", "WARNING")  # the workers inherit it
        configure_logging()
    listener = None if args.shell else bind_port(args.host, args.port)
    workers: Workers | None = None
    with _terminate_raises():
        try:
            model_path = resolve_model_path(args.model)  # a hub id is downloaded here, once
            workers = start_workers(args, args.scheduler_config(str(model_path)))

            def frontend() -> RequestRouter:
                return RequestRouter.connect(workers.tokenizer_addrs, workers.frontend_addr)

            if shell is not None and args.shell:
                shell(frontend, model_path, args.shell_max_tokens)
                return 0
            app = create_app(frontend, args.model_name, model_root=str(model_path),
                             metrics=workers.snapshot, health=workers.health)
            logger.info("minisgl serving %s on %s", args.model_name, args.url)
            serve_http(app, listener)
            return 0
        except KeyboardInterrupt:
            logger.info("interrupted (SIGINT): shutting down")
            return EXIT_SIGINT
        except _Terminated:
            logger.info("terminated (SIGTERM): shutting down")
            return EXIT_SIGTERM
        finally:
            with _signals_ignored():  # a second Ctrl-C must not leave workers half-stopped
                if workers is not None:
                    workers.stop()
                if listener is not None:
                    listener.close()


def main(argv: Sequence[str] | None = None, shell: ShellRunner | None = None) -> int:
    """``python -m minisgl``: parse the command line, launch, return the exit status."""
    args = parse_args(argv)
    try:
        return launch(args, shell)
    except (ModelPathError, OSError, RuntimeError) as exc:  # start-up failures, said plainly
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


def serve_http(app: object, sock: socket.socket) -> None:
    """Run uvicorn on ``sock`` until SIGINT or SIGTERM.

    uvicorn catches both signals to shut down gracefully, then raises the signal again with
    our handlers back in place, so the launcher's clean-up runs after it.
    """
    import uvicorn

    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    uvicorn.Server(config).run(sockets=[sock])


# --------------------------------------------------------------------------- signals
class _Terminated(BaseException):
    """SIGTERM in the launcher: like KeyboardInterrupt, it unwinds to the clean-up."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


@contextmanager
def _terminate_raises() -> Iterator[None]:
    """SIGTERM raises :class:`_Terminated` (by default it would end the process on the spot,
    skipping every ``finally`` and leaving the workers behind)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT,
                                                                    signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
