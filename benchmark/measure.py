"""The arithmetic every benchmark shares: percentiles, summaries and goodput.

Latencies are kept per request (or per gap between tokens) and reduced only at the end, so that
a summary can always be recomputed from the numbers it came from. A *percentile* is read with
linear interpolation between the two nearest ranks (numpy's default), so it always lies between
the smallest and the largest sample. *Goodput* counts only the requests that met every stated
latency objective, per second of the run: a server that answers fast on average but lets one
request in five miss its time to first token has a throughput and a lower goodput.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PERCENTILES = (50.0, 90.0, 99.0)
OBJECTIVE_NAMES = ("ttft", "tpot", "e2e")  # the latencies an objective may bound, in ms


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of ``values``, interpolating linearly between
    the two nearest ranks (numpy's default method), so it always lies within [min, max]."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    frac = pos - low
    # min() keeps rounding from stepping past the larger of the two neighbours.
    return min(ordered[low] + (ordered[high] - ordered[low]) * frac, ordered[high])


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float] | None:
    """Mean, min, max and percentiles of ``values`` times ``scale``; None without values."""
    if not values:
        return None
    scaled = [v * scale for v in values]
    out = {"mean": sum(scaled) / len(scaled), "min": min(scaled), "max": max(scaled)}
    out.update({f"p{q:g}": percentile(scaled, q) for q in PERCENTILES})
    return out


@dataclass(frozen=True)
class Objectives:
    """Latency objectives a request must meet to count towards goodput (milliseconds; None
    sets no bound). A request with a single output token has no TPOT and meets that bound."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None) -> bool:
        """Whether one completed request's latencies (seconds) are all within bounds."""
        checks = ((self.ttft_ms, ttft_s, False), (self.tpot_ms, tpot_s, True),
                  (self.e2e_ms, e2e_s, False))
        for bound, value, may_be_missing in checks:
            if bound is None:
                continue
            if value is None:
                if not may_be_missing:
                    return False  # a request without a first token missed every objective
                continue
            if value * 1e3 > bound:
                return False
        return True

    def describe(self) -> str:
        parts = [f"{name.upper()} <= {bound:g} ms" for name, bound in self.items()]
        return " and ".join(parts) if parts else "none"

    def items(self) -> list[tuple[str, float]]:
        bounds = (self.ttft_ms, self.tpot_ms, self.e2e_ms)
        return [(name, b) for name, b in zip(OBJECTIVE_NAMES, bounds) if b is not None]


def parse_objectives(text: str) -> Objectives:
    """``"ttft=500,tpot=50"`` -> objectives in milliseconds; ``""`` or ``"none"`` sets none."""
    bounds: dict[str, float] = {}
    if text.strip().lower() in ("", "none"):
        return Objectives()
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in OBJECTIVE_NAMES:
            raise ValueError(f"bad objective {part.strip()!r} in {text!r}: expected NAME=MS "
                             f"with NAME one of {', '.join(OBJECTIVE_NAMES)}")
        if f"{name}_ms" in bounds:
            raise ValueError(f"objective {name} given twice in {text!r}")
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(f"objective {name}={value.strip()!r}: not a number of "
                             "milliseconds") from None
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"objective {name}={value.strip()!r} must be a positive number "
                             "of milliseconds")
        bounds[f"{name}_ms"] = bound
    return Objectives(**bounds)


def goodput(completed: Sequence[tuple[float | None, float | None, float | None]],
            num_requests: int, objectives: Objectives, duration_s: float) -> dict[str, float]:
    """Requests meeting every objective: how many, what share of all ``num_requests`` (a
    failed request meets none), and how many per second of the run. ``completed`` holds one
    ``(ttft_s, tpot_s, e2e_s)`` per request that completed."""
    if len(completed) > num_requests:
        raise ValueError(f"{len(completed)} completed requests out of {num_requests}")
    met = sum(objectives.met(*latencies) for latencies in completed)
    return {"met": met, "fraction": met / num_requests if num_requests else 0.0,
            "per_s": met / duration_s if duration_s > 0 else 0.0}
