"""Tests for the overlap-order exercise: they are its specification.

The README's example first, then rules checked one by one (a stop while in the next batch, a
finish by length, the planning of a request whose last token is in flight), then random
workloads compared with the synchronous loop.
"""

from __future__ import annotations

import random

import pytest
from overlap_order import PENDING, run_overlapped


def synchronous(streams: list[list[int]], max_tokens: list[int],
                stop_ids: list[set[int]]) -> tuple[list[list[int]], list[str]]:
    """The obvious loop: each token is read before the next step is planned."""
    outputs: list[list[int]] = []
    reasons: list[str] = []
    for stream, limit, stops in zip(streams, max_tokens, stop_ids):
        out: list[int] = []
        while True:
            out.append(stream[len(out)])
            if out[-1] in stops:
                reasons.append("stop")
                break
            if len(out) >= limit:
                reasons.append("length")
                break
        outputs.append(out)
    return outputs, reasons


EXAMPLE = ([[10, 11, 12], [20, 21, 22, 23, 24]], [3, 5], [set(), {21}])


def test_the_readme_example() -> None:
    run = run_overlapped(*EXAMPLE)
    assert run.outputs == [[10, 11, 12], [20, 21]]
    assert run.finish_reasons == ["length", "stop"]
    assert run.dropped == [0, 1], "request 1 ran once more after its stop token"
    assert run.released_at == [3, 3], "request 1's pages go back when its extra run is done"
    assert run.batches == [[0, 1], [0, 1], [0, 1]]


def test_no_placeholder_is_left() -> None:
    run = run_overlapped(*EXAMPLE)
    assert not any(PENDING in out for out in run.outputs), "a PENDING placeholder was left"


def test_a_request_finishing_by_length_never_runs_again() -> None:
    run = run_overlapped([[1, 2, 3, 4]], [2], [set()])
    assert run.batches == [[0], [0]], ("once its last token is in flight, a request is known "
                                       "to finish by length: do not plan it again")
    assert run.dropped == [0]
    assert run.released_at == [2]


def test_a_stop_on_the_first_token_is_dropped_once() -> None:
    run = run_overlapped([[7, 8, 9]], [3], [{7}])
    assert run.outputs == [[7]]
    assert run.batches == [[0], [0]], "the host learns of the stop after launching once more"
    assert run.dropped == [0 + 1]
    assert run.released_at == [2]


def test_a_stop_on_the_last_allowed_token_is_not_a_zombie() -> None:
    run = run_overlapped([[1, 2, 3]], [2], [{2}])
    assert run.outputs == [[1, 2]] and run.finish_reasons == ["stop"]
    assert run.dropped == [0], "its last token was in flight: it was never planned again"


@pytest.mark.parametrize("seed", range(20))
def test_random_workloads_match_the_synchronous_loop(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    streams = [[rng.randrange(20) for _ in range(12)] for _ in range(n)]
    max_tokens = [rng.randint(1, 12) for _ in range(n)]
    stop_ids = [set(rng.sample(range(20), rng.randint(0, 3))) for _ in range(n)]
    run = run_overlapped(streams, max_tokens, stop_ids)
    outputs, reasons = synchronous(streams, max_tokens, stop_ids)
    assert run.outputs == outputs, "the outputs differ from the synchronous loop"
    assert run.finish_reasons == reasons
    for r in range(n):
        runs = sum(r in batch for batch in run.batches)
        assert runs == len(outputs[r]) + run.dropped[r], \
            f"request {r}: every run is either a kept token or a dropped one"
        assert run.dropped[r] == (1 if reasons[r] == "stop" and len(outputs[r]) < max_tokens[r]
                                  else 0), f"request {r}: wrong number of dropped samples"
        last = max(k for k, batch in enumerate(run.batches) if r in batch)
        assert run.released_at[r] == last + 1, \
            f"request {r}: pages freed at iteration {run.released_at[r]}, not after its last run"
