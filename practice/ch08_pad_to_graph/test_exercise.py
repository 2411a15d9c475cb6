"""Tests for the padding exercise: they are its specification.

Your capture list and your choice of graph are compared with chapter 8's own functions
(``minisgl.engine.graph``) for every batch size up to 300.
"""

from __future__ import annotations

import random

import pytest
import torch
from pad_to_graph import capture_sizes, choose_graph_size, pad_decode_inputs, padding_overhead

from minisgl.engine.graph import default_capture_sizes, padded_batch_size

# ---------------------------------------------------------------------------------------------
# Which sizes to capture


@pytest.mark.parametrize(("max_bs", "expected"), [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (5, [1, 2, 4, 5]),
    (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]), (24, [1, 2, 4, 8, 16, 24]),
])
def test_capture_sizes_by_hand(max_bs: int, expected: list[int]) -> None:
    assert capture_sizes(max_bs) == expected


def test_capture_sizes_match_the_engine_for_every_maximum_up_to_300() -> None:
    for max_bs in range(1, 301):
        assert capture_sizes(max_bs) == default_capture_sizes(max_bs), f"max_batch_size {max_bs}"


@pytest.mark.parametrize(("max_bs", "step", "expected"), [
    (40, 16, [1, 2, 4, 8, 16, 32, 40]), (10, 4, [1, 2, 4, 8, 10]), (5, 1, [1, 2, 3, 4, 5]),
    (20, 6, [1, 2, 4, 6, 12, 18, 20]), (3, 16, [1, 2, 3]), (64, 32, [1, 2, 4, 8, 16, 32, 64]),
])
def test_capture_sizes_with_another_step(max_bs: int, step: int, expected: list[int]) -> None:
    got = capture_sizes(max_bs, step=step)
    assert got == expected, (f"step {step}: the powers of two below {step}, then the multiples "
                             f"of {step}, then {max_bs}")


def test_capture_sizes_below_one_are_an_error() -> None:
    with pytest.raises(ValueError):
        capture_sizes(0)
    with pytest.raises(ValueError, match="step"):
        capture_sizes(16, step=0)


# ---------------------------------------------------------------------------------------------
# Which graph a batch replays


def test_choose_graph_size_by_hand() -> None:
    captured = [1, 2, 4, 8, 16]
    assert [choose_graph_size(b, captured) for b in (1, 2, 3, 5, 8, 9, 16)] == \
        [1, 2, 4, 8, 8, 16, 16]


def test_a_batch_larger_than_every_graph_runs_eagerly() -> None:
    assert choose_graph_size(17, [1, 2, 4, 8, 16]) is None


def test_choose_graph_size_matches_the_engine_for_every_batch_size() -> None:
    for captured in (default_capture_sizes(256), [1, 8, 64, 256], [3], [2, 5, 7]):
        for batch_size in range(1, 300):
            assert choose_graph_size(batch_size, captured) == \
                padded_batch_size(batch_size, captured), f"B={batch_size}, captured={captured}"


def test_a_hand_written_list_in_any_order() -> None:
    captured = [16, 4, 8, 4, 1]
    assert [choose_graph_size(b, captured) for b in (1, 2, 5, 9, 17)] == [1, 4, 8, 16, None], (
        "captured may be unsorted and hold a size twice: still the smallest size that holds B")


def test_choose_graph_size_of_a_shuffled_list_matches_the_engine_on_the_sorted_one() -> None:
    rng = random.Random(0)
    for _ in range(20):
        captured = rng.sample(range(1, 70), rng.randint(1, 8))
        for batch_size in range(1, 75):
            assert choose_graph_size(batch_size, captured) == \
                padded_batch_size(batch_size, sorted(captured)), f"B={batch_size}, {captured}"


def test_a_batch_size_below_one_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose_graph_size(0, [1, 2])


# ---------------------------------------------------------------------------------------------
# Padding the inputs


def test_padding_appends_token_0_at_position_0() -> None:
    ids, pos = pad_decode_inputs(torch.tensor([5, 9, 7]), torch.tensor([12, 3, 40]), 8)
    assert ids.tolist() == [5, 9, 7, 0, 0, 0, 0, 0]
    assert pos.tolist() == [12, 3, 40, 0, 0, 0, 0, 0]


def test_a_batch_that_fills_its_graph_is_unchanged() -> None:
    ids, pos = pad_decode_inputs(torch.tensor([5, 9]), torch.tensor([1, 2]), 2)
    assert ids.tolist() == [5, 9] and pos.tolist() == [1, 2]


def test_padding_keeps_dtype_and_leaves_the_inputs_alone() -> None:
    input_ids = torch.tensor([5, 9], dtype=torch.int32)
    positions = torch.tensor([1, 2], dtype=torch.int64)
    ids, pos = pad_decode_inputs(input_ids, positions, 4)
    assert ids.dtype == torch.int32 and pos.dtype == torch.int64, "keep each input's dtype"
    assert input_ids.tolist() == [5, 9] and positions.tolist() == [1, 2], "inputs were modified"


def test_a_graph_smaller_than_the_batch_is_an_error() -> None:
    with pytest.raises(ValueError):
        pad_decode_inputs(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]), 2)


# ---------------------------------------------------------------------------------------------
# What padding costs


def test_capturing_every_size_wastes_nothing() -> None:
    assert padding_overhead(list(range(1, 33))) == 0.0


def test_overhead_of_a_single_graph_of_8() -> None:
    assert padding_overhead([8]) == pytest.approx(0.4375)


def test_the_default_list_wastes_little() -> None:
    overhead = padding_overhead(default_capture_sizes(256))
    assert overhead == pytest.approx(_reference_overhead(default_capture_sizes(256)))
    assert overhead < 0.05, "the default list wastes under 5% of the rows on average up to 256"


def _reference_overhead(captured: list[int]) -> float:
    sizes = range(1, max(captured) + 1)
    return sum((padded_batch_size(b, captured) - b) / padded_batch_size(b, captured)
               for b in sizes) / len(sizes)
