"""A tensor-parallel MLP over simulated ranks, run in lockstep. See README.md for the rules."""

from __future__ import annotations

import copy
import math
from collections.abc import Generator
from dataclasses import dataclass

Matrix = list[list[float]]  # a list of rows, PyTorch's [out, in] layout for weights


@dataclass(frozen=True)
class Collective:
    """What a rank asks of the others: ``op`` is "all_reduce" or "broadcast"."""

    op: str
    value: Matrix


class LockstepError(RuntimeError):
    """The ranks reached different collectives, or some finished while others wait."""


def shape(m: Matrix) -> tuple[int, int]:
    """``(rows, columns)`` of a matrix."""
    return (len(m), len(m[0]) if m else 0)


def matmul_t(a: Matrix, b: Matrix) -> Matrix:
    """``a @ b.T``: ``a`` is ``[n, k]``, ``b`` is ``[m, k]``, the result ``[n, m]``."""
    return [[sum(x * y for x, y in zip(row, col)) for col in b] for row in a]


def silu(x: float) -> float:
    """``x * sigmoid(x)``, Qwen3's gate activation (written with tanh: no overflow)."""
    return 0.5 * x * (1.0 + math.tanh(0.5 * x))


def shard_mlp(gate: Matrix, up: Matrix, down: Matrix, rank: int,
              tp_size: int) -> tuple[Matrix, Matrix]:
    """Rank ``rank``'s ``(gate_up, down)``: gate's and up's row blocks, down's column block."""
    inter = len(gate)
    if tp_size < 1 or inter % tp_size:
        raise ValueError(f"the intermediate size {inter} does not divide into {tp_size} ranks")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not in [0, {tp_size})")
    block = inter // tp_size
    lo, hi = rank * block, (rank + 1) * block
    # Column parallel: this rank's output features of gate and of up, from the whole input.
    gate_up = [list(row) for row in gate[lo:hi]] + [list(row) for row in up[lo:hi]]
    # Row parallel: the input columns of down that consume exactly those features.
    return gate_up, [row[lo:hi] for row in down]


def mlp_rank(x: Matrix, gate_up: Matrix,
             down: Matrix) -> Generator[Collective, Matrix, Matrix]:
    """One rank's MLP forward: its partial output, one all-reduce, the whole output."""
    half = len(gate_up) // 2
    features = [[silu(g) * u for g, u in zip(row[:half], row[half:])]
                for row in matmul_t(x, gate_up)]
    partial = matmul_t(features, down)  # full width, but only this rank's share of the sum
    total = yield Collective("all_reduce", partial)
    return total


def _doing(state: Collective | None) -> str:
    return "finished" if state is None else f"{state.op} {shape(state.value)}"


def run_lockstep(programs: list[Generator[Collective, Matrix, Matrix]]
                 ) -> tuple[list[Matrix], list[tuple[str, tuple[int, int]]]]:
    """Run one program per rank, performing their collectives together; see README.md."""
    results: list[Matrix | None] = [None] * len(programs)
    log: list[tuple[str, tuple[int, int]]] = []

    def advance(rank: int, value: Matrix | None) -> Collective | None:
        try:
            return programs[rank].send(value)  # send(None) starts a fresh generator
        except StopIteration as stop:
            results[rank] = stop.value
            return None

    states = [advance(r, None) for r in range(len(programs))]
    while any(s is not None for s in states):
        kinds = {None if s is None else (s.op, shape(s.value)) for s in states}
        if len(kinds) > 1:
            where = "; ".join(f"rank {r}: {_doing(s)}" for r, s in enumerate(states))
            raise LockstepError(f"the ranks are out of step: {where}")
        first = states[0]
        assert first is not None
        if first.op == "all_reduce":
            out = copy.deepcopy(first.value)
            for s in states[1:]:  # rank order: every run adds in the same order, same bits
                out = [[a + b for a, b in zip(r, q)] for r, q in zip(out, s.value)]  # type: ignore[union-attr]
        elif first.op == "broadcast":
            out = first.value
        else:
            raise ValueError(f"unknown collective {first.op!r}: all_reduce or broadcast")
        log.append((first.op, shape(first.value)))
        states = [advance(r, copy.deepcopy(out)) for r in range(len(programs))]
    return results, log  # type: ignore[return-value]
