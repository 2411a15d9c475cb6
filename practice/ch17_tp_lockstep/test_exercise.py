"""Tests for the tensor-parallel MLP in lockstep: they are its specification.

The slices first, against the whole weights; then one rank's forward pass on its own; then the
lockstep runner, with the whole MLP at 1, 2 and 4 ranks, a two-layer stack, and ranks that fall
out of step. Plain Python numbers (float64) throughout: no PyTorch, so it runs in the browser.
"""

from __future__ import annotations

import math
import random

import pytest
from tp_mlp import Collective, LockstepError, Matrix, mlp_rank, run_lockstep, shard_mlp

HIDDEN, INTER, TOKENS = 16, 8, 3


def randn(rows: int, cols: int, rng: random.Random) -> Matrix:
    return [[rng.gauss(0.0, 1.0) for _ in range(cols)] for _ in range(rows)]


def weights(seed: int = 0) -> tuple[Matrix, Matrix, Matrix]:
    rng = random.Random(seed)
    return randn(INTER, HIDDEN, rng), randn(INTER, HIDDEN, rng), randn(HIDDEN, INTER, rng)


def inputs(seed: int) -> Matrix:
    return randn(TOKENS, HIDDEN, random.Random(seed))


def dense_mlp(x: Matrix, gate: Matrix, up: Matrix, down: Matrix) -> Matrix:
    """The whole MLP, ``down(silu(gate(x)) * up(x))``, written independently of the exercise."""
    def dot(a: list[float], b: list[float]) -> float:
        return math.fsum(p * q for p, q in zip(a, b))

    def silu(v: float) -> float:
        return v / (1.0 + math.exp(-v)) if v > -700 else 0.0

    out = []
    for row in x:
        h = [silu(dot(row, g)) * dot(row, u) for g, u in zip(gate, up)]
        out.append([dot(h, d) for d in down])
    return out


def columns(m: Matrix, lo: int, hi: int) -> Matrix:
    return [row[lo:hi] for row in m]


def close(got: Matrix, expected: Matrix, tol: float = 1e-9) -> bool:
    """Equal up to rounding: sums taken in another order differ in their last bits."""
    scale = max((abs(v) for row in expected for v in row), default=1.0) or 1.0
    return (len(got) == len(expected)
            and all(len(g) == len(e) and all(abs(a - b) <= tol * scale for a, b in zip(g, e))
                    for g, e in zip(got, expected)))


def test_the_readme_example_slices() -> None:
    gate = [[float(2 * r + c) for c in range(2)] for r in range(4)]
    up = [[v + 100 for v in row] for row in gate]
    down = [[float(4 * r + c) for c in range(4)] for r in range(2)]
    gate_up, down_1 = shard_mlp(gate, up, down, rank=1, tp_size=2)
    assert gate_up == gate[2:4] + up[2:4], (
        "rank 1 of 2: rows 2 and 3 of gate, then rows 2 and 3 of up")
    assert down_1 == columns(down, 2, 4), "rank 1 of 2: columns 2 and 3 of down"


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_the_slices_of_all_ranks_put_the_weights_back_together(tp_size: int) -> None:
    gate, up, down = weights()
    shards = [shard_mlp(gate, up, down, r, tp_size) for r in range(tp_size)]
    block = INTER // tp_size
    for gate_up, d in shards:
        assert (len(gate_up), len(gate_up[0])) == (2 * block, HIDDEN), (
            "gate_up is [2 * inter / tp, hidden]")
        assert (len(d), len(d[0])) == (HIDDEN, block), "down is [hidden, inter / tp]"
    assert [row for gu, _ in shards for row in gu[:block]] == gate
    assert [row for gu, _ in shards for row in gu[block:]] == up
    assert [sum((d[i] for _, d in shards), []) for i in range(HIDDEN)] == down


def test_the_slices_are_new_lists() -> None:
    gate, up, down = weights()
    gate_up, d = shard_mlp(gate, up, down, 0, 2)
    gate_up[0][0] += 1.0
    d[0][0] += 1.0
    assert (gate, up, down) == weights(), (
        "a rank that changes its slices must not change the whole weights")


@pytest.mark.parametrize("rank, tp_size", [(0, 3), (2, 2), (-1, 2)])
def test_an_uneven_split_or_a_bad_rank_is_refused(rank: int, tp_size: int) -> None:
    gate, up, down = weights()
    with pytest.raises(ValueError, match=str(tp_size if rank == 0 else rank)):
        shard_mlp(gate, up, down, rank, tp_size)


