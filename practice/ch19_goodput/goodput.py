"""Latency percentiles and goodput from raw token times (your code goes in summarize)."""

from __future__ import annotations

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


def summarize(traces: Sequence[Trace], ttft_slo_ms: float, tpot_slo_ms: float) -> Summary:
    """Percentiles of TTFT, TPOT and ITL, and the goodput under both objectives.

    See README.md for the definitions.
    """
    raise NotImplementedError("compute the latencies, their percentiles and the goodput")
