"""Tests for the acceptance-rule exercise: they are its specification.

The README's example first, then each function's rules on given numbers, then the property the
rule exists for: over many random trials the first token emitted is distributed as the target's
``p`` and a guess is kept with probability ``sum(min(p, q))``, whatever the draft proposes.
"""

from __future__ import annotations

import math
import random

import pytest
from acceptance import acceptance_probability, draw, residual, verify

P = [0.1, 0.2, 0.3, 0.4]
Q = [0.4, 0.3, 0.2, 0.1]


def close_lists(a: list[float], b: list[float], tol: float = 1e-12) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=tol) for x, y in zip(a, b))


# ------------------------------------------------------------------------------- the rules
def test_the_readme_example() -> None:
    assert verify([0], [Q], [P, P], [0.2], 0.5) == [0, 2]
    assert verify([0], [Q], [P, P], [0.3], 0.5) == [3]


def test_acceptance_probability() -> None:
    assert math.isclose(acceptance_probability(P, Q, 0), 0.25)
    assert acceptance_probability(P, Q, 3) == 1.0  # p above q: always kept
    assert math.isclose(acceptance_probability(P, None, 1), 0.2)  # one-hot q: p(x)
    assert acceptance_probability([0.0, 1.0, 0.0, 0.0], Q, 0) == 0.0


def test_a_guess_the_draft_could_not_make_is_an_error() -> None:
    with pytest.raises(ValueError):
        acceptance_probability(P, [0.5, 0.5, 0.0, 0.0], 2)


def test_residual() -> None:
    assert close_lists(residual(P, Q, 0), [0.0, 0.0, 0.25, 0.75])
    assert close_lists(residual(P, None, 1), [0.125, 0.0, 0.375, 0.5])
    # q with mass where p has none: only p's surplus counts
    assert close_lists(residual([0.5, 0.5, 0.0, 0.0], [0.0, 0.25, 0.25, 0.5], 3),
                       [2 / 3, 1 / 3, 0.0, 0.0])


def test_residual_of_equal_distributions_is_p_and_inputs_stay_unchanged() -> None:
    p, q = list(P), list(P)
    assert close_lists(residual(p, q, 2), P)
    residual(p, Q, 0)
    assert p == P and q == P


def test_every_guess_kept_adds_the_bonus_from_the_last_position() -> None:
    last = [0.0, 0.0, 0.0, 1.0]
    assert verify([2, 1, 0], [Q, Q, Q], [P, P, P, last], [0.0, 0.0, 0.0], 0.9) == [2, 1, 0, 3]


def test_walk_stops_at_the_first_rejection() -> None:
    # guess 1 (token 0, p/q = 0.25) fails with 0.5; the one after it is never looked at
    assert verify([3, 0, 3], [Q, Q, Q], [P, P, P, P], [0.99, 0.5, 0.0], 0.0) == [3, 2]


def test_prompt_lookup_guesses_are_one_hot() -> None:
    assert verify([2, 2], None, [P, P, P], [0.29, 0.31], 0.0) == [2, 0]
    assert verify([3], None, [[0, 0, 0, 1.0], P], [0.999], 0.7) == [3, 3]


def test_a_guess_the_target_rules_out_is_never_kept() -> None:
    p = [0.0, 0.5, 0.5, 0.0]
    assert verify([0], [Q], [p, P], [0.0], 0.0) == [1]


def test_no_guesses_is_one_draw_from_the_target() -> None:
    assert verify([], [], [P], [], 0.05) == [0]
    assert verify([], None, [P], [], 0.95) == [3]


def test_mismatched_lengths_are_errors() -> None:
    with pytest.raises(ValueError):
        verify([1, 2], [Q, Q], [P, P], [0.1, 0.1], 0.0)
    with pytest.raises(ValueError):
        verify([1, 2], [Q, Q], [P, P, P], [0.1], 0.0)


# ----------------------------------------------------------------- the target's distribution
TRIALS = 40_000
Z = 5.5  # a binomial frequency this many standard deviations off: odds of 4e-8


def bound(prob: float) -> float:
    return Z * math.sqrt(prob * (1 - prob) / TRIALS) + 1e-12


CASES = {
    "different": ([0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]),
    "one-hot draft": ([0.5, 0.2, 0.3, 0.0], None),
    "draft without mass where p has": ([0.3, 0.3, 0.4, 0.0], [0.0, 0.5, 0.0, 0.5]),
}


def run_trials(p: list[float], q: list[float] | None, seed: int) -> tuple[list[int], int]:
    rng = random.Random(seed)
    counts, kept = [0] * len(p), 0
    for _ in range(TRIALS):
        guess = 2 if q is None else draw(q, rng.random())
        out = verify([guess], None if q is None else [q], [p, p], [rng.random()], rng.random())
        counts[out[0]] += 1
        kept += len(out) == 2
    return counts, kept


@pytest.mark.parametrize("name", CASES)
def test_the_first_token_follows_the_target(name) -> None:
    p, q = CASES[name]
    counts, kept = run_trials(p, q, seed=1)
    for token, (n, want) in enumerate(zip(counts, p)):
        assert abs(n / TRIALS - want) <= bound(want), (
            f"token {token} came first in {n / TRIALS:.4f} of the trials, but p = {want}")
    q_full = [1.0 if i == 2 else 0.0 for i in range(len(p))] if q is None else q
    alpha = sum(min(a, b) for a, b in zip(p, q_full))
    assert abs(kept / TRIALS - alpha) <= bound(alpha), (
        f"the guess was kept in {kept / TRIALS:.4f} of the trials, sum(min(p, q)) = {alpha}")


def test_the_bound_catches_a_rule_that_keeps_every_guess() -> None:
    # the test's own check: keeping every guess emits q, and that must fail the bound above
    p, q = CASES["different"]
    rng = random.Random(2)
    counts = [0] * 4
    for _ in range(TRIALS):
        counts[draw(q, rng.random())] += 1
    assert any(abs(n / TRIALS - want) > bound(want) for n, want in zip(counts, p))
