"""Online serving latency: a load generator for minisgl's OpenAI-compatible server.

It either attaches to a server that already runs (``--url http://127.0.0.1:1919``) or starts
one itself (``--model PATH [--device ...] [--server-args "..."]``): ``python -m minisgl`` on a
free port, as a child process whose log goes to a file. It waits for ``/health`` (and reports
the end of that log if the server dies or does not come up in time), and stops the server at
the end whatever happens, Ctrl-C and errors included: SIGINT first (the server's orderly
shutdown), then SIGKILL for whatever of it is still there.

The workload, for each request rate of ``--rates`` (requests per second; ``inf`` sends every
request at once): ``--num-requests`` requests arriving as a Poisson process, with prompt and
output lengths uniform in ``[--min-input, --max-input]`` and ``[--min-output, --max-output]``,
and prompts of random token ids of the model's vocabulary, all drawn from ``--seed``. The
lengths and the arrival pattern are the same at every rate (the gaps are one seeded draw of
exponential gaps, divided by the rate); the prompts are drawn afresh for each rate, so that the
prefix cache cannot serve one rate's prompts from an earlier rate's. Every request is a
streamed ``/v1/completions`` call, greedy, with ``ignore_eos`` (so it produces exactly its
drawn number of tokens) and ``stream_options.include_usage`` (so the last event says how many).

What is measured, per request, on the client's clock:

- **TTFT**: from sending the request to its first streamed event, which is its first piece of
  text (the server sends nothing before it has text to show);
- **TPOT**: ``(E2E - TTFT) / (completion_tokens - 1)``, the mean time per output token after
  the first, per request, with the number of tokens from the final usage. This is the
  inter-token latency the tables report as "TPOT";
- **ITL**: the raw gaps between successive text chunks, all requests pooled. A chunk usually
  carries one token, but it may carry several (the detokenizer holds back a token that ends
  inside a multi-byte character and sends it with the next one), so these gaps are a coarser,
  burstier view of the same thing;
- **E2E**: from sending the request to the end of its stream;
- errors: an HTTP error, an error event in the stream, a stream without a usage, or a usage
  whose ``completion_tokens`` differs from the drawn output length.

**Goodput** (``--goodput``, default ``ttft=500,tpot=50``): the requests that met every stated
latency objective, per second of the rate, and their share of all requests.

Besides random prompts, ``--workload`` offers ``shared-prefix`` (a few long system prompts
shared by many requests), ``long-context`` (prompts of thousands of tokens) and ``sharegpt``
(conversations from a ``--dataset`` file in the ShareGPT JSON format); see ``workloads.py``.
``--max-concurrency N`` keeps at most N requests in flight: with ``--rates inf`` the load is a
closed loop, each ending request letting the next one in.

Each rate prints its result as soon as it finishes; a table closes the run, and ``--out
results.json`` writes everything (every request's numbers too) after every rate.

    python benchmark/online.py --model models/tiny-qwen3 --device cpu --rates 8,inf \\
        --num-requests 8 --max-input 32 --max-output 16                  # a quick CPU run
    python benchmark/online.py --url http://127.0.0.1:1919 --vocab-size 151936   # attach
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import shlex
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
try:
    import minisgl  # noqa: F401
except ImportError:  # run from a checkout that was not pip-installed
    sys.path.insert(0, str(ROOT))
from minisgl.utils.hf import load_hf_config

sys.path.insert(0, str(ROOT / "tools"))  # the server harness, a tool of the repository
from server_process import ServerError, ServerProcess, parse_metrics  # noqa: E402

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the benchmark's sibling modules, also when imported by path
    sys.path.insert(0, str(HERE))
from measure import Objectives, goodput, parse_objectives, percentile  # noqa: E402,F401
from measure import summarize as stats  # noqa: E402
from workloads import (KINDS, Workload, load_sharegpt, make_long_context,  # noqa: E402,F401
                       make_shared_prefix, make_workload, poisson_arrivals)

DEFAULT_MODEL = "models/tiny-qwen3"
DEFAULT_STARTUP_TIMEOUT_S = 600.0  # a large checkpoint, CUDA graph capture: minutes at worst
WARMUP_PROMPT_LEN = 32
WARMUP_OUTPUT_LEN = 8
DEFAULT_OBJECTIVES = "ttft=500,tpot=50"  # a chat reply that starts fast and reads smoothly
MIN_METRIC_SAMPLES = 5  # /metrics samples of one rate below which they are not summarised
LAG_WARNING_S = 0.1  # the client sent a request this late: its own clock is not to be trusted


# ----------------------------------------------------------------------------- helpers
def parse_rates(text: str) -> list[float]:
    """``"4,16,inf"`` -> ``[4.0, 16.0, inf]``; every rate must be > 0."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"bad request rate {part!r} in {text!r}: expected numbers of "
                             "requests per second, or inf, separated by commas") from None
        if not rate > 0:
            raise ValueError(f"request rate {part!r} in {text!r} must be > 0 (or inf)")
        rates.append(rate)
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# ----------------------------------------------------------------------------- results
@dataclass
class RequestResult:
    """One request, timed on the client (seconds; ``sent_s`` from the start of its rate)."""

    input_len: int
    output_len: int  # drawn: what max_tokens asked for
    arrival_s: float  # when the schedule said to send it
    sent_s: float = 0.0  # when it was sent
    queued_s: float = 0.0  # of which waiting for a free slot under --max-concurrency
    ttft_s: float | None = None
    e2e_s: float | None = None
    completion_tokens: int | None = None
    chunk_s: list[float] = field(default_factory=list)  # each text chunk, from sending
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, from the usage's token count."""
        if self.ttft_s is None or self.e2e_s is None or not self.completion_tokens \
                or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between successive text chunks."""
        return [b - a for a, b in itertools.pairwise(self.chunk_s)]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tpot_s"] = self.tpot_s
        out["itl_s"] = self.itl_s
        return out


@dataclass
class RateResult:
    """One rate: the requests, and what they add up to."""

    rate: float
    requests: list[RequestResult]
    duration_s: float  # from the first arrival to the end of the last stream
    server: dict[str, Any] | None = None  # what /metrics showed during the run
    objectives: Objectives = field(default_factory=Objectives)

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.requests if r.ok]

    @property
    def errors(self) -> int:
        return len(self.requests) - len(self.completed)

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens or 0 for r in self.completed)

    @property
    def input_tokens(self) -> int:
        return sum(r.input_len for r in self.completed)

    @property
    def request_throughput(self) -> float:
        return len(self.completed) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def metric(self, name: str) -> dict[str, float] | None:
        done = self.completed
        if name == "ttft_ms":
            return stats([r.ttft_s for r in done if r.ttft_s is not None], 1e3)
        if name == "tpot_ms":
            return stats([r.tpot_s for r in done if r.tpot_s is not None], 1e3)
        if name == "itl_ms":
            return stats([gap for r in done for gap in r.itl_s], 1e3)
        if name == "e2e_s":
            return stats([r.e2e_s for r in done if r.e2e_s is not None])
        raise KeyError(name)

    @property
    def goodput(self) -> dict[str, float]:
        """The requests that met every objective: how many, their share, per second."""
        return goodput([(r.ttft_s, r.tpot_s, r.e2e_s) for r in self.completed],
                       len(self.requests), self.objectives, self.duration_s)

    @property
    def max_lag_s(self) -> float:
        """How late the client sent a request, not counting a wait the concurrency cap
        imposed on purpose."""
        return max((r.sent_s - r.arrival_s - r.queued_s for r in self.requests), default=0.0)

    def to_json(self) -> dict[str, Any]:
        errors = [r.error for r in self.requests if r.error is not None]
        return {
            "rate": rate_label(self.rate) if math.isinf(self.rate) else self.rate,
            "num_requests": len(self.requests), "completed": len(self.completed),
            "errors": self.errors, "error_samples": errors[:5],
            "duration_s": self.duration_s, "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "objectives": dict(self.objectives.items()), "goodput": self.goodput,
            "ttft_ms": self.metric("ttft_ms"), "tpot_ms": self.metric("tpot_ms"),
            "itl_ms": self.metric("itl_ms"), "e2e_s": self.metric("e2e_s"),
            "max_send_lag_s": self.max_lag_s, "server": self.server,
            "requests": [r.to_json() for r in self.requests]}


@dataclass
class Report:
    """Everything the run measured; written to ``--out`` after every rate."""

    header: dict[str, Any]
    workload: dict[str, Any]
    results: list[RateResult] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {"header": self.header, "workload": self.workload,
                "results": [r.to_json() for r in self.results]}


def save(report: Report, path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(report.to_json(), indent=1) + "\n")


# ----------------------------------------------------------------------------- the server
def server_pids(server: ServerProcess) -> list[dict[str, float]]:
    """The started server's processes, each with its start time: a pid alone may be reused."""
    return [{"pid": p.pid, "create_time": p.create_time()} for p in server.family]


