"""Latency percentiles and goodput from raw token times (reference solution)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

QUANTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class Trace:
    """One request as a client saw it: when it was sent and when each output token arrived
    (seconds, one clock for the whole run). A request that failed has no token times."""

    sent: float
    token_times: tuple[float, ...]


@dataclass
class Summary:
    """What :func:`summarize` reports. Each latency maps ``"p50"``, ``"p90"``, ``"p99"`` to
    milliseconds, or is None when no request gave a value."""

    ttft_ms: dict[str, float] | None
    tpot_ms: dict[str, float] | None
    itl_ms: dict[str, float] | None
    duration_s: float
    good: int
    goodput_per_s: float


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the two nearest ranks of the sorted values."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def quantiles_ms(values_s: Sequence[float]) -> dict[str, float] | None:
    if not values_s:
        return None
    return {f"p{q:g}": 1e3 * percentile(values_s, q) for q in QUANTILES}


def summarize(traces: Sequence[Trace], ttft_slo_ms: float, tpot_slo_ms: float) -> Summary:
    """Percentiles of TTFT, TPOT and ITL, and the goodput under both objectives.

    See README.md for the definitions.
    """
    ttfts, tpots, gaps = [], [], []
    good = 0
    for trace in traces:
        times = trace.token_times
        if not times:
            continue  # failed: no latency, never good
        ttft = times[0] - trace.sent
        ttfts.append(ttft)
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        if tpot is not None:
            tpots.append(tpot)
        gaps += [b - a for a, b in zip(times, times[1:])]
        if ttft * 1e3 <= ttft_slo_ms and (tpot is None or tpot * 1e3 <= tpot_slo_ms):
            good += 1
    ends = [t.token_times[-1] for t in traces if t.token_times]
    duration = max(ends) - min(t.sent for t in traces) if ends else 0.0
    return Summary(ttft_ms=quantiles_ms(ttfts), tpot_ms=quantiles_ms(tpots),
                   itl_ms=quantiles_ms(gaps), duration_s=duration, good=good,
                   goodput_per_s=good / duration if duration > 0 else 0.0)
