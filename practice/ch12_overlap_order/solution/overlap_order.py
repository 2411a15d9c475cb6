"""The overlapped decode loop on a fake device (reference solution)."""

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
    """Decode every request, overlapped: launch iteration k's batch, then process k-1's."""
    n = len(streams)
    outputs: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    dropped = [0] * n
    released: list[int | None] = [None] * n
    run = OverlapRun(outputs, reasons, dropped, released)
    zombies: set[int] = set()
    in_flight: tuple[list[int], list[int]] | None = None
    iteration = 0
    while True:
        batch = [r for r in range(n)
                 if reasons[r] is None and len(outputs[r]) < max_tokens[r]]
        if not batch and in_flight is None:
            return run
        launched = None
        if batch:
            tokens = fake_device(streams, batch, outputs)
            for r in batch:
                outputs[r].append(PENDING)
            launched = (batch, tokens)
            run.batches.append(batch)
        if in_flight is not None:
            prev_batch, prev_tokens = in_flight
            for r, token in zip(prev_batch, prev_tokens):
                if r in zombies:  # finished a step before: this sample is dropped
                    zombies.discard(r)
                    dropped[r] += 1
                    released[r] = iteration
                    continue
                slot = outputs[r].index(PENDING)
                tail = outputs[r][slot + 1:]
                del outputs[r][slot:]
                outputs[r].append(token)
                if token in stop_ids[r]:
                    reasons[r] = "stop"
                elif len(outputs[r]) >= max_tokens[r]:
                    reasons[r] = "length"
                if reasons[r] is None:
                    outputs[r].extend(tail)
                elif launched is not None and r in launched[0]:
                    zombies.add(r)  # it runs in the batch just launched: free pages later
                else:
                    released[r] = iteration
        in_flight = launched
        iteration += 1
