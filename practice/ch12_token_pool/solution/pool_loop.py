"""Overlapped decoding from a token pool on a fake device (reference solution)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

VOCAB = 97


def fake_model(token: int, position: int) -> int:
    """The token a request samples after feeding ``token`` at ``position`` (a stand-in model)."""
    return (token * 31 + position * 7 + 3) % VOCAB


class FakeDevice:
    """A device that keeps a token pool: one row per request, one column per position.

    The host may write prompt tokens into the pool (:meth:`write`), launch a step
    (:meth:`launch`) and read a launched step's sampled tokens (:meth:`read`). The pool itself
    is the device's: the host never looks at it. ``log`` records every launch and read, in
    order, and ``feeds`` each launch's feeds.
    """

    def __init__(self, num_rows: int, row_len: int) -> None:
        self._pool: list[list[int | None]] = [[None] * row_len for _ in range(num_rows)]
        self._steps: list[list[int]] = []
        self.log: list[tuple[str, int]] = []
        self.feeds: list[list[tuple[int, int, int]]] = []

    def write(self, row: int, start: int, ids: Sequence[int]) -> None:
        """The host writes ``ids`` at positions ``start, start + 1, ...`` of ``row``."""
        self._pool[row][start:start + len(ids)] = list(ids)

    def launch(self, feeds: Sequence[tuple[int, int, int]]) -> int:
        """Run one step; returns its number (0, 1, ...).

        Each feed ``(row, start, end)`` is one request: it feeds the tokens at positions
        ``start .. end - 1`` of its row, and its sampled token is written at position ``end``.
        """
        tokens = []
        for row, start, end in feeds:
            if not 0 <= start < end < len(self._pool[row]):
                raise ValueError(f"feed {(row, start, end)}: positions out of the row")
            fed = self._pool[row][start:end]
            if None in fed:
                raise ValueError(f"feed {(row, start, end)}: position "
                                 f"{start + fed.index(None)} of row {row} holds no token yet")
            token = fake_model(fed[-1], end - 1)
            self._pool[row][end] = token
            tokens.append(token)
        self._steps.append(tokens)
        self.feeds.append(list(feeds))
        self.log.append(("launch", len(self._steps) - 1))
        return len(self._steps) - 1

    def read(self, step: int) -> list[int]:
        """Bring step ``step``'s sampled tokens to the host, one per feed, in order."""
        self.log.append(("read", step))
        return list(self._steps[step])


@dataclass
class PoolRun:
    """What :func:`run_from_pool` produced, one entry per request."""

    outputs: list[list[int]]
    finish_reasons: list[str | None]
    dropped: list[int]  # samples computed after the request had finished, thrown away
    released_at: list[int | None]  # the iteration that freed the request's row and pages
    batches: list[list[int]] = field(default_factory=list)  # requests launched per iteration


def run_from_pool(prompts: Sequence[Sequence[int]], rows: Sequence[int],
                  max_tokens: Sequence[int], stop_ids: Sequence[set[int]],
                  device: FakeDevice) -> PoolRun:
    """Generate for every request, overlapped: launch iteration k's batch, then read k-1's."""
    n = len(prompts)
    outputs: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    dropped = [0] * n
    released: list[int | None] = [None] * n
    run = PoolRun(outputs, reasons, dropped, released)
    in_flight = [0] * n  # sampled on the device, not read yet
    fed = [0] * n  # leading tokens already fed to the model
    for r, prompt in enumerate(prompts):
        device.write(rows[r], 0, prompt)
    previous: tuple[list[int], int] | None = None  # (requests, step) launched, not read
    iteration = 0
    while True:
        batch = [r for r in range(n) if reasons[r] is None
                 and len(outputs[r]) + in_flight[r] < max_tokens[r]]
        if not batch and previous is None:
            return run
        launched = None
        if batch:
            feeds = []
            for r in batch:
                length = len(prompts[r]) + len(outputs[r]) + in_flight[r]
                feeds.append((rows[r], fed[r], length))
                fed[r] = length
                in_flight[r] += 1
            launched = (batch, device.launch(feeds))
            run.batches.append(batch)
        if previous is not None:
            prev_batch, step = previous
            for r, token in zip(prev_batch, device.read(step)):
                in_flight[r] -= 1
                if reasons[r] is not None:  # a zombie: it finished on the token before
                    dropped[r] += 1
                    released[r] = iteration
                    continue
                outputs[r].append(token)
                if token in stop_ids[r]:
                    reasons[r] = "stop"
                elif len(outputs[r]) >= max_tokens[r]:
                    reasons[r] = "length"
                if reasons[r] is not None and not in_flight[r]:
                    released[r] = iteration
        previous = launched
        iteration += 1
