"""The online benchmark (``benchmark/online.py``): its own numbers must add up.

Without a model: the percentile and the Poisson schedule (seeded, reproducible, the rate's mean
gap), the workload, and the per-request and per-rate arithmetic on made-up timings.

With the tiny model on the CPU (slow): one small run in which every request must produce exactly
its drawn number of tokens, every summary must be the percentiles of the per-request numbers it
came from, and the throughput the tokens over the duration; the server the benchmark started
must be gone afterwards, also when the benchmark is interrupted with Ctrl-C, and a server that
dies at start-up must be reported with the end of its log.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmark" / "online.py"
RATES = [16.0, math.inf]
NUM_REQUESTS, MIN_INPUT, MAX_INPUT, MIN_OUTPUT, MAX_OUTPUT = 6, 4, 24, 2, 12


@pytest.fixture(scope="module")
def online(repo_script: Callable[[str], ModuleType]) -> ModuleType:
    return repo_script("benchmark/online.py")


# =========================================================================== helpers
def test_percentile_interpolates_like_numpy_and_stays_within_the_samples(
        online: ModuleType) -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        values = rng.exponential(size=n).tolist()
        previous = -math.inf
        for q in (0, 1, 25, 50, 90, 99, 100):
            got = online.percentile(values, q)
            assert got == pytest.approx(float(np.percentile(values, q)), rel=1e-12), (n, q)
            assert min(values) <= got <= max(values), f"p{q} of {n} values left [min, max]"
            assert got >= previous, f"p{q} is below a lower percentile"
            previous = got
    assert online.percentile([3.0, 1.0, 2.0], 50) == 2.0, "the input need not be sorted"
    assert online.percentile([1.0, 2.0], 50) == 1.5


def test_percentile_rejects_what_has_no_percentile(online: ModuleType) -> None:
    with pytest.raises(ValueError, match="no values"):
        online.percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        online.percentile([1.0], 101)


def test_poisson_arrivals_are_seeded_and_scale_with_the_rate(online: ModuleType) -> None:
    first = online.poisson_arrivals(2000, 10.0, seed=0)
    assert first == online.poisson_arrivals(2000, 10.0, seed=0), "same seed, other schedule"
    assert first != online.poisson_arrivals(2000, 10.0, seed=1), "another seed must differ"
    assert first[0] == 0.0, "the first request goes at once"
    gaps = [b - a for a, b in itertools.pairwise(first)]
    assert all(g >= 0 for g in gaps), "arrivals must not go back in time"
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.1, rel=0.1), f"mean gap {mean} is not 1/rate"
    # Exponential gaps: the standard deviation is the mean.
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert std == pytest.approx(mean, rel=0.15)
    # The same pattern at every rate, compressed: four times the rate, a quarter of the times.
    faster = online.poisson_arrivals(2000, 40.0, seed=0)
    assert faster == pytest.approx([t / 4 for t in first], rel=1e-12, abs=1e-12)
    assert online.poisson_arrivals(5, math.inf, seed=0) == [0.0] * 5
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="rate"):
            online.poisson_arrivals(5, bad, seed=0)


def test_rates_parse_with_inf_and_reject_nonsense(online: ModuleType) -> None:
    assert online.parse_rates("4, 16,inf") == [4.0, 16.0, math.inf]
    for bad in ("0", "-2", "fast", "4,,8"):
        with pytest.raises(ValueError):
            online.parse_rates(bad)


def test_the_workload_is_reproducible_and_within_bounds(online: ModuleType) -> None:
    first = online.make_workload(64, (100, 512), (10, 20), seed=0)
    again = online.make_workload(64, (100, 512), (10, 20), seed=0)
    other = online.make_workload(64, (100, 512), (10, 20), seed=1)
    assert (first.input_lens, first.output_lens) == (again.input_lens, again.output_lens)
    assert first.input_lens != other.input_lens, "another seed must draw other lengths"
    assert all(100 <= n <= 512 for n in first.input_lens)
    assert all(10 <= n <= 20 for n in first.output_lens)
    prompts = first.prompts(vocab_size=1000, round_index=0)
    assert prompts == again.prompts(vocab_size=1000, round_index=0)
    assert [len(p) for p in prompts] == first.input_lens
    assert all(0 <= t < 1000 for p in prompts for t in p)
    # Each rate gets new prompts, so the prefix cache cannot reuse an earlier rate's.
    assert prompts[0] != first.prompts(vocab_size=1000, round_index=1)[0]


def test_rate_arithmetic_on_made_up_timings(online: ModuleType) -> None:
    req = online.RequestResult
    a = req(10, 5, 0.0, sent_s=0.0, ttft_s=0.1, e2e_s=0.5, completion_tokens=5,
            chunk_s=[0.1, 0.2, 0.3, 0.5])  # one chunk carried two tokens
    b = req(10, 3, 0.2, sent_s=0.25, ttft_s=0.3, e2e_s=0.5, completion_tokens=3,
            chunk_s=[0.3, 0.4, 0.5])
    bad = req(10, 4, 0.3, sent_s=0.3, error="HTTP 400: prompt too long")
    assert a.tpot_s == pytest.approx(0.1) and b.tpot_s == pytest.approx(0.1)
    assert a.itl_s == pytest.approx([0.1, 0.1, 0.2])
    assert req(10, 1, 0.0, ttft_s=0.1, e2e_s=0.1, completion_tokens=1).tpot_s is None
    result = online.RateResult(rate=4.0, requests=[a, b, bad], duration_s=0.75)
    assert (len(result.completed), result.errors, result.output_tokens) == (2, 1, 8)
    assert result.output_throughput == pytest.approx(8 / 0.75)
    assert result.request_throughput == pytest.approx(2 / 0.75)
    ttft = result.metric("ttft_ms")
    assert (ttft["min"], ttft["max"]) == pytest.approx((100.0, 300.0))
    assert ttft["p50"] == pytest.approx(200.0)
    assert result.metric("itl_ms")["max"] == pytest.approx(200.0)
    assert result.max_lag_s == pytest.approx(0.05)
    assert online.RateResult(rate=4.0, requests=[bad], duration_s=1.0).metric("ttft_ms") is None


# =========================================================================== one request
def sse_stream(texts: list[str], completion_tokens: int) -> list[bytes]:
    """What minisgl sends for a streamed completion, cut into awkward network pieces."""
    events = [{"choices": [{"index": 0, "text": t, "finish_reason": None}], "usage": None}
              for t in texts]
    events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                   "usage": None})
    events.append({"choices": [], "usage": {"prompt_tokens": 3, "total_tokens": 3 +
                                            completion_tokens,
                                            "completion_tokens": completion_tokens}})
    body = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n"
                    for e in events) + b"data: [DONE]\n\n"
    return [body[i:i + 7] for i in range(0, len(body), 7)]  # lines split across reads


def send_mocked(online: ModuleType, pieces: list[bytes] | None, output_len: int,
                status: int = 200, error_body: bytes = b"") -> object:
    import asyncio

    import httpx

    async def stream() -> object:
        async def body():
            for piece in pieces or []:
                yield piece

        def handler(request: httpx.Request) -> httpx.Response:
            sent = json.loads(request.content)
            assert sent["stream"] and sent["ignore_eos"] and sent["temperature"] == 0
            assert sent["stream_options"] == {"include_usage": True}
            assert sent["max_tokens"] == output_len
            if status != 200:
                return httpx.Response(status, content=error_body)
            return httpx.Response(200, content=body())

        result = online.RequestResult(input_len=3, output_len=output_len, arrival_s=0.0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await online.send_request(client, "http://test", "m", [1, 2, 3], result,
                                      time.perf_counter())
        return result

    return asyncio.run(stream())


def test_a_stream_is_split_on_newlines_only(online: ModuleType) -> None:
    """Generated text may hold U+2028, U+0085 or a form feed, sent raw: they are line breaks
    to str.splitlines (and to httpx's aiter_lines), but not to Server-Sent Events."""
    texts = ["a\u2028b", "\x85", "c\x0cd\u2029", "é"]
    result = send_mocked(online, sse_stream(texts, 5), output_len=5)
    assert result.error is None, result.error
    assert result.completion_tokens == 5
    assert len(result.chunk_s) == len(texts)
    assert 0 < result.ttft_s == result.chunk_s[0] <= result.e2e_s
    assert len(result.itl_s) == len(texts) - 1


def test_wrong_lengths_and_http_errors_are_errors(online: ModuleType) -> None:
    short = send_mocked(online, sse_stream(["x", "y"], 2), output_len=4)
    assert "completion_tokens 2 != max_tokens 4" in short.error
    refused = send_mocked(online, None, output_len=4, status=400,
                          error_body=b'{"error": {"message": "prompt is too long"}}')
    assert refused.error == "HTTP 400: prompt is too long"
    no_usage = send_mocked(online, [b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n'],
                           output_len=1)
    assert "without a usage" in no_usage.error


# =========================================================================== a real run
def family_gone(pids: list[dict]) -> list[int]:
    """The pids of a recorded process family that still run (the same process, not a reuse)."""
    alive = []
    for entry in pids:
        try:
            p = psutil.Process(entry["pid"])
            if p.create_time() == entry["create_time"] and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(entry["pid"])
        except psutil.NoSuchProcess:
            pass
    return alive


def assert_server_gone(header: dict) -> None:
    pids = header["server_pids"]
    assert len(pids) >= 4, f"expected the launcher and its 3 workers, got {pids}"
    deadline = time.monotonic() + 15
    while family_gone(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not family_gone(pids), f"server processes left behind: {family_gone(pids)}"
    port = header["url"].rsplit(":", 1)[1]
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        assert not ("minisgl" in cmdline and f"--port {port}" in cmdline), \
            f"a server on port {port} still runs: {cmdline}"


@pytest.fixture(scope="module")
def cpu_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("online") / "results.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--device", "cpu",
         "--rates", ",".join(online_rate(r) for r in RATES),
         "--num-requests", str(NUM_REQUESTS), "--min-input", str(MIN_INPUT),
         "--max-input", str(MAX_INPUT), "--min-output", str(MIN_OUTPUT),
         "--max-output", str(MAX_OUTPUT), "--warmup-requests", "2", "--metrics-interval", "0.2",
         "--no-progress", "--out", str(out)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def online_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


@pytest.mark.slow
def test_every_request_produces_its_drawn_length_on_schedule(cpu_run: tuple[dict, str],
                                                             online: ModuleType) -> None:
    report, _ = cpu_run
    drawn = online.make_workload(NUM_REQUESTS, (MIN_INPUT, MAX_INPUT),
                                 (MIN_OUTPUT, MAX_OUTPUT), seed=0)
    assert report["workload"]["input_lens"] == drawn.input_lens
    assert report["workload"]["output_lens"] == drawn.output_lens
    assert [r["rate"] for r in report["results"]] == [16.0, "inf"]
    for rate, result in zip(RATES, report["results"]):
        assert (result["errors"], result["error_samples"]) == (0, [])
        assert result["num_requests"] == result["completed"] == NUM_REQUESTS
        requests = result["requests"]
        assert [r["input_len"] for r in requests] == drawn.input_lens
        assert [r["completion_tokens"] for r in requests] == drawn.output_lens, \
            "with ignore_eos every request must produce exactly its drawn output length"
        assert [r["arrival_s"] for r in requests] == pytest.approx(drawn.arrivals(rate))
        for r in requests:
            assert r["error"] is None
            assert 0 < r["ttft_s"] <= r["e2e_s"], "the first token came after the last"
            assert all(0 < t <= r["e2e_s"] for t in r["chunk_s"])
            assert r["chunk_s"] == sorted(r["chunk_s"])
            assert r["sent_s"] >= r["arrival_s"] - 1e-6, "a request went before its time"


@pytest.mark.slow
def test_summaries_are_the_percentiles_of_the_requests(cpu_run: tuple[dict, str],
                                                       online: ModuleType) -> None:
    report, _ = cpu_run
    for result in report["results"]:
        ok = [r for r in result["requests"] if r["error"] is None]
        samples = {
            "ttft_ms": [r["ttft_s"] * 1e3 for r in ok],
            "tpot_ms": [r["tpot_s"] * 1e3 for r in ok if r["tpot_s"] is not None],
            "itl_ms": [gap * 1e3 for r in ok for gap in r["itl_s"]],
            "e2e_s": [r["e2e_s"] for r in ok]}
        for r in ok:
            if r["completion_tokens"] > 1:
                assert r["tpot_s"] == pytest.approx(
                    (r["e2e_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1))
        for name, values in samples.items():
            summary = result[name]
            assert values and summary is not None, name
            assert summary["min"] == pytest.approx(min(values))
            assert summary["max"] == pytest.approx(max(values))
            assert summary["min"] <= summary["p50"] <= summary["p90"] <= summary["p99"] \
                <= summary["max"], f"{name}: percentiles out of order: {summary}"
            for q in (50, 90, 99):
                assert summary[f"p{q}"] == pytest.approx(online.percentile(values, q)), name


@pytest.mark.slow
def test_throughput_is_tokens_over_duration_and_is_what_was_printed(
        cpu_run: tuple[dict, str]) -> None:
    report, stdout = cpu_run
    table = {}
    for line in stdout.splitlines():
        match = re.match(r"^\s*(\S+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", line)
        if match:
            table[match[1]] = [float(x) for x in match.groups()[1:]]
    for result in report["results"]:
        requests = result["requests"]
        tokens = sum(r["completion_tokens"] for r in requests)
        assert result["output_tokens"] == tokens
        ends = [r["sent_s"] + r["e2e_s"] for r in requests]
        assert result["duration_s"] == pytest.approx(max(ends))
        assert result["output_throughput"] == pytest.approx(tokens / result["duration_s"])
        assert result["request_throughput"] == pytest.approx(
            len(requests) / result["duration_s"])
        reqs, errors, duration, req_s, tok_s = table[str(result["rate"]).removesuffix(".0")]
        assert (reqs, errors) == (NUM_REQUESTS, 0)
        assert duration == pytest.approx(result["duration_s"], abs=0.006)
        assert req_s == pytest.approx(result["request_throughput"], abs=0.006)
        assert tok_s == pytest.approx(result["output_throughput"], abs=0.06)
        server = result["server"]
        assert server is not None and server["frontend_failed_total"] == 0


@pytest.mark.slow
def test_no_server_process_is_left(cpu_run: tuple[dict, str]) -> None:
    report, stdout = cpu_run
    header = report["header"]
    assert header["server"] == "started"
    assert header["server_exit_code"] == 128 + signal.SIGINT, "not an orderly SIGINT stop"
    assert "server: stopped" in stdout
    assert_server_gone(header)


@pytest.mark.slow
def test_ctrl_c_stops_the_benchmark_and_its_server(tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--device", "cpu",
         "--rates", "0.5", "--num-requests", "100", "--max-input", "16", "--max-output", "64",
         "--warmup-requests", "1", "--no-progress", "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # until the first rate has started sending
            if line.startswith("warm-up:"):
                break
        else:
            pytest.fail(f"the benchmark ended early: {proc.wait()} {proc.stderr.read()[-3000:]}")
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "interrupted" in proc.stderr.read()
    assert_server_gone(json.loads(out.read_text())["header"])


def test_a_server_that_dies_is_reported_with_its_log(tiny_model_dir: Path, tmp_path: Path,
                                                     online: ModuleType) -> None:
    log = tmp_path / "server.log"
    with pytest.raises(online.ServerError, match=r"(?s)exited with code 2.*page_size") as info:
        online.main(["--model", str(tiny_model_dir), "--device", "cpu", "--server-log", str(log),
                     "--server-args", "--page-size 0", "--warmup-requests", "0"])
    assert f"end of its log ({log})" in str(info.value)
    assert log.exists(), "the log of a server that failed must be kept"
