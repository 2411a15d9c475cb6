"""Tests for the goodput exercise: they are its specification.

The README's example first, then each rule on its own (one-token requests, failures, inclusive
bounds, an empty run), then random runs against percentiles read by numpy's own method.
"""

from __future__ import annotations

import random

import pytest
from goodput import Summary, Trace, summarize

EXAMPLE = [Trace(0.00, (0.10, 0.12, 0.14, 0.16)), Trace(0.05, (0.45, 0.47)),
           Trace(0.10, (0.20,)), Trace(0.20, ()), Trace(0.25, (0.30, 0.40, 0.50))]


def approx(values: dict[str, float]) -> object:
    return pytest.approx(values, abs=1e-9)


def test_the_readme_example() -> None:
    s = summarize(EXAMPLE, ttft_slo_ms=200, tpot_slo_ms=50)
    assert isinstance(s, Summary)
    assert s.good == 2, "A and C meet both objectives"
    assert s.duration_s == pytest.approx(0.5)
    assert s.goodput_per_s == pytest.approx(4.0)
    assert s.ttft_ms == approx({"p50": 100.0, "p90": 310.0, "p99": 391.0})
    assert s.tpot_ms == approx({"p50": 20.0, "p90": 84.0, "p99": 98.4})
    assert s.itl_ms == approx({"p50": 20.0, "p90": 100.0, "p99": 100.0})


def test_a_one_token_request_has_a_ttft_but_no_tpot_and_no_gap() -> None:
    s = summarize([Trace(1.0, (1.25,))], ttft_slo_ms=300, tpot_slo_ms=1)
    assert s.ttft_ms == approx({"p50": 250.0, "p90": 250.0, "p99": 250.0})
    assert s.tpot_ms is None and s.itl_ms is None
    assert s.good == 1, "a request without a TPOT cannot miss the TPOT objective"


def test_failed_requests_count_in_no_latency_and_are_never_good() -> None:
    ok = Trace(0.0, (0.1, 0.2))
    s = summarize([ok, Trace(0.0, ()), Trace(0.05, ())], ttft_slo_ms=1000, tpot_slo_ms=1000)
    assert s.good == 1
    assert s.ttft_ms == approx({"p50": 100.0, "p90": 100.0, "p99": 100.0})


def test_both_bounds_are_inclusive() -> None:
    at_bounds = Trace(0.0, (0.25, 0.5, 0.75))  # TTFT 250 ms, TPOT 250 ms
    assert summarize([at_bounds], 250, 250).good == 1
    assert summarize([at_bounds], 249.9, 250).good == 0
    assert summarize([at_bounds], 250, 249.9).good == 0


def test_the_duration_runs_from_the_first_send_to_the_last_token() -> None:
    s = summarize([Trace(2.0, (2.5,)), Trace(1.0, (1.2, 4.0)), Trace(0.5, ())], 10_000, 10_000)
    assert s.duration_s == pytest.approx(3.5), "the failed request was sent first"
    assert s.goodput_per_s == pytest.approx(2 / 3.5)


def test_a_run_where_everything_failed() -> None:
    s = summarize([Trace(0.0, ()), Trace(1.0, ())], 100, 100)
    assert (s.ttft_ms, s.tpot_ms, s.itl_ms) == (None, None, None)
    assert (s.good, s.duration_s, s.goodput_per_s) == (0, 0.0, 0.0)


def numpy_linear(values: list[float], q: float) -> float:
    """numpy.percentile's default method, written out (so the test needs no numpy)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@pytest.mark.parametrize("seed", range(5))
def test_random_runs(seed: int) -> None:
    rng = random.Random(seed)
    traces, ttfts, tpots, gaps, good = [], [], [], [], 0
    for _ in range(rng.randint(3, 40)):
        sent = rng.uniform(0, 5)
        n = rng.choice([0, 1, 2, rng.randint(3, 30)])
        times, now = [], sent + rng.expovariate(10)
        for _ in range(n):
            times.append(now)
            now += rng.expovariate(50)
        traces.append(Trace(sent, tuple(times)))
        if times:
            ttfts.append(times[0] - sent)
            tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
            tpots += [] if tpot is None else [tpot]
            gaps += [b - a for a, b in zip(times, times[1:])]
            good += ttfts[-1] <= 0.12 and (tpot is None or tpot <= 0.02)
    s = summarize(traces, ttft_slo_ms=120, tpot_slo_ms=20)
    for got, values in ((s.ttft_ms, ttfts), (s.tpot_ms, tpots), (s.itl_ms, gaps)):
        if not values:
            assert got is None
            continue
        assert got == approx({f"p{q}": 1e3 * numpy_linear(values, q) for q in (50, 90, 99)})
    assert s.good == good
