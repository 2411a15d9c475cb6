"""Tests for the seeded-sampling exercise: they are its specification.

The expected tokens come from `reference_race` below: the race as chapter 4 writes it, in
probability space (`argmax(p / E)` with `p` a float64 softmax), fed the same exponential draws.
Your version works in log space with no softmax, so agreeing with it is the point.
"""

from __future__ import annotations

import random

import pytest
import torch
from seeded_sampler import RequestSampler, gumbel_race

VOCAB = 64


def stream(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_race(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """One row, the chapter's way: softmax, then argmax(p / E) with E ~ Exp(1) from `generator`."""
    if temperature == 0:
        return int(logits.argmax())
    noise = torch.empty(logits.shape[-1], dtype=torch.float32).exponential_(generator=generator)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return int((probs / noise.double().clamp(min=torch.finfo(torch.float32).tiny)).argmax())


def logits_of(uid: int, step: int) -> torch.Tensor:
    """What a model might say for request `uid` at `step`: a fixed, fairly flat row."""
    return torch.randn(VOCAB, generator=stream(1000 * uid + step)) * 1.5


def alone(uid: int, temperature: float, seed: int, steps: int) -> list[int]:
    generator = stream(seed)
    return [reference_race(logits_of(uid, s), temperature, generator) for s in range(steps)]


# The README's example: three rows, a greedy one, two seeded ones.
EXAMPLE_LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0], [2.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_the_readme_example() -> None:
    temperatures = [0.0, 1.0, 1.0]
    got = gumbel_race(EXAMPLE_LOGITS.clone(), temperatures, [None, stream(7), stream(7)]).tolist()
    expected = [reference_race(EXAMPLE_LOGITS[r], temperatures[r], stream(7)) for r in range(3)]
    assert got == expected, (f"logits {EXAMPLE_LOGITS.tolist()}, temperatures {temperatures}, "
                             f"generators [None, seed 7, seed 7]: expected {expected}, got {got}")


def test_a_greedy_row_takes_the_argmax_and_draws_nothing() -> None:
    logits = torch.tensor([[0.5, 3.0, 3.0, -1.0]])
    generator = stream(3)
    before = generator.get_state()
    got = gumbel_race(logits, [0.0], [generator]).tolist()
    assert got == [1], (f"logits {logits.tolist()} at temperature 0: expected [1] (the first "
                        f"argmax), got {got}")
    assert torch.equal(generator.get_state(), before), "a greedy row advanced its generator"


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_each_row_draws_from_its_own_generator(temperature: float) -> None:
    logits = torch.stack([logits_of(uid, 0) for uid in range(6)])
    seeds = [11, 12, 13, 11, 20, 21]
    got = gumbel_race(logits, [temperature] * 6, [stream(s) for s in seeds]).tolist()
    expected = [reference_race(logits[r], temperature, stream(seeds[r])) for r in range(6)]
    assert got == expected, (f"6 rows at temperature {temperature}, row r seeded {seeds}: "
                             f"expected {expected}, got {got}")


def test_the_race_samples_the_softmax() -> None:
    logits = torch.tensor([1.0, 0.0, -0.5, 0.3])
    temperature = 0.7
    draws = 20_000
    generator = stream(0)
    counts = torch.zeros(4)
    for _ in range(draws // 500):
        tokens = gumbel_race(logits.repeat(500, 1), [temperature] * 500, [generator] * 500)
        counts += torch.bincount(tokens, minlength=4)
    got = (counts / draws).tolist()
    expected = torch.softmax(logits / temperature, dim=-1).tolist()
    worst = max(abs(g - e) for g, e in zip(got, expected))
    assert worst < 0.015, (f"logits {logits.tolist()} at T={temperature}, {draws:,} draws: "
                           f"expected frequencies {[round(e, 3) for e in expected]}, "
                           f"got {[round(g, 3) for g in got]}")


def test_a_filtered_token_never_wins() -> None:
    logits = torch.full((200, 8), float("-inf"))
    logits[:, 5] = 0.0
    logits[:, 2] = 0.1
    tokens = gumbel_race(logits, [1.5] * 200, [stream(s) for s in range(200)])
    winners = sorted(set(tokens.tolist()))
    assert set(winners) <= {2, 5}, f"only tokens 2 and 5 have finite logits, but {winners} won"


def test_a_sampled_row_without_a_generator_is_named() -> None:
    logits = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="row 1"):
        gumbel_race(logits, [0.0, 1.0, 0.0], [None, None, None])


def test_a_seeded_request_does_not_depend_on_its_neighbours() -> None:
    """Request 7 (seed 11) alone, against request 7 in a batch that changes every step."""
    expected = alone(7, 1.0, 11, steps=12)
    sampler = RequestSampler(shared_seed=5)
    sampler.add(7, temperature=1.0, seed=11)
    sampler.add(1, temperature=0.8)  # unseeded: draws from the shared stream
    sampler.add(2, temperature=0.0)  # greedy
    shuffle = random.Random(0)
    got = []
    for step in range(12):
        if step == 4:
            sampler.add(3, temperature=1.2, seed=11)  # same seed as request 7, another request
        if step == 8:
            sampler.remove(1)
        batch = [7, 2] + ([1] if step < 8 else []) + ([3] if step >= 4 else [])
        shuffle.shuffle(batch)
        tokens = sampler.step(batch, torch.stack([logits_of(uid, step) for uid in batch]))
        got.append(tokens[batch.index(7)])
    assert got == expected, (f"request 7, seed 11, temperature 1.0, 12 steps among changing "
                             f"neighbours: expected its tokens alone {expected}, got {got}")


def test_the_stream_advances_every_step() -> None:
    """Re-seeding every step would replay the same noise: on a flat row, the same token."""
    sampler = RequestSampler()
    sampler.add(0, temperature=1.0, seed=42)
    flat = torch.zeros(1, VOCAB)
    got = [sampler.step([0], flat)[0] for _ in range(10)]
    generator = stream(42)
    expected = [reference_race(flat[0], 1.0, generator) for _ in range(10)]
    assert got == expected, (f"seed 42, 10 steps on a flat row of {VOCAB}: expected {expected} "
                             f"(one generator advancing), got {got}")


def test_the_same_seed_again_restarts_the_stream() -> None:
    sampler = RequestSampler()
    sampler.add(9, temperature=1.0, seed=3)
    first = [sampler.step([9], logits_of(9, s)[None])[0] for s in range(5)]
    sampler.remove(9)
    sampler.add(9, temperature=1.0, seed=3)
    again = [sampler.step([9], logits_of(9, s)[None])[0] for s in range(5)]
    assert again == first == alone(9, 1.0, 3, 5), (
        f"request 9, seed 3, 5 steps: first run {first}, after remove and add {again}, "
        f"expected {alone(9, 1.0, 3, 5)} both times")


def test_unseeded_requests_share_one_seeded_stream() -> None:
    def run(shared_seed: int) -> list[list[int]]:
        sampler = RequestSampler(shared_seed=shared_seed)
        for uid in range(3):
            sampler.add(uid, temperature=1.0)
        return [sampler.step([0, 1, 2], torch.zeros(3, VOCAB)) for _ in range(4)]

    first, again = run(5), run(5)
    assert first == again, f"shared seed 5, twice: {first} then {again}"
    generator = stream(5)
    expected = [[reference_race(torch.zeros(VOCAB), 1.0, generator) for _ in range(3)]
                for _ in range(4)]
    assert first == expected, (f"three unseeded rows drawing in row order from one stream "
                               f"seeded 5: expected {expected}, got {first}")


def test_the_global_random_stream_is_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3).tolist()
    torch.manual_seed(123)
    sampler = RequestSampler()
    sampler.add(0, temperature=1.0, seed=1)
    sampler.add(1, temperature=1.0)
    sampler.step([0, 1], torch.zeros(2, VOCAB))
    got = torch.rand(3).tolist()
    assert got == expected, "sampling changed torch's global generator: use only your streams"


@pytest.mark.parametrize("call, error, words", [
    (lambda s: s.add(0, 1.0), ValueError, "0"),
    (lambda s: s.add(5, -0.5), ValueError, "temperature"),
    (lambda s: s.remove(4), KeyError, "4"),
    (lambda s: s.step([0, 6], torch.zeros(2, VOCAB)), KeyError, "6"),
    (lambda s: s.step([0, 0], torch.zeros(2, VOCAB)), ValueError, "twice"),
    (lambda s: s.step([0], torch.zeros(2, VOCAB)), ValueError, "rows"),
], ids=["add-twice", "negative-temperature", "remove-unknown", "step-unknown", "step-duplicate",
        "rows-mismatch"])
def test_bad_calls_are_named(call, error, words) -> None:
    sampler = RequestSampler()
    sampler.add(0, temperature=1.0, seed=0)
    with pytest.raises(error, match=words):
        call(sampler)
