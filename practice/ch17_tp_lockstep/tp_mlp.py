"""A tensor-parallel MLP over simulated ranks, run in lockstep. See README.md for the rules."""

from __future__ import annotations

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
    raise NotImplementedError(
        "shard_mlp: which of each matrix's dimensions does a column-parallel layer cut, and "
        "which a row-parallel one?")


def mlp_rank(x: Matrix, gate_up: Matrix,
             down: Matrix) -> Generator[Collective, Matrix, Matrix]:
    """One rank's MLP forward: its partial output, one all-reduce, the whole output."""
    raise NotImplementedError(
        "mlp_rank: compute this rank's partial sum, yield it, return the sum")


def run_lockstep(programs: list[Generator[Collective, Matrix, Matrix]]
                 ) -> tuple[list[Matrix], list[tuple[str, tuple[int, int]]]]:
    """Run one program per rank, performing their collectives together; see README.md."""
    raise NotImplementedError(
        "run_lockstep: advance every rank to its next collective, check they agree, perform it")
