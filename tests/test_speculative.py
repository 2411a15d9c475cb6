"""Speculative decoding's pieces: the verification rules and the prompt-lookup proposer.

The greedy rule on constructed cases, exact; the sampling rule statistically: whatever the draft
proposes, the first token emitted is distributed as the target's ``p`` and a guess is kept with
probability ``sum min(p, q)``, each within a bound derived from the number of trials, a bound that
two deliberately wrong rules fail. Then prompt lookup.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl.speculative.accept import PAD, accept_greedy, accept_sampled
from minisgl.speculative.ngram import TokenHistory, propose_ngram


def t(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


# --------------------------------------------------------------------------- the greedy rule
def test_greedy_keeps_every_matching_guess_and_adds_the_bonus() -> None:
    v = accept_greedy(t([[5, 6, 7]]), t([[5, 6, 7, 8]]))
    assert v.accepted.tolist() == [3] and v.to_lists() == [[5, 6, 7, 8]]


def test_greedy_first_guess_wrong_emits_the_targets_token_only() -> None:
    v = accept_greedy(t([[9, 6, 7]]), t([[5, 6, 7, 8]]))
    assert v.accepted.tolist() == [0] and v.tokens.tolist() == [[5, PAD, PAD, PAD]]


def test_greedy_stops_at_the_first_mismatch_even_if_later_guesses_match() -> None:
    v = accept_greedy(t([[5, 0, 7]]), t([[5, 6, 7, 8]]))
    assert v.accepted.tolist() == [1] and v.to_lists() == [[5, 6]]


def test_greedy_rows_with_fewer_or_no_proposals() -> None:
    drafts = t([[5, 6, 7], [5, 6, 99], [99, 99, 99], [5, 6, 7]])
    targets = t([[5, 6, 7, 8], [5, 6, 1, 2], [3, 4, 4, 4], [5, 6, 0, 0]])
    v = accept_greedy(drafts, targets, torch.tensor([3, 2, 0, 1]))
    # row 1: two proposals, both right: the bonus is the target's token at position 2
    # row 2: nothing proposed: exactly the target's next token, as without speculation
    assert v.accepted.tolist() == [3, 2, 0, 1]
    assert v.to_lists() == [[5, 6, 7, 8], [5, 6, 1], [3], [5, 6]]
    assert v.emitted.tolist() == [4, 3, 1, 2]


def test_greedy_with_k_zero_is_plain_decoding() -> None:
    v = accept_greedy(torch.zeros(2, 0, dtype=torch.int64), t([[4], [2]]))
    assert v.to_lists() == [[4], [2]]


def test_shapes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="k \\+ 1"):
        accept_greedy(t([[1, 2]]), t([[1, 2]]))


def test_sampling_with_one_hot_targets_is_the_greedy_rule() -> None:
    gen = torch.Generator().manual_seed(0)
    drafts = t([[5, 6, 7], [5, 1, 7], [2, 2, PAD]])  # row 2 proposed two tokens
    targets = t([[5, 6, 7, 8], [5, 6, 7, 8], [3, 4, 4, 4]])
    one_hot = torch.nn.functional.one_hot(targets, 10).float()
    q = torch.softmax(torch.randn(3, 3, 10, generator=gen), dim=-1)
    for draft_probs in (None, q):
        v = accept_sampled(drafts, draft_probs, one_hot, torch.tensor([3, 3, 2]), gen)
        assert v.to_lists() == [[5, 6, 7, 8], [5, 6], [3]]


# ------------------------------------------------------- the sampling rule keeps p exactly
N = 200_000
Z = 5.5  # a normal deviation this large has probability 4e-8: the bound never fails by chance
PAIRS = {  # name: (p, q) on a vocabulary of 5
    "different": ([0.1, 0.2, 0.3, 0.4, 0.0], [0.4, 0.3, 0.2, 0.05, 0.05]),
    "q one-hot (prompt lookup)": ([0.5, 0.2, 0.2, 0.1, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]),
    "q one-hot where p is 0": ([0.5, 0.2, 0.2, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]),
    "q without mass where p has": ([0.3, 0.3, 0.2, 0.1, 0.1], [0.0, 0.5, 0.5, 0.0, 0.0]),
    "p without mass where q has": ([0.0, 0.0, 0.6, 0.4, 0.0], [0.3, 0.3, 0.2, 0.1, 0.1]),
    "equal": ([0.2, 0.2, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]),
}


def bound(prob: float | torch.Tensor, n: int = N) -> float | torch.Tensor:
    """How far a frequency over ``n`` trials may stray from ``prob``: ``Z`` binomial standard
    deviations (0 where prob is 0 or 1: such an outcome must never or always happen)."""
    return Z * (prob * (1 - prob) / n) ** 0.5 + 1e-12


def trials(p: list[float], q: list[float], k: int, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, bool]:
    """N independent rows: k guesses drawn from q (one-hot q: always its token), the same p at
    every position."""
    gen = torch.Generator().manual_seed(seed)
    p_t, q_t = torch.tensor(p), torch.tensor(q)
    drafts = torch.multinomial(q_t, N * k, replacement=True, generator=gen).view(N, k)
    one_hot = bool((q_t == 1).any())
    draft_probs = None if one_hot else q_t.expand(N, k, 5)
    return drafts, draft_probs, p_t.expand(N, k + 1, 5), p_t, one_hot


def frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=5).double() / len(tokens)


@pytest.mark.parametrize("name", PAIRS)
def test_the_first_token_is_distributed_as_the_target_and_acceptance_is_sum_min(name) -> None:
    p, q = PAIRS[name]
    drafts, draft_probs, target_probs, p_t, _ = trials(p, q, 1, seed=1)
    v = accept_sampled(drafts, draft_probs, target_probs,
                       generator=torch.Generator().manual_seed(2))
    deviation = (frequencies(v.tokens[:, 0]) - p_t.double()).abs()
    assert (deviation <= bound(p_t.double())).all(), deviation
    alpha = sum(min(a, b) for a, b in zip(p, q))
    rate = v.accepted.double().mean().item()
    assert abs(rate - alpha) <= bound(alpha), (rate, alpha)


@pytest.mark.parametrize("name", ["different", "q one-hot (prompt lookup)"])
def test_each_later_token_is_distributed_as_the_target_too(name) -> None:
    # With the same p at every position the emitted text must be independent draws from p: the
    # token at position j, among rows that got that far, is again distributed as p.
    p, q = PAIRS[name]
    drafts, draft_probs, target_probs, p_t, _ = trials(p, q, 3, seed=3)
    v = accept_sampled(drafts, draft_probs, target_probs,
                       generator=torch.Generator().manual_seed(4))
    for j in range(4):
        reached = v.tokens[:, j][v.accepted >= j]
        deviation = (frequencies(reached) - p_t.double()).abs()
        assert (deviation <= bound(p_t.double(), len(reached))).all(), (j, deviation)


def always_accept(drafts: torch.Tensor, p_t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return drafts[:, 0]


def resample_from_p(drafts: torch.Tensor, p_t: torch.Tensor, gen: torch.Generator,
                    q_t: torch.Tensor) -> torch.Tensor:
    """Accept with min(1, p/q) but, on rejection, draw from p instead of the residual."""
    x = drafts[:, 0]
    keep = torch.rand(len(x), generator=gen) * q_t[x] < p_t[x]
    return torch.where(keep, x, torch.multinomial(p_t, len(x), replacement=True, generator=gen))


@pytest.mark.parametrize("name", ["different", "q one-hot (prompt lookup)",
                                  "q without mass where p has"])
def test_wrong_rules_fail_the_same_bound(name) -> None:
    p, q = PAIRS[name]
    drafts, _, _, p_t, _ = trials(p, q, 1, seed=5)
    gen = torch.Generator().manual_seed(6)
    wrong = [always_accept(drafts, p_t, gen), resample_from_p(drafts, p_t, gen, torch.tensor(q))]
    for first in wrong:
        deviation = (frequencies(first) - p_t.double()).abs()
        assert (deviation > bound(p_t.double())).any(), deviation


def test_a_row_with_its_own_generator_does_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(3, 4, 50, generator=gen), dim=-1)
    q = torch.softmax(torch.randn(3, 3, 50, generator=gen), dim=-1)
    drafts = torch.randint(0, 50, (3, 3), generator=gen)
    alone = accept_sampled(drafts[1:2], q[1:2], p[1:2],
                           generator=[torch.Generator().manual_seed(11)])
    batch = accept_sampled(drafts, q, p, generator=[None, torch.Generator().manual_seed(11), None])
    assert batch.to_lists()[1] == alone.to_lists()[0]


def test_no_proposals_samples_from_the_target_at_the_first_position() -> None:
    p = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]]).expand(1000, 2, 3)
    drafts = torch.zeros(1000, 1, dtype=torch.int64)
    v = accept_sampled(drafts, None, p, torch.zeros(1000, dtype=torch.int64),
                       torch.Generator().manual_seed(0))
    assert (v.accepted == 0).all() and (v.tokens[:, 0] == 1).all() and (v.tokens[:, 1] == PAD).all()


# ----------------------------------------------------------------------------- prompt lookup
def test_lookup_proposes_what_followed_the_latest_occurrence() -> None:
    history = [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]
    assert propose_ngram(history, k=2, max_ngram=2) == [5, 6]


def test_lookup_prefers_a_longer_match_over_a_more_recent_one() -> None:
    history = [7, 2, 3, 4, 0, 2, 3, 5, 7, 2, 3]  # "7 2 3" occurred at the start, "2 3" later
    assert propose_ngram(history, k=2, max_ngram=3) == [4, 0]
    assert propose_ngram(history, k=2, max_ngram=2) == [5, 7]


def test_lookup_caps_at_k_and_at_the_end_of_the_history() -> None:
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose_ngram(history, k=3) == [3, 4, 5]
    assert propose_ngram([5, 5], k=4) == [5]  # the continuation runs into the end


def test_lookup_without_a_match_proposes_nothing() -> None:
    assert propose_ngram([1, 2, 3, 4], k=3) == []
    assert propose_ngram([1, 2, 3, 1, 9, 3], k=3, min_ngram=2) == []  # only "3" recurs
    assert propose_ngram([4, 2, 3, 1, 2, 3], k=3, min_ngram=2) == [1, 2, 3]


def test_lookup_on_histories_shorter_than_the_ngram() -> None:
    assert propose_ngram([], k=3) == []
    assert propose_ngram([8], k=3) == []
    assert propose_ngram([8, 8], k=3, max_ngram=5) == [8]
    assert propose_ngram([8, 8], k=3, min_ngram=2) == []


def test_lookup_takes_arrays_tensors_and_a_growing_history() -> None:
    history = [1, 2, 3, 4, 1, 2]
    grown = TokenHistory(history[:3])
    grown.extend(history[3:])
    for form in (np.array(history), torch.tensor(history), grown):
        assert propose_ngram(form, k=2) == [3, 4]
    grown.extend([3, 9])
    grown.truncate(6)
    assert propose_ngram(grown, k=2) == [3, 4]


def test_lookup_matches_a_brute_force_search() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        history = rng.integers(0, 4, rng.integers(0, 30)).tolist()
        assert propose_ngram(history, k=3, max_ngram=3) == brute_force(history, 3, 3, 1)


def brute_force(history: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(history) <= n:
            continue
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == tail:
                return history[start + n:start + n + k]
    return []


def test_lookup_on_a_long_history_is_fast() -> None:
    import time
    history = TokenHistory(np.random.default_rng(1).integers(0, 1000, 50_000).tolist())
    start = time.perf_counter()
    for _ in range(20):
        propose_ngram(history, k=4)
    assert (time.perf_counter() - start) / 20 < 0.01
