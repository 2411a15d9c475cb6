"""``python -m minisgl`` in the background: start it, wait until it answers, always stop it.

A test, an example, the Tour (``tools/tour.py``) and the online benchmark all run a real server
the same way: on a free loopback port, as a child process whose output goes to a log file. They
poll ``GET /health`` until it answers 200, failing with the end of the log if the server exits
first or takes too long; they read ``GET /metrics``; and on every way out they stop it and make
sure that none of its processes is left. :class:`ServerProcess` is that, once::

    with ServerProcess("models/tiny-qwen3", device="cpu") as server:
        httpx.get(f"{server.url}/v1/models")
    # stopped here (SIGINT), and whatever of it still ran has been killed

This module is for the client side: it starts the server, it is not part of it, so it lives
beside the repository's tools and not in the ``minisgl`` package. It needs ``psutil`` (a
dependency) and ``httpx`` (the ``dev`` extra, as every client here does). Programs outside
``tools/`` put this directory on ``sys.path`` to import it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import httpx
import psutil

if TYPE_CHECKING:
    from typing_extensions import Self

# The checkout that holds this file and its `minisgl` package: the server must run the same code
# as the process that starts it, installed or not (and, in a chapter's checkpoint, that
# checkpoint's).
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300.0  # the tiny model on a CPU: seconds; a large one on a GPU: minutes
STOP_TIMEOUT_S = 30.0  # SIGINT lets requests in flight finish (--shutdown-timeout, 5 s) first
GRACE_S = 15.0  # for the rest of the family once the launcher is gone
HEALTH_POLL_S = 0.2
LOG_TAIL_LINES = 40


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def parse_metrics(text: str) -> dict[str, int]:
    """Prometheus text, as ``/metrics`` serves it, as ``{name: value}``.

    One ``name value`` per line; lines starting with ``#`` are help and type. minisgl's
    metrics are counts, so every value is a whole number, also where it is written ``3.0``.
    A line that is not a name and a finite number (``NaN``, ``+Inf``, a label with a space in
    it) is skipped: another server's metrics are no error.
    """
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or line.startswith("#"):
            continue
        try:
            values[parts[0]] = int(float(parts[1]))
        except (ValueError, OverflowError):
            pass
    return values


def still_running(processes: Iterable[psutil.Process], wait_s: float = 0.0
                  ) -> list[psutil.Process]:
    """Those of ``processes`` that still run after up to ``wait_s`` seconds.

    A zombie has ended (it only waits for its parent to read its exit status), and a pid now
    used by another process counts as ended. This only looks: it never waits for a process the
    way ``psutil.wait_procs`` does, which would reap a child behind ``subprocess.Popen``'s back.
    """
    processes = list(processes)
    deadline = time.monotonic() + wait_s
    while True:
        left = [p for p in processes if _runs(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _runs(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(processes: Iterable[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.Error:  # it ended meanwhile
            pass


def stream_in_thread(url: str, results: dict[int, list[str]], i: int,
                     max_tokens: int = 3000) -> threading.Thread:
    """Stream the completion of ``"Story number i"`` from the server at ``url`` in a thread.

    ``results[i]`` is the stream's non-empty lines, filled as they arrive (so a test can wait
    for the first one), ending with ``"cut off: ..."`` if the connection broke.
    """
    def read() -> None:
        lines = results.setdefault(i, [])
        try:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                    "prompt": f"Story number {i}", "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True}) as response:
                lines.extend(line for line in response.iter_lines() if line)
        except httpx.HTTPError as exc:
            lines.append(f"cut off: {exc!r}")

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


class ServerError(RuntimeError):
    """The server did not come up; the message holds the end of its log."""


class ServerProcess:
    """``python -m minisgl`` as a child process: started, waited for, always stopped.

    Args:
        model: the checkpoint (``--model``).
        device: ``--device``: auto, cpu or cuda.
        args: more options for the server, e.g. ``("--shutdown-timeout", "1")``.
        host, port: where it listens; the port defaults to a free one.
        log_path: where its output (stdout and stderr) goes; defaults to a temporary file,
            which leaving the ``with`` block without an error removes.
        env: its environment (default: this process's). ``OMP_NUM_THREADS`` is set to
            ``omp_threads`` where ``env`` does not set it; ``omp_threads=None`` leaves it out.
        cwd: its working directory (a relative ``model`` is relative to it).
        new_session: start it in a session (and process group) of its own, as a shell starts a
            command: a Ctrl-C in this terminal then reaches this process only, which stops the
            server in order, and ``os.killpg(proc.pid, ...)`` signals the server's group.
        die_with_parent: on Linux, the server gets SIGTERM (an orderly shutdown) when the
            thread that started it ends, even when this process is killed with SIGKILL.
        startup_timeout_s: how long ``with`` waits for ``/health``.

    Attributes:
        command: what runs (``sys.executable -m minisgl ...``).
        url, port, log_path: where it answers, and where its log is.
        proc: the launcher, once started (a ``subprocess.Popen``).
        exit_code: the launcher's, once :meth:`stop` has returned.
        left_behind: after :meth:`stop`, the processes that still ran once the orderly stop
            was over and had to be killed (none, when all is well).
    """

    def __init__(self, model: str | os.PathLike[str], *, device: str = "auto",
                 args: Sequence[str] = (), host: str = "127.0.0.1", port: int | None = None,
                 log_path: Path | None = None, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, omp_threads: int | None = 1,
                 new_session: bool = False, die_with_parent: bool = True,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.command = [sys.executable, "-m", "minisgl", "--model", str(model), "--device",
                        device, "--host", host, "--port", str(self.port), *args]
        self.owns_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="minisgl-server-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        if omp_threads is not None:
            # Three workers and a launcher, each with a thread per core, would fight over a
            # CPU's cores; one thread each also keeps a CPU's sums, and greedy tokens, the same.
            self.env.setdefault("OMP_NUM_THREADS", str(omp_threads))
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PACKAGE_ROOT), self.env.get("PYTHONPATH")) if p)
        self.cwd = cwd
        self.new_session = new_session
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._family: dict[tuple[int, float], psutil.Process] = {}
        self._stopped = False
        self.exit_code: int | None = None
        self.left_behind: list[psutil.Process] = []

    # ------------------------------------------------------------------------- start
    def start(self) -> None:
        """Start the server and return at once (it loads meanwhile: see :meth:`wait_ready`)."""
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, cwd=self.cwd, start_new_session=self.new_session,
                preexec_fn=self._die_with_parent_hook())  # noqa: PLW1509 (see there)
        self._look()

    def _die_with_parent_hook(self) -> Callable[[], None] | None:
        """What the child runs between fork and exec: Linux's PR_SET_PDEATHSIG, so that not
        even a killed parent leaves a server behind (the launcher treats SIGTERM as an
        orderly shutdown). None where that is not wanted or not available."""
        if not self.die_with_parent:
            return None
        try:
            # Looked up here, in the parent: between fork and exec the child makes this one
            # call and nothing else, so no lock another thread of ours held (dlopen's) is needed.
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            return None
        pr_set_pdeathsig = 1
        return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Poll ``/health`` until it answers 200; returns the seconds that took.

        Raises :class:`ServerError`, with the end of the log, if the server exits first or
        is not ready after ``timeout_s`` (default: the ``startup_timeout_s`` given).
        """
        assert self.proc is not None, "start() first"
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        # trust_env=False: a proxy from the environment must not stand in for the server.
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise ServerError(
                        f"the server exited with code {code} before it was ready; the end of "
                        f"its log ({self.log_path}):\n{self.log_tail()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        self._look()  # every worker has started by now: note them all
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass  # not listening yet: the port opens once every worker is ready
                if time.monotonic() - start > timeout_s:
                    raise ServerError(
                        f"the server was not ready after {timeout_s:g} s; the end of its "
                        f"log ({self.log_path}):\n{self.log_tail()}")
                time.sleep(HEALTH_POLL_S)

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_ready()
        except BaseException:  # __exit__ runs only once __enter__ has returned
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        if exc_type is None and self.owns_log:
            self.log_path.unlink(missing_ok=True)

    # ------------------------------------------------------------------------- while it runs
    def log_text(self, start: int = 0) -> str:
        """The log from byte ``start`` on ("" while there is none)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(start)
                return log.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().rstrip().splitlines()[-lines:]) or "(the log is empty)"

    def metrics(self) -> dict[str, int]:
        """``GET /metrics``, parsed."""
        response = httpx.get(f"{self.url}/metrics", timeout=10, trust_env=False)
        response.raise_for_status()
        return parse_metrics(response.text)

    @property
    def family(self) -> list[psutil.Process]:
        """The launcher (first) and every process seen under it: noted when it starts, when
        it is ready, on :meth:`workers` and before it is stopped. A worker whose launcher has
        died is no longer anybody's child that we could ask about, so it is known from here."""
        return list(self._family.values())

    def workers(self) -> list[psutil.Process]:
        """The worker processes running now: the launcher's children started with spawn
        (multiprocessing's resource tracker is a child too, but no worker)."""
        found = []
        for process in self._look()[1:]:
            try:
                if "multiprocessing.spawn" in " ".join(process.cmdline()):
                    found.append(process)
            except psutil.Error:  # it ended meanwhile
                pass
        return found

    def alive(self, wait_s: float = 0.0) -> list[psutil.Process]:
        """Which of :attr:`family` still run (zombies not counted), after up to ``wait_s``."""
        return still_running(self.family, wait_s)

    def _look(self) -> list[psutil.Process]:
        """The launcher and everything under it now, each noted in the family."""
        if self.proc is None or self.proc.poll() is not None:
            return []  # gone: its pid may already belong to someone else
        try:
            launcher = psutil.Process(self.proc.pid)
            now = [launcher, *launcher.children(recursive=True)]
            for process in now:
                self._family.setdefault((process.pid, process.create_time()), process)
        except psutil.Error:
            return []
        return now

    # ------------------------------------------------------------------------- stop
    def stop(self, sig: signal.Signals | None = signal.SIGINT, timeout_s: float = STOP_TIMEOUT_S,
             grace_s: float = GRACE_S) -> int | None:
        """Stop the server: send ``sig`` (SIGINT, as Ctrl-C does; ``None`` when the caller has
        signalled it already), wait up to ``timeout_s`` for the launcher to exit and ``grace_s``
        more for the rest of its family, then kill whatever still runs (:attr:`left_behind`).

        Returns the launcher's exit code (None if it never started, or would not die).
        Idempotent: later calls return the same code. A Ctrl-C while it waits skips to the
        killing.
        """
        if self.proc is None or self._stopped:
            return self.exit_code
        self._stopped = True
        try:
            if self.proc.poll() is None:
                self._look()  # a worker started since it was ready is known too
                if sig is not None:
                    self.proc.send_signal(sig)
                self.proc.wait(timeout_s)
            self.left_behind = self.alive(grace_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            self.left_behind = self.alive()
        _kill(self.left_behind)
        still_running(self.left_behind, wait_s=10)
        try:
            self.exit_code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.exit_code = None
        return self.exit_code
