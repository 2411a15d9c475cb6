"""A tensor-parallel MLP over simulated ranks, run in lockstep. See README.md for the rules."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    inter = gate.shape[0]
    if tp_size < 1 or inter % tp_size:
        raise ValueError(f"the intermediate size {inter} does not divide into {tp_size} ranks")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not in [0, {tp_size})")
    block = inter // tp_size
    rows = slice(rank * block, (rank + 1) * block)
    # Column parallel: this rank's output features of gate and of up, from the whole input.
    gate_up = torch.cat([gate[rows], up[rows]], dim=0)
    # Row parallel: the input columns of down that consume exactly those features.
    return gate_up, down[:, rows].clone()


def mlp_rank(x: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor) -> Generator[Collective, torch.Tensor, torch.Tensor]:
    """One rank's MLP forward: its partial output, one all-reduce, the whole output."""
    g, u = (x @ gate_up.T).split(gate_up.shape[0] // 2, dim=-1)
    partial = (F.silu(g) * u) @ down.T  # full width, but only this rank's share of the sum
    total = yield Collective("all_reduce", partial)
    return total


def _doing(state: Collective | None) -> str:
    return "finished" if state is None else f"{state.op} {tuple(state.tensor.shape)}"


def run_lockstep(programs: list[Generator[Collective, torch.Tensor, torch.Tensor]]
                 ) -> tuple[list[torch.Tensor], list[tuple[str, tuple[int, ...]]]]:
    """Run one program per rank, performing their collectives together; see README.md."""
    results: list[torch.Tensor | None] = [None] * len(programs)
    log: list[tuple[str, tuple[int, ...]]] = []

    def advance(rank: int, value: torch.Tensor | None) -> Collective | None:
        try:
            return programs[rank].send(value)  # send(None) starts a fresh generator
        except StopIteration as stop:
            results[rank] = stop.value
            return None

    states = [advance(r, None) for r in range(len(programs))]
    while any(s is not None for s in states):
        kinds = {None if s is None else (s.op, tuple(s.tensor.shape)) for s in states}
        if len(kinds) > 1:
            where = "; ".join(f"rank {r}: {_doing(s)}" for r, s in enumerate(states))
            raise LockstepError(f"the ranks are out of step: {where}")
        first = states[0]
        assert first is not None
        if first.op == "all_reduce":
            out = first.tensor.clone()
            for s in states[1:]:
                out = out + s.tensor  # type: ignore[union-attr]  # rank order: same bits
        elif first.op == "broadcast":
            out = first.tensor
        else:
            raise ValueError(f"unknown collective {first.op!r}: all_reduce or broadcast")
        log.append((first.op, tuple(first.tensor.shape)))
        states = [advance(r, out.clone()) for r in range(len(programs))]
    return results, log  # type: ignore[return-value]
