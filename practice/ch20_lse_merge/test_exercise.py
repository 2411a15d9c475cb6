"""Tests for the log-sum-exp merge exercise: they are its specification.

The README's example first, then each rule (one piece, empty pieces, bad input, the merged
log-sum-exp), then scores far beyond what ``math.exp`` holds, then the invariants the engine
relies on: keys split anywhere and merged equal the keys attended at once, in any order of the
pieces, and merged results merge again. Last, when torch is there (in the browser, without torch,
they are skipped): the pieces chapter 20's ``cut_into_pieces`` makes, merged, against dense
attention in PyTorch, and, on a GPU with Triton, against the engine's own ``merge_pieces``.
"""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
from lse_merge import attend, merge

INF = math.inf
LN = math.log
# The README's example: pieces A and B, and an empty piece.
EXAMPLE = [([1.0, 3.0], LN(4)), ([2.0, 2.0], LN(12)), ([0.0, 0.0], -INF)]
HAS_TORCH = importlib.util.find_spec("torch") is not None


def close(a: float, b: float, tol: float = 1e-9) -> bool:
    return a == b or math.isclose(a, b, rel_tol=tol, abs_tol=tol * 1e-3)


def same(got: tuple[list[float], float], expected: tuple[list[float], float],
         tol: float = 1e-9) -> bool:
    (out, lse), (want_out, want_lse) = got, expected
    return (len(out) == len(want_out) and all(close(a, b, tol) for a, b in zip(out, want_out))
            and close(lse, want_lse, tol))


def random_request(rng: random.Random, n: int, dim: int, score_size: float = 1.0
                   ) -> tuple[list[float], list[list[float]], list[list[float]], float]:
    """A query, ``n`` keys and values of ``dim`` numbers, and the scale 1/sqrt(dim) (times
    ``score_size``: the scores grow with it)."""
    q = [rng.gauss(0, 1) for _ in range(dim)]
    keys = [[rng.gauss(0, 1) for _ in range(dim)] for _ in range(n)]
    values = [[rng.uniform(-1, 1) for _ in range(dim)] for _ in range(n)]
    return q, keys, values, score_size / math.sqrt(dim)


def random_cuts(rng: random.Random, n: int) -> list[int]:
    """Cut points 0 = c0 <= c1 <= ... <= n: pieces of any length, empty ones included."""
    inner = sorted(rng.randint(0, n) for _ in range(rng.randint(0, 6)))
    return [0, *inner, n]


def in_pieces(q, keys, values, scale, cuts: list[int]) -> list[tuple[list[float], float]]:
    return [attend(q, keys[a:b], values[a:b], scale) for a, b in zip(cuts, cuts[1:])]


# ------------------------------------------------------------------------------- the rules
def test_the_readme_example() -> None:
    got = merge(EXAMPLE)
    assert same(got, ([1.75, 2.25], LN(16)))


def test_the_readme_example_equals_attention_over_its_three_keys() -> None:
    # scores 0, ln 3 (piece A) and ln 12 (piece B): q picks each key's first number
    q, keys = [1.0, 0.0], [[0.0, 5.0], [LN(3), 5.0], [LN(12), 5.0]]
    values = [[4.0, 0.0], [0.0, 4.0], [2.0, 2.0]]
    pieces = in_pieces(q, keys, values, 1.0, [0, 2, 3, 3])
    assert same(merge(pieces), attend(q, keys, values, 1.0))
    assert same(merge(pieces), ([1.75, 2.25], LN(16)))


def test_one_piece_comes_back_unchanged() -> None:
    out, lse = [0.5, -2.0, 7.25], 3.5
    got = merge([(out, lse)])
    assert same(got, (out, lse))
    assert out == [0.5, -2.0, 7.25], "the pieces given must not change"


def test_the_merged_lse_is_the_log_of_the_summed_exponentials() -> None:
    # e^ln2 + e^ln2 = 4; e^0 three times = 3
    assert close(merge([([1.0], LN(2)), ([3.0], LN(2))])[1], LN(4))
    assert close(merge([([1.0], 0.0), ([2.0], 0.0), ([6.0], 0.0)])[1], LN(3))
    assert close(merge([([1.0], 0.0), ([2.0], 0.0), ([6.0], 0.0)])[0][0], 3.0)


