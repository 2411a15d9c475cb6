"""A tensor-parallel MLP over simulated ranks, run in lockstep. See README.md for the rules."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Collective:
    """What a rank asks of the others: ``op`` is "all_reduce" or "broadcast"."""

    op: str
    tensor: torch.Tensor


class LockstepError(RuntimeError):
    """The ranks reached different collectives, or some finished while others wait."""


def shard_mlp(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, rank: int,
              tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(gate_up, down)``: gate's and up's row blocks, down's column block."""
    raise NotImplementedError(
        "shard_mlp: which of each matrix's dimensions does a column-parallel layer cut, and "
        "which a row-parallel one?")


def mlp_rank(x: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor) -> Generator[Collective, torch.Tensor, torch.Tensor]:
    """One rank's MLP forward: its partial output, one all-reduce, the whole output."""
    raise NotImplementedError("mlp_rank: compute this rank's partial sum, yield it, return the sum")


def run_lockstep(programs: list[Generator[Collective, torch.Tensor, torch.Tensor]]
                 ) -> tuple[list[torch.Tensor], list[tuple[str, tuple[int, ...]]]]:
    """Run one program per rank, performing their collectives together; see README.md."""
    raise NotImplementedError(
        "run_lockstep: advance every rank to its next collective, check they agree, perform it")
