"""Tests for the expert-routing exercise: they are its specification.

The README's example first, then each rule (softmax, top-k, ties, renormalisation, the bias that
chooses but does not weigh, grouping, bad input), then random cases when torch is there (in the
browser, without torch, those are skipped): without a bias against chapter 18's own router and
grouping, with one against the same rule written with torch.
"""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
from routing import group_by_expert, route

EXAMPLE = [[2.0, 0.0, 2.0, 1.0],
           [0.0, 3.0, 0.0, 0.0],
           [1.0, 1.0, 1.0, 1.0]]
HAS_TORCH = importlib.util.find_spec("torch") is not None


def softmax(row: list[float]) -> list[float]:
    exps = [math.exp(x - max(row)) for x in row]
    return [e / sum(exps) for e in exps]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def test_the_readme_example() -> None:
    routes = route(EXAMPLE, top_k=2, renormalize=True)
    assert [[e for e, _ in r] for r in routes] == [[0, 2], [1, 0], [0, 1]]
    assert close(routes[0][0][1], 0.5) and close(routes[0][1][1], 0.5)
    assert close(routes[1][0][1], math.exp(3) / (math.exp(3) + 1))
    groups = group_by_expert(routes, 4)
    assert [[t for t, _ in g] for g in groups] == [[0, 1, 2], [1, 2], [0], []]


def test_the_readme_example_with_a_bias() -> None:
    routes = route(EXAMPLE, top_k=2, renormalize=True, bias=[0.0, 0.0, 0.0, 0.3])
    assert [e for e, _ in routes[0]] == [3, 0] and [e for e, _ in routes[2]] == [3, 0]
    p = softmax(EXAMPLE[0])
    assert close(routes[0][0][1], p[3] / (p[3] + p[0])), "weights are unbiased probabilities"
    assert close(routes[2][0][1], 0.5) and close(routes[2][1][1], 0.5)


def test_the_bias_chooses_but_does_not_weigh() -> None:
    logits = [[1.0, 0.0, 0.5, -1.0]]
    probs = softmax(logits[0])
    (r,) = route(logits, top_k=2, renormalize=False, bias=[0.0, 0.0, 0.0, 1.0])
    assert [e for e, _ in r] == [3, 0], "expert 3's bias puts it first"
    assert close(r[0][1], probs[3]) and close(r[1][1], probs[0]), (
        "the weight of a chosen expert is its probability, without the bias")


def test_a_negative_bias_can_push_the_most_probable_expert_out() -> None:
    (r,) = route([[3.0, 1.0, 0.0]], top_k=1, renormalize=True, bias=[-1.0, 0.0, 0.0])
    assert r == [(1, 1.0)]


def test_a_bias_of_zeros_is_no_bias() -> None:
    assert route(EXAMPLE, 2, True, bias=[0.0] * 4) == route(EXAMPLE, 2, True)


def test_ties_of_biased_values_go_to_the_lower_index() -> None:
    # probabilities .25 each; biases make experts 1 and 3 tie above the rest
    (r,) = route([[0.0, 0.0, 0.0, 0.0]], top_k=1, renormalize=False, bias=[0.0, 0.5, 0.0, 0.5])
    assert r[0][0] == 1


def test_a_bias_of_the_wrong_length_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        route(EXAMPLE, 2, True, bias=[0.0, 0.0, 0.0])


def test_without_renormalisation_the_weights_are_the_softmax() -> None:
    routes = route(EXAMPLE, top_k=2, renormalize=False)
    for row, r in zip(EXAMPLE, routes):
        probs = softmax(row)
        assert all(close(w, probs[e]) for e, w in r), f"row {row}: expected softmax values"


def test_renormalised_weights_sum_to_one_and_keep_their_ratios() -> None:
    logits = [[0.5, -1.0, 2.0, 0.1, 1.5]]
    (r,) = route(logits, top_k=3, renormalize=True)
    assert close(sum(w for _, w in r), 1.0)
    probs = softmax(logits[0])
    assert close(r[0][1] / r[1][1], probs[r[0][0]] / probs[r[1][0]])