def test_an_empty_piece_contributes_nothing_wherever_it_is() -> None:
    a, b, empty = ([1.0, 3.0], LN(4)), ([2.0, 2.0], LN(12)), ([0.0, 0.0], -INF)
    expected = ([1.75, 2.25], LN(16))
    for pieces in ([empty, a, b], [a, empty, b], [a, b, empty, empty], [empty, empty, a, b]):
        got = merge(pieces)
        assert same(got, expected), pieces
    alone = merge([empty, a, empty])
    assert same(alone, a), "a piece merged with empty ones is itself"


def test_an_empty_pieces_out_is_never_read() -> None:
    # A kernel may leave anything in the output of a piece with no keys: even NaN, which times
    # a weight of 0 is still NaN.
    nan = float("nan")
    got = merge([([nan, nan], -INF), ([1.0, 3.0], LN(4)), ([2.0, 2.0], LN(12))])
    assert same(got, ([1.75, 2.25], LN(16)))


def test_no_piece_with_a_key_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        merge([])
    with pytest.raises(ValueError):
        merge([([0.0, 0.0], -INF)])
    with pytest.raises(ValueError):
        merge([([0.0], -INF), ([0.0], -INF)])


def test_outputs_of_different_lengths_are_a_value_error() -> None:
    with pytest.raises(ValueError):
        merge([([1.0, 2.0], 0.0), ([1.0], 0.0)])


# ------------------------------------------------------------------ scores beyond math.exp
def test_huge_scores_do_not_overflow() -> None:
    # math.exp(1000) raises OverflowError; the merge never needs it
    got = merge([([1.0], 1000.0), ([0.0], 1000.0 + LN(3))])
    assert same(got, ([0.25], 1000.0 + LN(4)))


def test_very_negative_scores_do_not_vanish() -> None:
    # math.exp(-1000) is 0.0: a plain sum of them is 0, and 0 / 0 has no answer
    got = merge([([1.0], -1000.0), ([0.0], -1000.0 + LN(3))])
    assert same(got, ([0.25], -1000.0 + LN(4)))


@pytest.mark.parametrize("shift", [-1000.0, -50.0, 50.0, 800.0, 1000.0])
def test_shifting_every_lse_shifts_only_the_merged_lse(shift: float) -> None:
    shifted = [(out, lse + shift) for out, lse in EXAMPLE]
    got_out, got_lse = merge(shifted)
    assert all(close(a, b) for a, b in zip(got_out, [1.75, 2.25])), got_out
    assert math.isclose(got_lse - shift, LN(16), abs_tol=1e-9), got_lse


# ------------------------------------------------------------ the invariants the engine uses
def test_keys_split_anywhere_and_merged_equal_attention_over_all() -> None:
    rng = random.Random(20)
    for _ in range(300):
        n, dim = rng.randint(1, 24), rng.randint(1, 6)
        q, keys, values, scale = random_request(rng, n, dim)
        cuts = random_cuts(rng, n)
        got = merge(in_pieces(q, keys, values, scale, cuts))
        expected = attend(q, keys, values, scale)
        assert same(got, expected), (n, dim, cuts)


def test_single_key_pieces_merge_to_attention_over_all() -> None:
    rng = random.Random(1)
    q, keys, values, scale = random_request(rng, 17, 4)
    got = merge(in_pieces(q, keys, values, scale, list(range(18))))
    assert same(got, attend(q, keys, values, scale))


def test_keys_with_huge_scores_split_and_merged_equal_attention_over_all() -> None:
    rng = random.Random(7)
    for score_size in (300.0, 3000.0):
        q, keys, values, scale = random_request(rng, 20, 4, score_size)
        cuts = [0, 3, 3, 9, 10, 20]
        got = merge(in_pieces(q, keys, values, scale, cuts))
        expected = attend(q, keys, values, scale)
        assert same(got, expected), (score_size, expected[1])


def test_the_order_of_the_pieces_does_not_matter() -> None:
    rng = random.Random(3)
    for _ in range(100):
        n = rng.randint(1, 20)
        q, keys, values, scale = random_request(rng, n, 3, score_size=rng.choice([1.0, 100.0]))
        pieces = in_pieces(q, keys, values, scale, random_cuts(rng, n))
        shuffled = pieces[:]
        rng.shuffle(shuffled)
        assert same(merge(shuffled), merge(pieces)), (pieces, shuffled)


