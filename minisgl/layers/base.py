"""What every layer with weights shares: its tensor-parallel position and how it loads weights.

A checkpoint stores each weight whole, as the model was trained. Under tensor parallelism
(chapter 17) each rank keeps only a slice, and some of our layers also fuse several checkpoint
tensors into one parameter (q, k and v into ``qkv_proj``). So loading is not "copy tensor A into
parameter A": each layer decides which rows or columns of a full checkpoint tensor are its own
and where they go. That decision lives in the layer, in ``load_weight``, next to the code that
chose the parameter's shape; the model loader (``minisgl/models/weight.py``) only routes tensors.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn

from minisgl.distributed import get_tp_info

ShardId = Hashable  # None for a whole tensor, "q"/"k"/"v" or 0/1 for a slot of a merged one


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, refusing to round: a remainder means a broken split."""
    if numerator % denominator != 0:
        raise ValueError(
            f"cannot split {what}={numerator} evenly over {denominator} tensor-parallel ranks"
        )
    return numerator // denominator


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """Number of key/value heads each rank holds.

    With grouped-query attention there can be fewer KV heads than ranks (8 KV heads on 16
    GPUs). A head cannot be cut in half, so then every rank keeps one whole KV head and
    ``tp_size // num_kv_heads`` neighbouring ranks hold copies of the same head.
    """
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size, "num_kv_heads")
    if tp_size % num_kv_heads != 0:
        raise ValueError(
            f"cannot replicate {num_kv_heads} KV heads over {tp_size} ranks: "
            "the rank count must be a multiple of the head count"
        )
    return 1


def first_local_kv_head(num_kv_heads: int, tp_rank: int, tp_size: int) -> int:
    """Index (in the full model) of the first KV head that rank ``tp_rank`` holds."""
    if num_kv_heads >= tp_size:
        return tp_rank * local_kv_heads(num_kv_heads, tp_size)
    return tp_rank // (tp_size // num_kv_heads)  # replicated: a run of ranks shares one head


def new_parameter(*shape: int) -> nn.Parameter:
    """An uninitialised parameter of ``shape`` on the current default device and dtype.

    ``torch.empty`` skips initialisation, which would be wasted work: every value is overwritten
    by the checkpoint. ``requires_grad=False`` because this engine only runs inference.
    """
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def take_slice(
    full: torch.Tensor, dim: int, start: int, length: int, full_size: int, what: str
) -> torch.Tensor:
    """``full[start:start+length]`` along ``dim``, after checking ``full`` has ``full_size`` there.

    The check catches a checkpoint whose tensor does not match the config before ``narrow``
    would fail (or, worse, succeed on the wrong rows).
    """
    if full.dim() <= dim or full.shape[dim] != full_size:
        raise ValueError(
            f"{what}: expected a checkpoint tensor with {full_size} entries along dim {dim}, "
            f"got shape {tuple(full.shape)}"
        )
    return full.narrow(dim, start, length)


@torch.no_grad()
def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy ``src`` into ``dst`` (converting dtype and device), insisting the shapes agree.

    ``Tensor.copy_`` would happily broadcast a [1, N] tensor into [M, N]; a wrong checkpoint
    must fail here instead, with both shapes in the message.
    """
    if dst.shape != src.shape:
        raise ValueError(
            f"{what}: checkpoint slice has shape {tuple(src.shape)} but the parameter "
            f"expects {tuple(dst.shape)}"
        )
    dst.copy_(src)


class BaseLayer(nn.Module):
    """A module whose parameters are filled from full checkpoint tensors by ``load_weight``.

    The tensor-parallel rank and size are read once, here, at construction: a layer's shapes
    depend on them, so they cannot change afterwards.
    """

    def __init__(self) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank = tp.rank
        self.tp_size = tp.size

    def shard_ids(self, param_name: str = "weight") -> tuple[ShardId, ...]:
        """The ``shard_id`` values whose ``load_weight`` calls together fill ``param_name``.

        A plain parameter comes from one checkpoint tensor (``(None,)``); a merged one lists its
        slots. The loader uses this to tell exactly which checkpoint tensor is missing.
        """
        return (None,)

    def load_weight(
        self, loaded: torch.Tensor, shard_id: ShardId = None, param_name: str = "weight"
    ) -> None:
        """Copy this rank's part of the full checkpoint tensor ``loaded`` into ``param_name``.

        The default is for replicated parameters: every rank keeps the whole tensor.
        """
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no merged slots, "
                             f"got shard_id={shard_id!r}")
        copy_checked(getattr(self, param_name), loaded, f"{type(self).__name__}.{param_name}")
