"""Tests for the logit-adjustments exercise: they are its specification.

The README's example first, then each rule on its own (the order of the steps, what the
repetition penalty counts and what the frequency and presence penalties count, min_tokens'
boundary, ids outside the vocabulary, untouched rows and arguments, bad input), then random
batches against chapter 21's own ``adjust_logits`` when torch is there (in the browser, without
torch, that one is skipped).
"""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
from penalties import Request, adjust_batch

INF = float("inf")
EXAMPLE_LOGITS = [[2.0, -1.0, 0.5, 1.0, 0.0]]
EXAMPLE = Request(prompt=[1], output=[3, 3, 2], logit_bias={4: 1.5}, min_tokens=4,
                  repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
HAS_TORCH = importlib.util.find_spec("torch") is not None


def same(got: list[list[float]], expected: list[list[float]], tol: float = 1e-9) -> bool:
    return len(got) == len(expected) and all(
        len(g) == len(e) and all(a == b or math.isclose(a, b, rel_tol=tol, abs_tol=tol)
                                 for a, b in zip(g, e))
        for g, e in zip(got, expected))


def test_the_readme_example() -> None:
    got = adjust_batch(EXAMPLE_LOGITS, [EXAMPLE], stop_ids={0})
    assert same(got, [[-INF, -2.0, -0.5, -0.75, 1.5]])


def test_a_request_without_adjustments_gets_its_row_back_and_nothing_is_modified() -> None:
    logits = [[0.3, -0.2, 1.7], [1.0, 2.0, 3.0]]
    plain = Request(prompt=[0, 1, 2], output=[2, 2])
    asking = Request(prompt=[0], output=[1], presence_penalty=1.0)
    got = adjust_batch(logits, [plain, asking], stop_ids={2})
    assert same(got, [[0.3, -0.2, 1.7], [1.0, 1.0, 3.0]])
    assert logits == [[0.3, -0.2, 1.7], [1.0, 2.0, 3.0]], "the logits given must not change"
    assert got[0] is not logits[0], "return new rows, not the rows given"


def test_the_bias_is_added_before_the_repetition_penalty_scales_it() -> None:
    # 1.0 + 2.0 = 3.0, then divided by 1.5: 2.0 (scaling first would give 1.0/1.5 + 2.0)
    req = Request(prompt=[0], logit_bias={0: 2.0}, repetition_penalty=1.5)
    assert same(adjust_batch([[1.0, 0.0]], [req], stop_ids=()), [[2.0, 0.0]])


def test_a_bias_can_make_a_logit_negative_and_the_penalty_then_multiplies_it() -> None:
    req = Request(prompt=[0], logit_bias={0: -3.0}, repetition_penalty=2.0)
    assert same(adjust_batch([[1.0, 0.5]], [req], stop_ids=()), [[-4.0, 0.5]])


def test_repetition_scales_each_seen_token_once_and_counts_the_prompt() -> None:
    # token 0 is in the prompt only, token 1 appears three times, token 2 is negative, 3 unseen
    req = Request(prompt=[0, 2], output=[1, 1, 1], repetition_penalty=2.0)
    got = adjust_batch([[4.0, 4.0, -4.0, 4.0]], [req], stop_ids=())
    assert same(got, [[2.0, 2.0, -8.0, 4.0]])


def test_a_repetition_penalty_below_one_favours_the_tokens_seen() -> None:
    req = Request(prompt=[1], repetition_penalty=0.5)
    assert same(adjust_batch([[1.0, 1.0, -1.0]], [req], stop_ids=()), [[1.0, 2.0, -1.0]])


def test_frequency_and_presence_count_the_output_only() -> None:
    # token 0 only in the prompt: untouched; token 1 twice: 1 - 2*1 - 0.5; token 2 once
    req = Request(prompt=[0, 0, 0], output=[1, 2, 1], frequency_penalty=1.0,
                  presence_penalty=0.5)
    got = adjust_batch([[0.0, 1.0, 1.0, 1.0]], [req], stop_ids=())
    assert same(got, [[0.0, -1.5, -0.5, 1.0]])


def test_negative_penalties_push_repeated_tokens_up() -> None:
    req = Request(prompt=[0], output=[2, 2], frequency_penalty=-0.5, presence_penalty=-1.0)
    assert same(adjust_batch([[0.0, 0.0, 0.0]], [req], stop_ids=()), [[0.0, 0.0, 2.0]])


def test_min_tokens_bans_the_stop_tokens_only_until_enough_are_generated() -> None:
    logits = [[1.0, 2.0, 3.0, 4.0]] * 3
    reqs = [Request(prompt=[0], output=[3, 3], min_tokens=3),   # 2 < 3: banned
            Request(prompt=[0], output=[3, 3, 3], min_tokens=3),  # 3 generated: free
            Request(prompt=[0], output=[], min_tokens=1)]       # the very first token
    got = adjust_batch(logits, reqs, stop_ids={1, 3})
    assert same(got, [[1.0, -INF, 3.0, -INF], [1.0, 2.0, 3.0, 4.0], [1.0, -INF, 3.0, -INF]])


def test_a_banned_stop_token_stays_banned_whatever_its_bias_or_penalty() -> None:
    req = Request(prompt=[1], output=[1], logit_bias={1: 100.0}, min_tokens=5,
                  repetition_penalty=0.5, frequency_penalty=-2.0, presence_penalty=-2.0)
    assert adjust_batch([[0.0, 0.0]], [req], stop_ids={1})[0][1] == -INF


def test_ids_outside_the_vocabulary_change_nothing() -> None:
    req = Request(prompt=[0, 7], output=[9, 1], logit_bias={5: 10.0, 1: 1.0}, min_tokens=4,
                  repetition_penalty=2.0, frequency_penalty=1.0)
    got = adjust_batch([[2.0, 2.0, 2.0]], [req], stop_ids={2, 11})
    # token 0: prompt, scaled; token 1: bias then scaled then counted once; token 2: banned
    assert same(got, [[1.0, 0.5, -INF]])


def test_every_row_follows_its_own_request() -> None:
    logits = [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    reqs = [Request(prompt=[0], logit_bias={1: 1.0}),
            Request(prompt=[0], repetition_penalty=4.0),
            Request(prompt=[1], output=[0], presence_penalty=0.25)]
    assert same(adjust_batch(logits, reqs, stop_ids=()), [[1.0, 2.0], [0.25, 1.0], [0.75, 1.0]])


def test_bad_input_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        adjust_batch([[1.0, 2.0]], [Request(prompt=[0]), Request(prompt=[1])], stop_ids=())
    with pytest.raises(ValueError):
        adjust_batch([[1.0, 2.0], [1.0]], [Request(prompt=[0]), Request(prompt=[1])],
                     stop_ids=())


def random_batch(rng: random.Random, vocab: int) -> tuple[list[list[float]], list[Request]]:
    logits, reqs = [], []
    for _ in range(rng.randint(1, 6)):
        logits.append([rng.uniform(-5, 5) for _ in range(vocab)])
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        reqs.append(Request(
            prompt=[rng.randrange(vocab) for _ in range(rng.randint(1, 8))], output=output,
            logit_bias={rng.randrange(vocab): rng.uniform(-100, 100)
                        for _ in range(rng.randint(0, 3))},
            min_tokens=rng.choice([0, 0, len(output), len(output) + 1]),
            repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
            frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
            presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)])))
    return logits, reqs


