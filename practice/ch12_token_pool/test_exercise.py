"""Tests for the token-pool exercise: they are its specification.

The README's example first, then the rules one by one (feeds computed from lengths, prompts in
the pool before their first step, reads one step late, a finish by length, a stop while in the
next batch), then random workloads compared with the synchronous loop.
"""

from __future__ import annotations

import random

import pytest
from pool_loop import FakeDevice, fake_model, run_from_pool


def synchronous(prompts: list[list[int]], max_tokens: list[int],
                stop_ids: list[set[int]]) -> tuple[list[list[int]], list[str]]:
    """The obvious loop on the host: each token is known before the next one is computed."""
    outputs: list[list[int]] = []
    reasons: list[str] = []
    for prompt, limit, stops in zip(prompts, max_tokens, stop_ids):
        seq, out = list(prompt), []
        while True:
            out.append(fake_model(seq[-1], len(seq) - 1))
            seq.append(out[-1])
            if out[-1] in stops:
                reasons.append("stop")
                break
            if len(out) >= limit:
                reasons.append("length")
                break
        outputs.append(out)
    return outputs, reasons


def run(prompts, rows, max_tokens, stop_ids, row_len: int = 32):
    device = FakeDevice(max(rows) + 1, row_len)
    return run_from_pool(prompts, rows, max_tokens, stop_ids, device), device


# Request 1 stops on its second token, 34.
EXAMPLE = ([[5, 9, 2], [40]], [2, 0], [3, 4], [set(), {34}])


def test_the_readme_example() -> None:
    result, device = run(*EXAMPLE)
    assert result.outputs == [[79, 48, 64], [79, 34]]
    assert result.finish_reasons == ["length", "stop"]
    assert result.batches == [[0, 1], [0, 1], [0, 1]]
    assert result.dropped == [0, 1], "request 1 ran once more after its stop token"
    assert result.released_at == [3, 3], "request 1's row goes back when its extra run is read"
    assert device.log == [("launch", 0), ("launch", 1), ("read", 0), ("launch", 2),
                          ("read", 1), ("read", 2)]
    assert device.feeds == [[(2, 0, 3), (0, 0, 1)], [(2, 3, 4), (0, 1, 2)],
                            [(2, 4, 5), (0, 2, 3)]]


def test_every_position_is_fed_once_in_order() -> None:
    """A request feeds its whole prompt first, then one token a step: each position once."""
    prompts = [[1, 2, 3, 4], [5], [6, 7]]
    result, device = run(prompts, [1, 2, 0], [3, 5, 2], [set(), set(), set()])
    for r, row in enumerate([1, 2, 0]):
        spans = [(start, end) for feeds in device.feeds for (fed_row, start, end) in feeds
                 if fed_row == row]
        assert spans[0] == (0, len(prompts[r])), f"request {r}: the first step feeds the prompt"
        assert all(a[1] == b[0] and b[1] == b[0] + 1 for a, b in zip(spans, spans[1:])), \
            f"request {r}: each later step feeds the one position after the last fed"


def test_each_step_is_read_after_the_next_launch() -> None:
    """A launch must not wait for the step before: read step k only once step k+1 is
    launched (or when nothing is left to launch)."""
    result, device = run([[1, 2, 3], [4, 5], [6]], [0, 1, 2], [4, 6, 2], [set(), set(), set()])
    launched = [step for kind, step in device.log if kind == "launch"]
    for step in launched[:-1]:
        assert device.log.index(("read", step)) > device.log.index(("launch", step + 1)), \
            f"step {step} was read before step {step + 1} was launched"
    assert [step for kind, step in device.log if kind == "read"] == launched, \
        "every step is read exactly once, in order"


def test_the_outputs_hold_only_tokens_read_on_the_host() -> None:
    result, _ = run(*EXAMPLE)
    outputs, _ = synchronous(EXAMPLE[0], EXAMPLE[2], EXAMPLE[3])
    assert result.outputs == outputs


def test_a_request_finishing_by_length_never_runs_again() -> None:
    result, _ = run([[3, 4]], [0], [2], [set()])
    assert result.batches == [[0], [0]], ("once its last token is in flight, a request is "
                                          "known to finish by length: do not plan it again")
    assert result.dropped == [0] and result.released_at == [2]


def test_a_stop_on_the_first_token_is_dropped_once() -> None:
    first = fake_model(8, 1)
    result, _ = run([[7, 8]], [0], [5], [{first}])
    assert result.outputs == [[first]] and result.finish_reasons == ["stop"]
    assert result.batches == [[0], [0]], "the host learns of the stop after launching once more"
    assert result.dropped == [1] and result.released_at == [2]


@pytest.mark.parametrize("seed", range(20))
def test_random_workloads_match_the_synchronous_loop(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    rows = rng.sample(range(8), n)
    max_tokens = [rng.randint(1, 10) for _ in range(n)]
    reference, _ = synchronous(prompts, max_tokens, [set()] * n)
    stop_ids = [set(rng.sample(out, rng.randint(0, 1))) for out in reference]
    result, device = run(prompts, rows, max_tokens, stop_ids)
    outputs, reasons = synchronous(prompts, max_tokens, stop_ids)
    assert result.outputs == outputs, "the outputs differ from the synchronous loop"
    assert result.finish_reasons == reasons
    for r in range(n):
        runs = sum(r in batch for batch in result.batches)
        assert runs == len(outputs[r]) + result.dropped[r], \
            f"request {r}: every run is either a kept token or a dropped one"
        assert result.dropped[r] == (1 if reasons[r] == "stop" and len(outputs[r]) < max_tokens[r]
                                     else 0), f"request {r}: wrong number of dropped samples"
        last = max(k for k, batch in enumerate(result.batches) if r in batch)
        assert result.released_at[r] == last + 1, \
            f"request {r}: row freed at iteration {result.released_at[r]}, not after its last run"
    launched = [step for kind, step in device.log if kind == "launch"]
    for step in launched[:-1]:
        assert device.log.index(("read", step)) > device.log.index(("launch", step + 1))