def test_most_probable_first_and_ties_to_the_lower_index() -> None:
    (r,) = route([[1.0, 3.0, 3.0, 0.0, 3.0]], top_k=2, renormalize=False)
    assert [e for e, _ in r] == [1, 2], "three experts tie: the two lowest indices win"
    (r,) = route([[0.0, 1.0, 2.0, 3.0]], top_k=4, renormalize=False)
    assert [e for e, _ in r] == [3, 2, 1, 0], "most probable first"


def test_large_scores_do_not_overflow() -> None:
    (r,) = route([[1000.0, 999.0, -1000.0]], top_k=1, renormalize=False)
    assert r[0][0] == 0 and close(r[0][1], 1 / (1 + math.exp(-1)))


def test_every_token_on_one_expert_and_experts_with_no_token() -> None:
    logits = [[-5.0, 9.0, -5.0]] * 4
    routes = route(logits, top_k=1, renormalize=True)
    groups = group_by_expert(routes, 3)
    assert groups[0] == [] and groups[2] == []
    assert groups[1] == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0)]


@pytest.mark.parametrize("logits, top_k", [([], 1), ([[1.0, 2.0], [1.0]], 1),
                                           ([[1.0, 2.0]], 0), ([[1.0, 2.0]], 3)])
def test_bad_input_is_a_value_error(logits: list[list[float]], top_k: int) -> None:
    with pytest.raises(ValueError):
        route(logits, top_k, renormalize=True)


def test_an_unknown_expert_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        group_by_expert([[(0, 0.5), (4, 0.5)]], num_experts=4)


def random_logits(rng: random.Random, tokens: int, experts: int) -> list[list[float]]:
    # a coarse grid, so that ties are common
    return [[rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0]) for _ in range(experts)]
            for _ in range(tokens)]


@pytest.mark.skipif(not HAS_TORCH, reason="compares with the engine, which needs torch")
@pytest.mark.parametrize("seed", range(5))
def test_same_routing_and_groups_as_the_engine(seed: int) -> None:
    import torch

    from minisgl.moe.grouped import sort_by_expert
    from minisgl.moe.router import route_topk

    rng = random.Random(seed)
    tokens, experts = rng.randint(1, 12), rng.randint(2, 8)
    top_k, renorm = rng.randint(1, experts), rng.random() < 0.5
    logits = random_logits(rng, tokens, experts)
    routes = route(logits, top_k, renorm)
    engine = route_topk(torch.tensor(logits, dtype=torch.float64), top_k, renorm)
    assert [[e for e, _ in r] for r in routes] == engine.expert_ids.tolist()
    for r, weights in zip(routes, engine.weights.tolist()):
        assert all(math.isclose(w, v, rel_tol=1e-6) for (_, w), v in zip(r, weights))
    groups = group_by_expert(routes, experts)
    sorted_pairs = sort_by_expert(engine.expert_ids, experts)
    tokens_in_order = sorted_pairs.token_ids.tolist()
    assert [t for g in groups for t, _ in g] == tokens_in_order
    assert [len(g) for g in groups] == torch.diff(sorted_pairs.ends, prepend=torch.tensor([0])).tolist()


@pytest.mark.skipif(not HAS_TORCH, reason="checks against torch, which the browser lacks")
@pytest.mark.parametrize("seed", range(5))
def test_biased_routing_matches_the_rule_written_with_torch(seed: int) -> None:
    import torch

    rng = random.Random(100 + seed)
    tokens, experts = rng.randint(1, 12), rng.randint(2, 8)
    top_k, renorm = rng.randint(1, experts), rng.random() < 0.5
    logits = random_logits(rng, tokens, experts)
    bias = [rng.choice([0.0, 0.0, 0.25, -0.25, 0.5]) for _ in range(experts)]
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=-1)
    chosen = (probs + torch.tensor(bias, dtype=torch.float64)).sort(
        dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, chosen)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    routes = route(logits, top_k, renorm, bias)
    assert [[e for e, _ in r] for r in routes] == chosen.tolist()
    for r, row in zip(routes, weights.tolist()):
        assert all(math.isclose(w, v, rel_tol=1e-9) for (_, w), v in zip(r, row))
