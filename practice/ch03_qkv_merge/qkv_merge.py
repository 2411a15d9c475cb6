"""From separate checkpoint tensors to this rank's merged weights. See README.md."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def merged_target(name: str) -> tuple[str, int | None]:
    """Map a checkpoint tensor name to (merged parameter name, slot index), or (name, None).

    ``model.layers.0.mlp.up_proj.weight`` -> ``("model.layers.0.mlp.gate_up_proj.weight", 1)``.
    """
    raise NotImplementedError("merged_target: replace q/k/v_proj or gate/up_proj, give the slot")


def load_into_merged(
    merged: torch.Tensor,
    loaded: torch.Tensor,
    output_sizes: Sequence[int],
    shard_index: int,
    tp_rank: int,
    tp_size: int,
) -> None:
    """Copy rank ``tp_rank``'s block of ``loaded`` (slot ``shard_index``) into ``merged``.

    Args:
        merged: this rank's merged parameter, ``[sum(output_sizes) // tp_size, ...]``; changed
            in place, only in the rows of this slot.
        loaded: the full checkpoint tensor of the slot, ``[output_sizes[shard_index], ...]``.
        output_sizes: full output sizes of all slots, each divisible by ``tp_size``.
        shard_index: which slot ``loaded`` fills.
        tp_rank, tp_size: this rank and the number of ranks.

    Raises:
        ValueError: if ``loaded`` has the wrong number of rows.
    """
    raise NotImplementedError("load_into_merged: slice this rank's rows, copy them into the slot")