# ----------------------------------------------------------------------------- the client
async def send_request(client: httpx.AsyncClient, url: str, model: str | None,
                       prompt: list[int], result: RequestResult, run_start: float) -> None:
    """One streamed completion; fills ``result`` (an error is recorded, never raised)."""
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": result.output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    sent = time.perf_counter()
    result.sent_s = sent - run_start
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {error_message(text)}"
                return
            async for data in sse_data(response):
                now = time.perf_counter() - sent
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error event: {error_message(data)}"
                    continue
                choices = event.get("choices") or []
                if choices and result.ttft_s is None:
                    result.ttft_s = now
                if choices and choices[0].get("text"):
                    result.chunk_s.append(now)
                if event.get("usage"):
                    usage = event["usage"]
        result.e2e_s = time.perf_counter() - sent
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return
    if result.error is not None:
        return
    if usage is None:
        result.error = "the stream ended without a usage (stream_options.include_usage)"
        return
    result.completion_tokens = int(usage.get("completion_tokens", -1))
    if result.completion_tokens != result.output_len:
        result.error = (f"completion_tokens {result.completion_tokens} != max_tokens "
                        f"{result.output_len} (ignore_eos was set)")
    elif result.ttft_s is None:
        result.error = "no event carried a choice"


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` fields of a Server-Sent Events stream, as they arrive.

    Lines are split on bytes, at ``\\n`` only. httpx's ``aiter_lines`` splits decoded text the
    way ``str.splitlines`` does, also at U+2028, U+0085 and other separators, and a server that
    writes JSON with ``ensure_ascii=False`` sends those raw inside a chunk's text: generated
    text may hold any character. JSON escapes ``\\n`` itself, and UTF-8 never uses the byte
    0x0A inside a multi-byte character, so splitting the bytes there is always right.
    """
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[len(b"data:"):].strip().decode(errors="replace")
    if buffer.startswith(b"data:"):  # a last line without its newline
        yield buffer[len(b"data:"):].strip().decode(errors="replace")


def error_message(text: str) -> str:
    """The message of an OpenAI error body, else the text's start."""
    try:
        error = json.loads(text).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except (ValueError, AttributeError):
        pass
    return text[:300]


def make_client(concurrency: int, request_timeout_s: float) -> httpx.AsyncClient:
    # Enough connections for every request at once: a request waiting for a pooled
    # connection would count the client's queue as the server's latency. trust_env=False:
    # a proxy from the environment must not sit between the benchmark and a local server.
    limits = httpx.Limits(max_connections=concurrency + 8,
                          max_keepalive_connections=concurrency + 8)
    return httpx.AsyncClient(limits=limits, trust_env=False,
                             timeout=httpx.Timeout(request_timeout_s, connect=30.0))


SERVER_GAUGES = ("minisgl_running_requests", "minisgl_waiting_requests")
SERVER_COUNTERS = ("minisgl_generation_tokens_total", "minisgl_prompt_tokens_total",
                   "minisgl_frontend_failed_total", "minisgl_frontend_aborted_total")


async def read_metrics(client: httpx.AsyncClient, url: str) -> dict[str, int] | None:
    """``/metrics`` as name -> value; None where the server has none (not a minisgl server)."""
    try:
        response = await client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_metrics(response.text)


class MetricsWatch:
    """Samples the server's running and waiting requests while a rate runs."""

    def __init__(self, client: httpx.AsyncClient, url: str, interval_s: float) -> None:
        self.client, self.url, self.interval_s = client, url, interval_s
        self.samples: list[dict[str, float]] = []
        self.before: dict[str, float] | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.before = await read_metrics(self.client, self.url)
        if self.before is not None and self.interval_s > 0:
            self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            values = await read_metrics(self.client, self.url)
            if values is not None:
                self.samples.append(values)

    async def stop(self) -> dict[str, Any] | None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.before is None:
            return None
        after = await read_metrics(self.client, self.url)
        if after is None:
            return None
        out: dict[str, Any] = {
            name.removeprefix("minisgl_"): after.get(name, 0) - self.before.get(name, 0)
            for name in SERVER_COUNTERS}
        for name in SERVER_GAUGES:
            seen = [s[name] for s in self.samples if name in s]
            key = name.removeprefix("minisgl_")
            out[f"{key}_max"] = max(seen) if seen else None
            out[f"{key}_mean"] = sum(seen) / len(seen) if seen else None
        out["samples"] = len(self.samples)
        return out


async def run_round(client: httpx.AsyncClient, url: str, model: str | None,
                    prompts: list[list[int]], output_lens: list[int], arrivals: list[float],
                    progress: bool, desc: str, watch: MetricsWatch | None = None,
                    max_concurrency: int | None = None
                    ) -> tuple[list[RequestResult], float, dict[str, Any] | None]:
    """Send every request at its arrival time; returns the results, the duration (first
    arrival to the last stream's end) and what ``/metrics`` showed.

    With ``max_concurrency``, a request that arrives while that many are in flight waits for
    one of them to end (closed loop: with every arrival at 0, each end lets the next request
    in). Its latencies count from when it is sent, the wait is kept apart in ``queued_s``."""
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc=desc, unit="req", leave=False,
                       file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            pass
    results = [RequestResult(len(p), n, at) for p, n, at in zip(prompts, output_lens, arrivals)]
    if watch is not None:
        await watch.start()

    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(i: int, start: float) -> None:
        if slots is None:
            await send_request(client, url, model, prompts[i], results[i], start)
        else:
            queued = time.perf_counter()
            async with slots:
                results[i].queued_s = time.perf_counter() - queued
                await send_request(client, url, model, prompts[i], results[i], start)
        if bar is not None:
            bar.update(1)

    tasks: list[asyncio.Task[None]] = []
    start = time.perf_counter()
    try:
        for i, at in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, start)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # an interrupted run: close every stream (the server aborts them)
            task.cancel()
        if bar is not None:
            bar.close()
    ends = [r.sent_s + r.e2e_s for r in results if r.e2e_s is not None]
    duration = max(ends, default=time.perf_counter() - start)
    server = await watch.stop() if watch is not None else None
    return results, duration, server


# ----------------------------------------------------------------------------- printing
def header_info(args: argparse.Namespace, spawned: bool) -> dict[str, Any]:
    """The machine and the versions (of this machine: where the benchmark runs)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    info: dict[str, Any] = {
        "python": platform.python_version(), "httpx": httpx.__version__,
        "minisgl": installed("minisgl") or "source", "torch": installed("torch"),
        "flashinfer": installed("flashinfer-python") or installed("flashinfer")}
    device = None
    if spawned and args.device != "cpu":
        # Only here is torch imported (it takes seconds): to name the GPU the server runs on.
        try:
            import torch

            if torch.cuda.is_available():
                index = args.device.partition(":")[2] or "0"
                device = torch.cuda.get_device_name(int(index))
        except (ImportError, ValueError, RuntimeError):
            pass
    if device is None and spawned:
        threads = os.environ.get("OMP_NUM_THREADS", "unset")
        device = f"CPU ({platform.processor() or platform.machine()}, OMP_NUM_THREADS={threads})"
    info["device"] = device or "the server's (attached: not known here)"
    return info


def fmt_ms(values: dict[str, float] | None, keys: Sequence[str] = ("p50", "p90", "p99")) -> str:
    if values is None:
        return "-"
    return "/".join(f"{values[k]:.1f}" for k in keys)


def fmt_s(values: dict[str, float] | None, keys: Sequence[str] = ("p50", "p99")) -> str:
    if values is None:
        return "-"
    return "/".join(f"{values[k]:.3f}" for k in keys)


def describe(result: RateResult) -> str:
    """What one rate printed as soon as it finished."""
    rate = "inf (all at once)" if math.isinf(result.rate) else f"{result.rate:g} req/s"
    lines = [
        (f"rate {rate}: {len(result.requests)} requests, {result.errors} errors, "
         f"{result.duration_s:.2f} s: {result.request_throughput:.2f} req/s, "
         f"{result.output_throughput:.1f} output tok/s ({result.output_tokens} tokens)"),
        (f"  TTFT p50/p90/p99 {fmt_ms(result.metric('ttft_ms'))} ms; "
         f"TPOT {fmt_ms(result.metric('tpot_ms'))} ms; "
         f"ITL {fmt_ms(result.metric('itl_ms'))} ms; "
         f"E2E p50/p99 {fmt_s(result.metric('e2e_s'))} s")]
    good = result.goodput
    if result.objectives.items():
        lines.append(f"  goodput: {good['met']} of {len(result.requests)} requests met "
                     f"{result.objectives.describe()} = {good['per_s']:.2f} req/s "
                     f"({100 * good['fraction']:.0f}%)")
    server = result.server
    if server is not None:
        text = f"  server: {server['generation_tokens_total']:.0f} tokens generated"
        # A few samples of a short run say little: most of them fall between its requests.
        if server["samples"] >= MIN_METRIC_SAMPLES:
            text += (f"; running max {server['running_requests_max']:.0f} "
                     f"(mean {server['running_requests_mean']:.1f}), waiting max "
                     f"{server['waiting_requests_max']:.0f} ({server['samples']} samples "
                     "of /metrics)")
        lines.append(text)
    errors = [r.error for r in result.requests if r.error is not None]
    if errors:
        lines.append(f"  first error: {errors[0]}")
    if result.max_lag_s > LAG_WARNING_S:
        lines.append(f"  [WARNING: the client sent a request {result.max_lag_s * 1e3:.0f} ms "
                     "late; it is short of CPU, and its latencies include its own delays]")
    return "\n".join(lines)


def format_table(report: Report) -> str:
    rows = [("rate", "reqs", "err", "dur s", "req/s", "out tok/s", "TTFT p50/p90/p99 ms",
             "TPOT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "E2E p50/p99 s", "good req/s")]
    for r in report.results:
        rows.append((rate_label(r.rate), str(len(r.requests)), str(r.errors),
                     f"{r.duration_s:.2f}", f"{r.request_throughput:.2f}",
                     f"{r.output_throughput:.1f}", fmt_ms(r.metric("ttft_ms")),
                     fmt_ms(r.metric("tpot_ms")), fmt_ms(r.metric("itl_ms")),
                     fmt_s(r.metric("e2e_s")),
                     f"{r.goodput['per_s']:.2f}" if r.objectives.items() else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmark/online.py",
        description="Serving latency of an OpenAI-compatible server (TTFT, TPOT, ITL, E2E) "
                    "under Poisson load at several request rates.")
    server = parser.add_argument_group("the server: attach to one, or start one")
    server.add_argument("--url", default=None,
                        help="attach to the server running here, e.g. http://127.0.0.1:1919")
    server.add_argument("--model", default=None,
                        help="start `python -m minisgl --model MODEL` (default without --url: "
                             f"{DEFAULT_MODEL}); with --url, only read its config.json for "
                             "the vocabulary size")
    server.add_argument("--device", default="auto",
                        help="the started server's --device: auto, cpu or cuda (default: auto)")
    server.add_argument("--server-args", default="",
                        help="more options for the started server, one string, e.g. "
                             "\"--max-running-reqs 64 --no-overlap\"")
    server.add_argument("--server-log", type=Path, default=None,
                        help="the started server's log (default: a temporary file, removed "
                             "after a run that ends well)")
    server.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S,
                        help="seconds to wait for the started server's /health "
                             "(default: %(default)g)")
    server.add_argument("--vocab-size", type=int, default=None,
                        help="draw prompt token ids below this (default: the model's "
                             "config.json, found through --model or /v1/models)")
    load = parser.add_argument_group("the workload")
    load.add_argument("--rates", default="4,16,64,inf",
                      help="request rates (requests/s), comma-separated; inf sends every "
                           "request at once (default: %(default)s)")
    load.add_argument("--num-requests", type=int, default=64,
                      help="requests per rate (default: %(default)s)")
    load.add_argument("--min-input", type=int, default=4,
                      help="shortest prompt, in tokens (default: %(default)s)")
    load.add_argument("--max-input", type=int, default=512,
                      help="longest prompt, in tokens (default: %(default)s)")
    load.add_argument("--min-output", type=int, default=4,
                      help="fewest output tokens (default: %(default)s)")
    load.add_argument("--max-output", type=int, default=512,
                      help="most output tokens (default: %(default)s)")
    load.add_argument("--seed", type=int, default=0,
                      help="seed of the lengths, arrivals and prompts (default: %(default)s)")
    load.add_argument("--workload", choices=KINDS, default="random",
                      help="random: prompts of random ids, lengths in --min/--max-input; "
                           "shared-prefix: --num-prefixes system prompts of --prefix-len "
                           "tokens, each request one of them then a suffix with a length in "
                           "--min/--max-input; long-context: prompts in [--context-len / 2, "
                           "--context-len]; sharegpt: conversations from --dataset "
                           "(default: %(default)s)")
    load.add_argument("--num-prefixes", type=int, default=4,
                      help="shared-prefix: system prompts (default: %(default)s)")
    load.add_argument("--prefix-len", type=int, default=1024,
                      help="shared-prefix: tokens per system prompt (default: %(default)s)")
    load.add_argument("--context-len", type=int, default=8192,
                      help="long-context: the longest prompt (default: %(default)s)")
    load.add_argument("--dataset", type=Path, default=None,
                      help="sharegpt: a JSON file in the ShareGPT format (a list of "
                           "{\"conversations\": [{\"from\": \"human\", \"value\": ...}, "
                           "{\"from\": \"gpt\", ...}]}); prompts longer than --max-input "
                           "are passed over, and the same prompts run at every rate")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests in flight; the next waits for one to "
                           "end (closed loop with --rates inf; default: no cap)")
    load.add_argument("--goodput", default=DEFAULT_OBJECTIVES,
                      help="the latency objectives of goodput, in ms: NAME=MS,... with NAME "
                           "ttft, tpot or e2e; 'none' for none (default: %(default)s)")
    load.add_argument("--warmup-requests", type=int, default=4,
                      help=f"requests sent at once before the first rate, not measured "
                           f"({WARMUP_PROMPT_LEN}-token prompts, {WARMUP_OUTPUT_LEN} tokens "
                           "out; default: %(default)s)")
    load.add_argument("--request-timeout", type=float, default=600.0,
                      help="seconds one request may take (default: %(default)g)")
    load.add_argument("--metrics-interval", type=float, default=0.5,
                      help="seconds between samples of the server's /metrics while a rate "
                           "runs; 0 reads it only before and after (default: %(default)g)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the header, workload and results (every request's "
                             "numbers too) here as JSON")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (one line per rate is still printed)")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        args.rates = parse_rates(args.rates)
    except ValueError as exc:
        parser.error(f"--rates: {exc}")
    if args.num_requests < 1:
        parser.error(f"--num-requests must be >= 1, got {args.num_requests}")
    if not 1 <= args.min_input <= args.max_input:
        parser.error(f"need 1 <= --min-input <= --max-input, got {args.min_input} and "
                     f"{args.max_input}")
    if not 1 <= args.min_output <= args.max_output:
        parser.error(f"need 1 <= --min-output <= --max-output, got {args.min_output} and "
                     f"{args.max_output}")
    for flag in ("num_prefixes", "prefix_len", "context_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if (args.workload == "sharegpt") != (args.dataset is not None):
        parser.error("--workload sharegpt and --dataset PATH go together")
    if args.dataset is not None and not args.dataset.is_file():
        parser.error(f"--dataset {args.dataset}: no such file")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    try:
        args.goodput = parse_objectives(args.goodput)
    except ValueError as exc:
        parser.error(f"--goodput: {exc}")
    if args.warmup_requests < 0:
        parser.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if args.vocab_size is not None and args.vocab_size < 1:
        parser.error(f"--vocab-size must be >= 1, got {args.vocab_size}")
    for flag in ("startup_timeout", "request_timeout"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.metrics_interval < 0:
        parser.error(f"--metrics-interval must be >= 0, got {args.metrics_interval}")
    try:
        args.server_args = shlex.split(args.server_args)
    except ValueError as exc:
        parser.error(f"--server-args {args.server_args!r}: {exc}")
    if args.url is not None:
        args.url = args.url.rstrip("/")
        if args.server_args or args.server_log is not None:
            parser.error("--server-args and --server-log are for a server the benchmark "
                         "starts; they make no sense with --url")
    else:
        taken = {"--model", "--port", "--host", "--device"}
        clash = [a for a in args.server_args if a.split("=")[0] in taken]
        if clash:
            parser.error(f"--server-args may not set {', '.join(clash)}: the benchmark sets "
                         "--host and --port itself, and has --model and --device of its own")
        if args.model is None:
            args.model = DEFAULT_MODEL
        if Path(args.model).exists():  # a path relative to here must mean the same to the child
            args.model = str(Path(args.model).resolve())
        elif args.model == DEFAULT_MODEL:
            parser.error(f"{DEFAULT_MODEL} does not exist: build it with "
                         "`python tools/make_tiny_model.py`, or name a model with --model")


def model_config(path: str | None) -> dict[str, Any] | None:
    """The checkpoint's config.json, where ``path`` is a local directory holding one."""
    if path is None or not Path(path).is_dir():
        return None  # e.g. a hub id the server resolved itself
    try:
        return load_hf_config(path)
    except FileNotFoundError:
        return None


async def served_model(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """The first model of ``/v1/models`` (its ``id``; minisgl adds ``root``, its directory)."""
    try:
        response = await client.get(f"{url}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ServerError(f"{url}/v1/models did not name a model ({type(exc).__name__}: "
                          f"{exc}); is it an OpenAI-compatible server?") from None


def build_workload(args: argparse.Namespace, model_dir: str | None) -> Workload:
    """The requests the options ask for (``--workload`` and its options)."""
    inputs, outputs = (args.min_input, args.max_input), (args.min_output, args.max_output)
    if args.workload == "shared-prefix":
        return make_shared_prefix(args.num_requests, args.num_prefixes, args.prefix_len,
                                  inputs, outputs, args.seed)
    if args.workload == "long-context":
        return make_long_context(args.num_requests, args.context_len, outputs, args.seed)
    if args.workload == "sharegpt":
        if model_dir is None or not Path(model_dir).is_dir():
            raise ServerError("the sharegpt workload tokenizes the dataset with the model's "
                              "tokenizer: give --model as a local checkpoint directory")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        try:
            return load_sharegpt(args.dataset, lambda text: tokenizer.encode(
                text, add_special_tokens=False), args.num_requests, args.seed, args.max_input)
        except ValueError as exc:
            raise ServerError(str(exc)) from None
    return make_workload(args.num_requests, inputs, outputs, args.seed)


def describe_workload(args: argparse.Namespace, workload: Workload) -> str:
    outputs = f"outputs in [{args.min_output}, {args.max_output}] tokens"
    if workload.kind == "shared-prefix":
        return (f"{args.num_prefixes} system prompts of {args.prefix_len} random ids, each "
                f"request one of them in turn then a suffix uniform in [{args.min_input}, "
                f"{args.max_input}] tokens, {outputs}, new ids for every rate; a prefix cache "
                f"could skip {workload.predicted_prefill_savings()} prompt tokens per rate "
                "if each system prompt were cached before the rest of its group arrived")
    if workload.kind == "long-context":
        return (f"random-id prompts uniform in [{max(1, args.context_len // 2)}, "
                f"{args.context_len}] tokens, {outputs}, new for every rate")
    if workload.kind == "sharegpt":
        return (f"the first exchanges of {args.dataset.name} (prompt up to {args.max_input} "
                "tokens, output as long as the recorded reply), the same at every rate")
    return (f"random-id prompts uniform in [{args.min_input}, {args.max_input}] tokens, "
            f"{outputs}, new for every rate")


async def run(args: argparse.Namespace, report: Report, server: ServerProcess | None) -> None:
    """Everything after the server is ready: the model, the warm-up, every rate."""
    url = server.url if server is not None else args.url
    concurrency = max(args.num_requests, args.warmup_requests)
    async with make_client(concurrency, args.request_timeout) as client:
        if server is None:
            try:
                await client.get(f"{url}/health")
            except httpx.HTTPError as exc:
                raise ServerError(f"no server answers at {url} ({type(exc).__name__}: "
                                  f"{exc}); start one, or give --model to have one "
                                  "started") from None
        served = await served_model(client, url)
        config = model_config(args.model) or model_config(served.get("root"))
        vocab_size = args.vocab_size
        if vocab_size is None:
            if config is None or "vocab_size" not in config:
                raise ServerError(
                    "cannot tell the model's vocabulary size: no config.json at --model or at "
                    f"the server's model root ({served.get('root')!r}); give --vocab-size")
            vocab_size = int(config["vocab_size"])
        h = report.header
        h.update({"model": served.get("id"), "model_root": served.get("root"),
                  "architecture": ", ".join((config or {}).get("architectures", [])) or None,
                  "vocab_size": vocab_size})
        workload = build_workload(args, args.model or served.get("root"))
        report.workload.update({"kind": workload.kind, "input_lens": workload.input_lens,
                                "output_lens": workload.output_lens})
        if workload.kind == "shared-prefix":
            report.workload.update({
                "num_prefixes": args.num_prefixes, "prefix_len": args.prefix_len,
                "predicted_prefill_savings": workload.predicted_prefill_savings()})
        print(f"model: {h['model']} ({h['architecture'] or 'architecture not known'}), "
              f"vocabulary {vocab_size}")
        print(f"workload: {args.num_requests} requests per rate at "
              f"{', '.join(rate_label(r) for r in args.rates)} req/s (Poisson arrivals; inf = "
              f"all at once), {describe_workload(args, workload)} (seed {args.seed}): "
              f"{sum(workload.input_lens)} prompt and {sum(workload.output_lens)} output "
              "tokens per rate; greedy, end-of-sequence ignored, streamed")
        if args.max_concurrency:
            print(f"concurrency: at most {args.max_concurrency} requests in flight")
        print(f"goodput objectives: {args.goodput.describe()}")
        print("TTFT: send -> first text; TPOT: (E2E - TTFT) / (tokens - 1) per request; ITL: "
              "gaps between text chunks, pooled; E2E: send -> end of stream", flush=True)
        model_name = served.get("id")
        save(report, args.out)

        if args.warmup_requests:
            warm = Workload([min(WARMUP_PROMPT_LEN, args.max_input)] * args.warmup_requests,
                            [WARMUP_OUTPUT_LEN] * args.warmup_requests, args.seed)
            start = time.perf_counter()
            results, _, _ = await run_round(
                client, url, model_name, warm.prompts(vocab_size, -1), warm.output_lens,
                [0.0] * args.warmup_requests, progress=False, desc="warm-up")
            failed = [r.error for r in results if r.error is not None]
            if failed:
                raise ServerError(f"{len(failed)} of {len(results)} warm-up requests failed; "
                                  f"the first: {failed[0]}")
            print(f"warm-up: {args.warmup_requests} request(s) in "
                  f"{time.perf_counter() - start:.2f} s", flush=True)
        print(flush=True)

        for k, rate in enumerate(args.rates):
            watch = MetricsWatch(client, url, args.metrics_interval)
            results, duration, server_stats = await run_round(
                client, url, model_name, workload.prompts(vocab_size, k), workload.output_lens,
                workload.arrivals(rate), progress=not args.no_progress,
                desc=f"rate {rate_label(rate)}", watch=watch,
                max_concurrency=args.max_concurrency)
            result = RateResult(rate, results, duration, server_stats, args.goodput)
            report.results.append(result)
            print(describe(result), flush=True)
            save(report, args.out)


def main(argv: Sequence[str] | None = None) -> Report:
    """Run the benchmark; returns its report. Raises :class:`ServerError` when the server
    cannot be started or reached; the started server is stopped on every way out."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    report = Report(header={}, workload={
        "rates": [rate_label(r) if math.isinf(r) else r for r in args.rates],
        "num_requests": args.num_requests, "min_input": args.min_input,
        "max_input": args.max_input, "min_output": args.min_output,
        "max_output": args.max_output, "seed": args.seed,
        "max_concurrency": args.max_concurrency,
        "objectives": dict(args.goodput.items())})
    server: ServerProcess | None = None
    keep_log = True  # a temporary server log is kept when the run fails: the error names it
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    # SIGTERM unwinds like Ctrl-C, so that the server is stopped on the way out.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if args.url is None:
            # A session of its own: a Ctrl-C in the terminal reaches the benchmark only, which
            # then stops the server in order (and does so on its other ways out as well).
            # OMP_NUM_THREADS is left as this environment has it (the header reports it).
            server = ServerProcess(args.model, device=args.device, args=args.server_args,
                                   log_path=args.server_log, omp_threads=None, new_session=True)
            server.start()  # it loads while the header is gathered
        report.header.update(header_info(args, spawned=server is not None))
        h = report.header
        print(f"device: {h['device']}")
        print(f"versions: python {h['python']}, minisgl {h['minisgl']}, torch "
              f"{h['torch'] or 'not installed'}, flashinfer {h['flashinfer'] or 'not installed'}"
              f", httpx {h['httpx']}")
        if server is not None:
            print(f"server: python {shlex.join(server.command[1:])} (log: {server.log_path})",
                  flush=True)
            ready_s = server.wait_ready(args.startup_timeout)
            h.update({"server": "started", "url": server.url, "server_command": server.command,
                      "server_ready_s": ready_s, "server_pids": server_pids(server)})
            print(f"server: ready in {ready_s:.1f} s at {server.url}", flush=True)
        else:
            h.update({"server": "attached", "url": args.url})
            print(f"server: attached to {args.url}", flush=True)
        save(report, args.out)
        asyncio.run(run(args, report, server))
        if server is not None:
            start = time.monotonic()
            server.stop()  # SIGINT; past its 30 s, and for any process left, SIGKILL
            h["server_pids"] = server_pids(server)
            h["server_exit_code"] = server.exit_code
            print(f"\nserver: stopped in {time.monotonic() - start:.1f} s (SIGINT; exit code "
                  f"{server.exit_code})")
        print()
        print(format_table(report))
        save(report, args.out)
        keep_log = False
        return report
    except KeyboardInterrupt:
        keep_log = False
        raise
    finally:
        if server is not None:
            server.stop()
            if server.owns_log and not keep_log:
                server.log_path.unlink(missing_ok=True)
        signal.signal(signal.SIGTERM, previous_sigterm)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt()


def cli() -> int:
    """The command line: exit status 0 when every request succeeded, 1 otherwise."""
    try:
        report = main()
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted (a server the benchmark started has been stopped)",
              file=sys.stderr)
        return 130
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(cli())
