"""Tests for the top-k / top-p exercise: they are its specification."""

from __future__ import annotations

import math

import torch
from top_p import top_k_filter, top_k_top_p_filter, top_p_filter

from minisgl.core import SamplingParams
from minisgl.engine.sample import SamplingTensors, filter_probs


def random_probs(rows: int, vocab: int = 50, scale: float = 2.5, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=generator) * scale, dim=-1)


def nucleus_reference(row: list[float], top_p: float) -> tuple[set[int], float]:
    """The nucleus of one row in plain float64 Python, and the distance from top_p to the
    nearest cumulative sum (so a test never relies on a case rounding could flip)."""
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    kept: set[int] = set()
    mass, margin = 0.0, math.inf
    for token in order:
        kept.add(token)
        mass += row[token]
        margin = min(margin, abs(mass - top_p))
        if mass >= top_p:
            break
    return kept, margin


def support(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > 0).flatten().tolist())


def test_top_k_keeps_exactly_the_k_most_likely_tokens() -> None:
    probs = random_probs(4)
    top_k = torch.tensor([1, 3, 7, 50])
    out = top_k_filter(probs, top_k)
    for row, k in enumerate(top_k.tolist()):
        best = set(probs[row].topk(k).indices.tolist())
        assert support(out[row]) == best, f"row {row}: top_k={k} must keep exactly the {k} best"


def test_top_k_minus_one_keeps_the_whole_row() -> None:
    probs = random_probs(2)
    out = top_k_filter(probs, torch.tensor([-1, -1]))
    torch.testing.assert_close(out, probs, msg="top_k=-1 means no filter")


def test_top_k_breaks_ties_towards_the_lower_token_id() -> None:
    probs = torch.tensor([[0.1, 0.3, 0.3, 0.3]])
    out = top_k_filter(probs, torch.tensor([2]))
    assert support(out[0]) == {1, 2}, "with equal probabilities the lower ids rank first"


def test_top_p_keeps_the_nucleus() -> None:
    probs = random_probs(6, seed=1)
    for top_p in (0.2, 0.5, 0.75, 0.95):
        out = top_p_filter(probs, torch.full((6,), top_p))
        for row in range(6):
            nucleus, margin = nucleus_reference(probs[row].double().tolist(), top_p)
            assert margin > 1e-5, "test case too close to a rounding boundary"
            got = support(out[row])
            assert got == nucleus, (
                f"row {row}, top_p={top_p}: kept {sorted(got)}, "
                f"the nucleus (smallest top set with mass >= top_p) is {sorted(nucleus)}"
            )


def test_top_p_always_keeps_the_most_likely_token() -> None:
    probs = random_probs(5, seed=2)
    out = top_p_filter(probs, torch.full((5,), 1e-6))
    expected = torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).float()
    torch.testing.assert_close(out, expected, msg="a tiny top_p still keeps the top token")


def test_top_p_one_keeps_even_negligible_tokens() -> None:
    probs = torch.tensor([[0.999999, 1e-6 - 2e-12, 1e-12, 1e-12]])
    out = top_p_filter(probs, torch.tensor([1.0]))
    assert support(out[0]) == {0, 1, 2, 3}, "top_p=1.0 means no filter, even for tiny tails"


def test_outputs_are_renormalised_and_inputs_untouched() -> None:
    probs = random_probs(3)
    before = probs.clone()
    for out in (
        top_k_filter(probs, torch.tensor([2, 5, -1])),
        top_p_filter(probs, torch.tensor([0.3, 0.8, 1.0])),
    ):
        torch.testing.assert_close(out.sum(-1), torch.ones(3), msg="rows must sum to 1")
        assert bool((out >= 0).all())
    assert torch.equal(probs, before), "the input probabilities must not be modified"


def test_each_row_uses_its_own_parameters() -> None:
    probs = random_probs(4, seed=3)
    top_k = torch.tensor([2, -1, 10, 4])
    top_p = torch.tensor([1.0, 0.6, 0.9, 0.3])
    batched = top_k_top_p_filter(probs, top_k, top_p)
    for row in range(4):
        alone = top_k_top_p_filter(probs[row : row + 1], top_k[row : row + 1], top_p[row : row + 1])
        torch.testing.assert_close(batched[row], alone[0], msg=f"row {row} differs when batched")


def test_top_p_is_applied_to_what_top_k_left() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # After top_k=2 the row is 4/7, 3/7: top_p=0.5 is reached by the first token alone.
    out = top_k_top_p_filter(probs, torch.tensor([2]), torch.tensor([0.5]))
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_matches_the_engine_sampler() -> None:
    probs = random_probs(16, vocab=200, seed=4)
    generator = torch.Generator().manual_seed(5)
    top_k = torch.randint(1, 60, (16,), generator=generator)
    top_k[::4] = -1
    top_p = torch.rand(16, generator=generator) * 0.9 + 0.05
    top_p[1::4] = 1.0
    params = [
        SamplingParams(temperature=1.0, top_k=int(k), top_p=float(p))
        for k, p in zip(top_k.tolist(), top_p.tolist(), strict=True)
    ]
    engine = filter_probs(probs, SamplingTensors.from_params(params, 200, probs.device))
    mine = top_k_top_p_filter(probs, top_k, top_p)
    for row in range(16):
        assert support(mine[row]) == support(engine[row]), (
            f"row {row} (top_k={int(top_k[row])}, top_p={float(top_p[row]):.3f}) keeps other "
            "tokens than minisgl.engine.sample.filter_probs"
        )
    torch.testing.assert_close(mine, engine)


def test_sampling_from_the_filtered_rows_stays_in_the_nucleus() -> None:
    probs = random_probs(3, seed=6)
    top_p = torch.tensor([0.5, 0.8, 0.9])
    out = top_p_filter(probs, top_p)
    generator = torch.Generator().manual_seed(0)
    drawn = torch.multinomial(out, 2000, replacement=True, generator=generator)
    for row in range(3):
        nucleus, _ = nucleus_reference(probs[row].double().tolist(), float(top_p[row]))
        assert set(drawn[row].tolist()) <= nucleus