def engine_adjusted(logits: list[list[float]], reqs: list[Request],
                    stop_ids: set[int]) -> list[list[float]]:
    """Chapter 21's adjust_logits on the same batch: the requests' tokens in a token pool."""
    import torch

    from minisgl.core import Batch, Req, SamplingParams
    from minisgl.engine.adjustments import adjust_logits
    from minisgl.engine.token_pool import TokenPool

    pool = TokenPool(len(reqs), 64, torch.device("cpu"))
    engine_reqs = []
    for row, r in enumerate(reqs):
        params = SamplingParams(logit_bias=dict(r.logit_bias), min_tokens=r.min_tokens,
                                repetition_penalty=r.repetition_penalty,
                                frequency_penalty=r.frequency_penalty,
                                presence_penalty=r.presence_penalty)
        req = Req(row, list(r.prompt), params)
        req.output_ids = list(r.output)
        req.table_row = row
        tokens = [*r.prompt, *r.output]
        pool.ids[row, :len(tokens)] = torch.tensor(tokens)
        engine_reqs.append(req)
    batch = Batch(engine_reqs, "prefill")
    return adjust_logits(torch.tensor(logits), batch, pool, sorted(stop_ids)).tolist()


@pytest.mark.skipif(not HAS_TORCH, reason="the engine needs torch (the judge has it)")
def test_random_batches_match_the_engines_adjust_logits() -> None:
    rng = random.Random(21)
    for _ in range(200):
        vocab = rng.randint(2, 12)
        logits, reqs = random_batch(rng, vocab)
        stop_ids = {rng.randrange(vocab) for _ in range(rng.randint(0, 2))}
        expected = engine_adjusted(logits, reqs, stop_ids)
        got = adjust_batch(logits, reqs, stop_ids)
        assert same(got, expected, tol=1e-4), (logits, reqs, stop_ids)