def test_one_rank_yields_one_all_reduce_of_its_partial_sum() -> None:
    gate, up, down = weights()
    x = inputs(11)
    program = mlp_rank(x, *shard_mlp(gate, up, down, 0, 2))
    asked = next(program)
    assert isinstance(asked, Collective) and asked.op == "all_reduce"
    half = INTER // 2
    expected = dense_mlp(x, gate[:half], up[:half], columns(down, 0, half))
    assert close(asked.value, expected), (
        "rank 0's partial output: its half of the features through its columns of down")
    total = [[7.0] * HIDDEN for _ in range(TOKENS)]
    with pytest.raises(StopIteration) as stop:
        program.send(total)
    assert stop.value.value is total, "the rank returns the sum it received"


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_every_rank_gets_the_whole_mlp(tp_size: int) -> None:
    gate, up, down = weights(1)
    x = inputs(12)
    programs = [mlp_rank(x, *shard_mlp(gate, up, down, r, tp_size)) for r in range(tp_size)]
    results, log = run_lockstep(programs)
    assert log == [("all_reduce", (TOKENS, HIDDEN))], "one all-reduce for the pair"
    expected = dense_mlp(x, gate, up, down)
    for rank, out in enumerate(results):
        assert close(out, expected), f"rank {rank}'s output"
    assert all(out == results[0] for out in results), "every rank receives the same bits"


def test_a_two_layer_stack_with_residuals() -> None:
    layers = [weights(2), weights(3)]
    x = inputs(13)

    def add(a: Matrix, b: Matrix) -> Matrix:
        return [[p + q for p, q in zip(r, s)] for r, s in zip(a, b)]

    def rank_program(rank: int, tp_size: int):
        h = x
        for gate, up, down in layers:
            h = add(h, (yield from mlp_rank(h, *shard_mlp(gate, up, down, rank, tp_size))))
        return h

    results, log = run_lockstep([rank_program(r, 2) for r in range(2)])
    assert [op for op, _ in log] == ["all_reduce", "all_reduce"], "one per layer"
    h = x
    for gate, up, down in layers:
        h = add(h, dense_mlp(h, gate, up, down))
    assert close(results[0], h)
    assert results[0] == results[1]


def test_all_reduce_adds_in_rank_order_and_broadcast_sends_rank_0s() -> None:
    values = [[[1e16]], [[1.0]], [[-1e16]]]

    def program(rank: int):
        total = yield Collective("all_reduce", values[rank])
        first = yield Collective("broadcast", [[2 * values[rank][0][0]]])
        return total[0] + first[0]

    results, log = run_lockstep([program(r) for r in range(3)])
    # float64: 1e16 + 1 rounds to 1e16, so in rank order the sum is 0 (other orders give 1)
    assert results == [[0.0, 2e16]] * 3
    assert log == [("all_reduce", (1, 1)), ("broadcast", (1, 1))]


def test_each_rank_gets_its_own_copy() -> None:
    def program(rank: int):
        got = yield Collective("all_reduce", [[1.0, 1.0]])
        got[0][0] += rank * 100  # a rank may change what it received
        return got

    results, _ = run_lockstep([program(r) for r in range(3)])
    assert results == [[[3.0, 3.0]], [[103.0, 3.0]], [[203.0, 3.0]]], (
        "a rank that changes its result must not change another rank's")


def test_ranks_in_different_collectives_are_stopped() -> None:
    def program(rank: int):
        op = "broadcast" if rank == 1 else "all_reduce"
        return (yield Collective(op, [[0.0, 0.0]]))

    with pytest.raises(LockstepError, match=r"(?s)rank 0.*all_reduce.*rank 1.*broadcast"):
        run_lockstep([program(r) for r in range(2)])


def test_ranks_with_different_shapes_are_stopped() -> None:
    def program(rank: int):
        return (yield Collective("all_reduce", [[0.0] * (2 + rank)]))

    with pytest.raises(LockstepError, match=r"(?s)rank 0.*\(1, 2\).*rank 1.*\(1, 3\)"):
        run_lockstep([program(r) for r in range(2)])


def test_a_rank_that_finishes_early_is_stopped() -> None:
    def program(rank: int):
        if rank == 0:
            yield Collective("all_reduce", [[0.0, 0.0]])
        return [[0.0, 0.0]]

    with pytest.raises(LockstepError, match=r"(?s)rank 0.*all_reduce.*rank 1.*finished"):
        run_lockstep([program(r) for r in range(2)])


def test_an_unknown_collective_is_a_value_error() -> None:
    def program(rank: int):
        return (yield Collective("all_gather", [[0.0, 0.0]]))

    with pytest.raises(ValueError, match="all_gather"):
        run_lockstep([program(r) for r in range(2)])
