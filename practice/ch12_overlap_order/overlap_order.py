"""The overlapped decode loop on a fake device (your code goes in run_overlapped)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PENDING = -1  # stands in a request's outputs for a token still on the device


@dataclass
class OverlapRun:
    """What :func:`run_overlapped` produced, one entry per request."""

    outputs: list[list[int]]
    finish_reasons: list[str | None]
    dropped: list[int]  # samples computed after the request had finished, thrown away
    released_at: list[int | None]  # the iteration that freed the request's pages
    batches: list[list[int]] = field(default_factory=list)  # requests launched per iteration


def fake_device(streams: Sequence[Sequence[int]], batch: Sequence[int],
                outputs: Sequence[Sequence[int]]) -> list[int]:
    """The token each request of ``batch`` samples: ``streams[r][len(outputs[r])]``."""
    return [streams[r][len(outputs[r])] for r in batch]


def run_overlapped(streams: Sequence[Sequence[int]], max_tokens: Sequence[int],
                   stop_ids: Sequence[set[int]]) -> OverlapRun:
    """Decode every request, overlapped: launch iteration k's batch, then process k-1's.

    See README.md for the rules.
    """
    raise NotImplementedError("write the overlapped decode loop (see README.md)")