def test_merged_results_merge_again_as_pieces() -> None:
    # The merged lse is what lets a merge be a piece of a larger merge.
    rng = random.Random(4)
    for _ in range(100):
        n = rng.randint(2, 24)
        q, keys, values, scale = random_request(rng, n, 3)
        cuts = random_cuts(rng, n)
        pieces = in_pieces(q, keys, values, scale, cuts)
        split = rng.randint(0, len(pieces))
        groups = [g for g in (pieces[:split], pieces[split:])
                  if any(lse != -INF for _, lse in g)]
        got = merge([merge(group) for group in groups])
        assert same(got, attend(q, keys, values, scale)), (cuts, split)


# ------------------------------------------------------------------------------ the engine
def engine_pieces(lengths: list[int], page_size: int, max_pieces: int) -> list[list[int]]:
    """Each request's keys cut as chapter 20 cuts a decode batch: the cut points, per request,
    of the pieces ``cut_into_pieces`` makes of its pages."""
    import numpy as np

    from minisgl.kernel.pieces import cut_into_pieces

    num_pages = np.array([-(-n // page_size) for n in lengths])
    last = np.array([n - (p - 1) * page_size for n, p in zip(lengths, num_pages)])
    pages, last_lens, _, indptr = cut_into_pieces(num_pages, last, page_size, max_pieces)
    cuts = []
    for req in range(len(lengths)):
        points = [0]
        for p in range(int(indptr[req]), int(indptr[req + 1])):
            points.append(points[-1] + (int(pages[p]) - 1) * page_size + int(last_lens[p]))
        assert points[-1] == lengths[req]
        cuts.append(points)
    return cuts


@pytest.mark.skipif(not HAS_TORCH, reason="the engine needs torch (the judge has it)")
def test_the_engines_pieces_merged_equal_dense_attention_in_torch() -> None:
    import torch

    rng = random.Random(200)
    for page_size in (1, 4, 16):
        lengths = [rng.randint(1, 90) for _ in range(6)]
        cuts = engine_pieces(lengths, page_size, max_pieces=4 * len(lengths))
        for n, points in zip(lengths, cuts):
            q, keys, values, scale = random_request(rng, n, 8)
            got = merge(in_pieces(q, keys, values, scale, points))
            scores = torch.tensor(keys, dtype=torch.float64) @ torch.tensor(
                q, dtype=torch.float64) * scale
            dense = (scores.softmax(0) @ torch.tensor(values, dtype=torch.float64)).tolist()
            expected = (dense, torch.logsumexp(scores, 0).item())
            assert same(got, expected), (page_size, n, points)


def triton_on_a_gpu() -> bool:
    if not HAS_TORCH or importlib.util.find_spec("triton") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not triton_on_a_gpu(), reason="the engine's merge is a Triton kernel: it "
                    "needs a CUDA GPU")
def test_merge_equals_the_engines_merge_pieces_kernel() -> None:
    import torch

    from minisgl.kernel.pieces import merge_pieces

    rng = random.Random(2020)
    dim, outs, lses, indptr, expected = 16, [], [], [0], []
    for _ in range(12):  # requests
        n = rng.randint(1, 60)
        q, keys, values, scale = random_request(rng, n, dim, score_size=rng.choice([1, 50]))
        points = sorted({0, n, *(rng.randint(1, n) for _ in range(rng.randint(0, 4)))})
        pieces = in_pieces(q, keys, values, scale, points)  # no empty piece: the engine has none
        outs += [out for out, _ in pieces]
        lses += [lse / math.log(2) for _, lse in pieces]  # FlashInfer's base-2 log-sum-exps
        indptr.append(len(outs))
        expected.append(merge(pieces)[0])
    merged = merge_pieces(torch.tensor(outs, device="cuda")[:, None, :],
                          torch.tensor(lses, device="cuda")[:, None],
                          torch.tensor(indptr, dtype=torch.int32, device="cuda"))
    for req, row in enumerate(merged[:, 0, :].tolist()):
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(row, expected[req])), req
