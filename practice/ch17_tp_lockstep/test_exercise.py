"""Tests for the tensor-parallel MLP in lockstep: they are its specification.

The slices first, against the whole weights; then one rank's forward pass on its own; then the
lockstep runner, with the whole MLP at 1, 2 and 4 ranks, a two-layer stack, and ranks that fall
out of step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tp_mlp import Collective, LockstepError, mlp_rank, run_lockstep, shard_mlp

HIDDEN, INTER, TOKENS = 16, 8, 3


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(INTER, HIDDEN, generator=g), torch.randn(INTER, HIDDEN, generator=g),
            torch.randn(HIDDEN, INTER, generator=g))


def dense_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def test_the_readme_example_slices() -> None:
    gate = torch.arange(4 * 2, dtype=torch.float32).reshape(4, 2)
    up, down = gate + 100, torch.arange(2 * 4, dtype=torch.float32).reshape(2, 4)
    gate_up, down_1 = shard_mlp(gate, up, down, rank=1, tp_size=2)
    assert torch.equal(gate_up, torch.cat([gate[2:4], up[2:4]])), (
        "rank 1 of 2: rows 2 and 3 of gate, then rows 2 and 3 of up")
    assert torch.equal(down_1, down[:, 2:4]), "rank 1 of 2: columns 2 and 3 of down"


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_the_slices_of_all_ranks_put_the_weights_back_together(tp_size: int) -> None:
    gate, up, down = weights()
    shards = [shard_mlp(gate, up, down, r, tp_size) for r in range(tp_size)]
    block = INTER // tp_size
    for gate_up, d in shards:
        assert gate_up.shape == (2 * block, HIDDEN), "gate_up is [2 * inter / tp, hidden]"
        assert d.shape == (HIDDEN, block), "down is [hidden, inter / tp]"
    assert torch.equal(torch.cat([gu[:block] for gu, _ in shards]), gate)
    assert torch.equal(torch.cat([gu[block:] for gu, _ in shards]), up)
    assert torch.equal(torch.cat([d for _, d in shards], dim=1), down)


@pytest.mark.parametrize("rank, tp_size", [(0, 3), (2, 2), (-1, 2)])
def test_an_uneven_split_or_a_bad_rank_is_refused(rank: int, tp_size: int) -> None:
    gate, up, down = weights()
    with pytest.raises(ValueError, match=str(tp_size if rank == 0 else rank)):
        shard_mlp(gate, up, down, rank, tp_size)


def test_one_rank_yields_one_all_reduce_of_its_partial_sum() -> None:
    gate, up, down = weights()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(11))
    program = mlp_rank(x, *shard_mlp(gate, up, down, 0, 2))
    asked = next(program)
    assert isinstance(asked, Collective) and asked.op == "all_reduce"
    half = slice(0, INTER // 2)
    expected = dense_mlp(x, gate[half], up[half], down[:, half])
    assert torch.allclose(asked.tensor, expected, atol=1e-5), (
        "rank 0's partial output: its half of the features through its columns of down")
    total = torch.full((TOKENS, HIDDEN), 7.0)
    with pytest.raises(StopIteration) as stop:
        program.send(total)
    assert stop.value.value is total, "the rank returns the sum it received"


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_every_rank_gets_the_whole_mlp(tp_size: int) -> None:
    gate, up, down = weights(1)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(12))
    programs = [mlp_rank(x, *shard_mlp(gate, up, down, r, tp_size)) for r in range(tp_size)]
    results, log = run_lockstep(programs)
    assert log == [("all_reduce", (TOKENS, HIDDEN))], "one all-reduce for the pair"
    expected = dense_mlp(x, gate, up, down)
    for rank, out in enumerate(results):
        assert torch.allclose(out, expected, atol=1e-4), f"rank {rank}'s output"
    assert all(torch.equal(out, results[0]) for out in results), (
        "every rank receives the same bits")


def test_a_two_layer_stack_with_residuals() -> None:
    layers = [weights(2), weights(3)]
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(13))

    def rank_program(rank: int, tp_size: int):
        h = x
        for gate, up, down in layers:
            h = h + (yield from mlp_rank(h, *shard_mlp(gate, up, down, rank, tp_size)))
        return h

    results, log = run_lockstep([rank_program(r, 2) for r in range(2)])
    assert [op for op, _ in log] == ["all_reduce", "all_reduce"], "one per layer"
    h = x
    for gate, up, down in layers:
        h = h + dense_mlp(h, gate, up, down)
    # Two layers of random weights grow the values to ~1e4: float32 sums in another order
    # differ by a few units of the largest value's last bits, anywhere in the output.
    tolerance = 1e-5 * float(h.abs().max())
    assert torch.allclose(results[0], h, rtol=0, atol=tolerance)
    assert torch.equal(results[0], results[1])


def test_all_reduce_adds_in_rank_order_and_broadcast_sends_rank_0s() -> None:
    values = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])]

    def program(rank: int):
        total = yield Collective("all_reduce", values[rank])
        first = yield Collective("broadcast", values[rank] * 2)
        return torch.cat([total, first])

    results, log = run_lockstep([program(r) for r in range(3)])
    # float32: (1e8 + 1) rounds to 1e8, so in rank order the sum is 0 (other orders give 1)
    assert [r.tolist() for r in results] == [[0.0, 2e8]] * 3
    assert log == [("all_reduce", (1,)), ("broadcast", (1,))]


def test_each_rank_gets_its_own_copy() -> None:
    def program(rank: int):
        got = yield Collective("all_reduce", torch.ones(2))
        got.add_(rank * 100)  # a rank may change what it received
        return got

    results, _ = run_lockstep([program(r) for r in range(3)])
    assert [r.tolist() for r in results] == [[3.0, 3.0], [103.0, 103.0], [203.0, 203.0]], (
        "a rank that changes its result must not change another rank's")


def test_ranks_in_different_collectives_are_stopped() -> None:
    def program(rank: int):
        op = "broadcast" if rank == 1 else "all_reduce"
        return (yield Collective(op, torch.zeros(2)))

    with pytest.raises(LockstepError, match=r"(?s)rank 0.*all_reduce.*rank 1.*broadcast"):
        run_lockstep([program(r) for r in range(2)])


def test_ranks_with_different_shapes_are_stopped() -> None:
    def program(rank: int):
        return (yield Collective("all_reduce", torch.zeros(2 + rank)))

    with pytest.raises(LockstepError, match=r"(?s)rank 0.*\(2,\).*rank 1.*\(3,\)"):
        run_lockstep([program(r) for r in range(2)])


def test_a_rank_that_finishes_early_is_stopped() -> None:
    def program(rank: int):
        if rank == 0:
            yield Collective("all_reduce", torch.zeros(2))
        return torch.zeros(2)

    with pytest.raises(LockstepError, match=r"(?s)rank 0.*all_reduce.*rank 1.*finished"):
        run_lockstep([program(r) for r in range(2)])


def test_an_unknown_collective_is_a_value_error() -> None:
    def program(rank: int):
        return (yield Collective("all_gather", torch.zeros(2)))

    with pytest.raises(ValueError, match="all_gather"):
        run_lockstep([program(r) for r in range(2)])
