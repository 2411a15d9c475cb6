"""CPU threads on a busy machine: the server's default against one thread per process.

    python benchmark/cpu_threads.py [--model models/tiny-qwen3] [--tokens 200] [--rounds 3]
                                    [--example]

A learner's machine is never idle, so beside the servers runs one busy process (a Python loop
on one core). Two servers run side by side on the CPU: one with the default settings (no
``OMP_NUM_THREADS``, no ``MINISGL_CPU_THREADS``: each process picks its threads, see
``minisgl/utils/torch_utils.py``) and one with ``OMP_NUM_THREADS=1``. Each round sends one
greedy request for ``--tokens`` tokens (EOS ignored) to each, in turns; the script prints the
median time of each and their ratio, which should be at most 1.3: the defaults share the cores
instead of fighting over them. ``--example`` also runs ``examples/ch04_generate.py`` with the
defaults beside the busy process and prints the KV cache's speed-up it measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a clone without installing: the repository's minisgl

from minisgl.utils.hf import example_checkpoint  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))  # the server harness, a tool of the repository
from server_process import ServerProcess  # noqa: E402

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MINISGL_CPU_THREADS", "MKL_NUM_THREADS")
LIMIT = 1.3  # the default may cost at most this much more than one thread per process


def default_env() -> dict[str, str]:
    """This environment without any thread setting: what a user gets who sets nothing."""
    return {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}


@contextmanager
def busy_process() -> Iterator[subprocess.Popen[bytes]]:
    """One other process keeping a core busy, as a browser or an editor does."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def time_request(url: str, tokens: int) -> float:
    """Seconds for one greedy completion of exactly ``tokens`` tokens."""
    body = {"prompt": "The quick brown fox", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    seconds = time.perf_counter() - start
    response.raise_for_status()
    got = response.json()["usage"]["completion_tokens"]
    assert got == tokens, f"asked for {tokens} tokens, got {got}"
    return seconds


def compare_servers(model: str, tokens: int, rounds: int) -> float:
    """Run both servers beside the busy process; print and return the ratio of the medians."""
    one_thread = dict(default_env(), OMP_NUM_THREADS="1")
    with ServerProcess(model, device="cpu", env=default_env(), omp_threads=None) as default, \
            ServerProcess(model, device="cpu", env=one_thread, omp_threads=None) as single:
        servers = {"default": default, "OMP_NUM_THREADS=1": single}
        for server in servers.values():
            time_request(server.url, 8)  # warm-up: first-use costs are not the question
        times: dict[str, list[float]] = {name: [] for name in servers}
        for i in range(rounds):
            order = list(servers.items()) if i % 2 == 0 else list(servers.items())[::-1]
            for name, server in order:
                times[name].append(time_request(server.url, tokens))
        for name, values in times.items():
            shown = ", ".join(f"{v:.2f}" for v in values)
            print(f"  {name:<18} median {statistics.median(values):6.2f} s   ({shown})")
        threads = [line.split("minisgl.utils.torch_utils: ", 1)[1]
                   for line in default.log_text().splitlines() if "CPU threads:" in line]
        print(f"  the default server's scheduler: {threads[0] if threads else '(not logged)'}")
    ratio = statistics.median(times["default"]) / statistics.median(times["OMP_NUM_THREADS=1"])
    print(f"ratio default / OMP_NUM_THREADS=1: {ratio:.2f} (at most {LIMIT}: "
          f"{'yes' if ratio <= LIMIT else 'NO'})")
    return ratio


def run_example(model: str) -> None:
    """examples/ch04_generate.py with the default threads; its speed-up line."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "ch04_generate.py"),
                           "--model", model, "--device", "cpu"], env=default_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=True)
    lines = [line.strip() for line in done.stdout.splitlines()
             if "speed-up" in line or "cache " in line]
    print("examples/ch04_generate.py, default threads: " + "; ".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="requests to each server")
    parser.add_argument("--example", action="store_true",
                        help="also run examples/ch04_generate.py beside the busy process")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.rounds < 1:
        parser.error("--tokens and --rounds must be >= 1")
    model = str(example_checkpoint(args.model))
    print(f"{os.cpu_count()} cores; one busy process beside the servers; {args.tokens} tokens "
          f"per request, {args.rounds} round(s)")
    with busy_process():
        ratio = compare_servers(model, args.tokens, args.rounds)
        if args.example:
            run_example(model)
    return 0 if ratio <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
