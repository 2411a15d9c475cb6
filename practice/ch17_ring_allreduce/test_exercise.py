"""Tests for the ring all-reduce: they are its specification.

The README's example first, then random rings checked against the rules (the sum on every rank,
one send per rank per step to its right neighbour, 2(n-1)/n of the vector sent by each rank),
then chapter 2's vocabulary-parallel LM head: the all-gather it builds from an all-reduce.
"""

from __future__ import annotations

import random

import pytest
from ring import Send, chunk_bounds, ring_all_reduce

from minisgl.layers.embedding import VocabShard

EXAMPLE = [[1, 2, 3, 4, 5], [10, 20, 30, 40, 50], [100, 200, 300, 400, 500]]


def test_chunk_bounds() -> None:
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)], "chunks may be empty"
    assert chunk_bounds(7, 1) == [(0, 7)]


def test_the_readme_example() -> None:
    result, sends = ring_all_reduce(EXAMPLE)
    assert result == [[111, 222, 333, 444, 555]] * 3
    assert sends[:6] == [Send(0, 0, 1, 0, 2), Send(0, 1, 2, 1, 2), Send(0, 2, 0, 2, 1),
                         Send(1, 0, 1, 2, 1), Send(1, 1, 2, 0, 2), Send(1, 2, 0, 1, 2)]
    assert [s.step for s in sends] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_the_input_is_left_alone() -> None:
    vectors = [list(v) for v in EXAMPLE]
    ring_all_reduce(vectors)
    assert vectors == EXAMPLE, "ring_all_reduce must work on copies"


def test_the_all_gather_half_passes_each_complete_chunk_around() -> None:
    _, sends = ring_all_reduce(EXAMPLE)
    # After the reduce-scatter rank r holds the complete chunk (r + 1) % n and sends it first.
    assert [(s.src, s.chunk) for s in sends if s.step == 2] == [(0, 1), (1, 2), (2, 0)]


@pytest.mark.parametrize("seed", range(40))
def test_random_rings(seed: int) -> None:
    rng = random.Random(seed)
    n, length = rng.randint(1, 6), rng.randint(0, 23)
    vectors = [[rng.randint(-50, 50) for _ in range(length)] for _ in range(n)]
    result, sends = ring_all_reduce(vectors)
    total = [sum(column) for column in zip(*vectors)] if length else []
    assert result == [total] * n, f"n={n}, length={length}: not the sum on every rank"
    assert len(sends) == 2 * (n - 1) * n, "2(n-1) steps, one send per rank in each"
    for step in range(2 * (n - 1)):
        in_step = [s for s in sends if s.step == step]
        assert [s.src for s in in_step] == list(range(n)), f"step {step}: one send per rank"
        assert all(s.dst == (s.src + 1) % n for s in in_step), "only to the right neighbour"
    bounds = chunk_bounds(length, n)
    assert all(s.length == bounds[s.chunk][1] - bounds[s.chunk][0] for s in sends)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_each_rank_sends_2_n_minus_1_over_n_of_the_vector(n: int) -> None:
    length = 12 * n
    _, sends = ring_all_reduce([[r] * length for r in range(n)])
    for rank in range(n):
        sent = sum(s.length for s in sends if s.src == rank)
        assert sent == 2 * (n - 1) * length // n, f"rank {rank} sent {sent} numbers"


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        ring_all_reduce([])
    with pytest.raises(ValueError):
        ring_all_reduce([[1, 2], [1]])


def test_the_lm_heads_all_gather_costs_twice_an_all_gather() -> None:
    """Chapter 2's LM head gathers the ranks' logits blocks by all-reducing zero-padded rows.

    Each rank writes its block of a 2,047-entry vocabulary at its offset in a zero row of
    n x padded_rows; the all-reduce yields every block on every rank, for 2(n-1) blocks sent
    per rank, where an all-gather would send n-1.
    """
    vocab, n = 2047, 4
    shards = [VocabShard.for_rank(vocab, rank, n) for rank in range(n)]
    rows = shards[0].padded_rows
    padded = []
    for rank, shard in enumerate(shards):
        row = [0.0] * (rows * n)
        for i in range(shard.rows):  # this rank's logits: the token id itself, for the test
            row[rank * rows + i] = float(shard.start + i)
        padded.append(row)
    result, sends = ring_all_reduce(padded)
    assert all(r[:vocab] == [float(t) for t in range(vocab)] for r in result)
    sent = sum(s.length for s in sends if s.src == 0)
    assert sent == 2 * (n - 1) * rows, "the all-reduce moves 2(n-1) blocks per rank"
