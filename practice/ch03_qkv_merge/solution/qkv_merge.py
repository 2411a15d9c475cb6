"""From separate checkpoint tensors to this rank's merged weights. See README.md."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# checkpoint module -> (merged module, slot)
MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def merged_target(name: str) -> tuple[str, int | None]:
    """Map a checkpoint tensor name to (merged parameter name, slot index), or (name, None).

    ``model.layers.0.mlp.up_proj.weight`` -> ``("model.layers.0.mlp.gate_up_proj.weight", 1)``.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in MERGED:
            merged_module, slot = MERGED[part]
            return ".".join([*parts[:i], merged_module, *parts[i + 1:]]), slot
    return name, None


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
    full = output_sizes[shard_index]
    if loaded.shape[0] != full:
        raise ValueError(f"slot {shard_index} expects a tensor with {full} rows, "
                         f"got {loaded.shape[0]}")
    local_sizes = [size // tp_size for size in output_sizes]
    local = local_sizes[shard_index]
    offset = sum(local_sizes[:shard_index])  # where this slot starts in the merged rows
    with torch.no_grad():
        merged.narrow(0, offset, local).copy_(loaded.narrow(0, tp_rank * local, local))
