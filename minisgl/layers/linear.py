"""Linear layers, whole or split across tensor-parallel ranks.

A linear layer computes ``y = x @ W.T + b`` with ``W`` of shape ``[out_features, in_features]``
(PyTorch's and the checkpoints' layout). There are two ways to split it over ``tp`` ranks:

* **column parallel**: each rank keeps a block of *output* rows of ``W`` and produces a slice of
  ``y``, with no communication;
* **row parallel**: each rank keeps a block of *input* columns of ``W``, multiplies the matching
  slice of ``x`` and gets a partial ``y``; an all-reduce sums the partials into the full ``y``.

A transformer block uses them in pairs (column then row, once in attention and once in the
MLP), so each block needs two all-reduces and nothing else. With ``tp == 1`` every class
below is an ordinary ``nn.Linear`` whose ``load_weight`` knows how checkpoint tensors map in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from minisgl.distributed import all_reduce, get_tp_info

from . import fast
from .base import (
    BaseLayer,
    ShardId,
    copy_checked,
    divide,
    first_local_kv_head,
    local_kv_heads,
    new_parameter,
    take_slice,
)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, in ``out_dtype`` when given (float32 for the LM head's logits).

    A kernel behind :mod:`~minisgl.layers.fast` may take the product; ``F.linear`` otherwise.
    """
    y = fast.paths.matmul(x, weight, out_dtype)
    if y is not None:
        return y if bias is None else y + bias
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


class _LinearBase(BaseLayer):
    """``y = x @ W.T (+ b)`` with this rank's local ``W`` of shape ``[local_out, local_in]``."""

    def __init__(self, local_input_size: int, local_output_size: int, bias: bool) -> None:
        super().__init__()
        self.local_input_size = local_input_size
        self.local_output_size = local_output_size
        self.weight = new_parameter(local_output_size, local_input_size)
        if bias:
            self.bias = new_parameter(local_output_size)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"local_in={self.local_input_size}, local_out={self.local_output_size}, "
                f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}")


class ReplicatedLinear(_LinearBase):
    """A linear layer every rank holds whole (small matrices such as an MoE router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias)


class ColumnParallelLinear(_LinearBase):
    """A linear layer whose output features are split: rank ``r`` computes block ``r`` of ``y``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_info().size
        super().__init__(input_size, divide(output_size, tp_size, "output_size"), bias)
        self.output_size = output_size

    def load_weight(
        self, loaded: torch.Tensor, shard_id: ShardId = None, param_name: str = "weight"
    ) -> None:
        # Both W [out, in] and b [out] are split along their first (output) dimension.
        param = getattr(self, param_name)
        rows = self.local_output_size
        src = take_slice(loaded, 0, self.tp_rank * rows, rows, self.output_size,
                         f"{type(self).__name__}.{param_name}")
        copy_checked(param, src, f"{type(self).__name__}.{param_name}")


class MergedColumnParallelLinear(_LinearBase):
    """Several column-parallel projections of the same input, stored as one matrix.

    The MLP's ``gate_proj`` and ``up_proj`` both read the same ``x``; stacking their weights
    turns two matrix multiplications into one larger, faster one. Rank ``r``'s parameter holds
    ``[gate block r; up block r]``: *not* block ``r`` of the concatenation ``[gate; up]``, which
    is why each checkpoint tensor is sliced on its own, by ``shard_id`` (0 for gate, 1 for up).
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        tp_size = get_tp_info().size
        local_sizes = [divide(size, tp_size, f"output_sizes[{i}]")
                       for i, size in enumerate(output_sizes)]
        super().__init__(input_size, sum(local_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.local_sizes = local_sizes

    def shard_ids(self, param_name: str = "weight") -> tuple[ShardId, ...]:
        return tuple(range(len(self.output_sizes)))

    def load_weight(
        self, loaded: torch.Tensor, shard_id: ShardId = None, param_name: str = "weight"
    ) -> None:
        if shard_id not in self.shard_ids():
            raise ValueError(f"MergedColumnParallelLinear needs shard_id in {self.shard_ids()}, "
                             f"got {shard_id!r}")
        assert isinstance(shard_id, int)
        what = f"MergedColumnParallelLinear.{param_name}[{shard_id}]"
        local = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])  # where this slot starts in our parameter
        src = take_slice(loaded, 0, self.tp_rank * local, local, self.output_sizes[shard_id], what)
        copy_checked(getattr(self, param_name).narrow(0, offset, local), src, what)


class QKVParallelLinear(_LinearBase):
    """The q, k and v projections of attention as one column-parallel matrix, split by heads.

    Each rank keeps whole attention heads: ``num_qo_heads / tp`` query heads and
    ``num_kv_heads / tp`` key/value heads (one replicated KV head when there are fewer KV heads
    than ranks). Its output is ``[q | k | v]`` for those heads, which is what
    :class:`~minisgl.layers.attention.AttentionLayer` splits apart again.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_qo_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size = get_tp_info().size
        local_qo = divide(num_qo_heads, tp_size, "num_qo_heads")
        local_kv = local_kv_heads(num_kv_heads, tp_size)
        super().__init__(hidden_size, (local_qo + 2 * local_kv) * head_dim, bias)
        self.head_dim = head_dim
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.local_qo_heads = local_qo
        self.local_kv_heads = local_kv

    def shard_ids(self, param_name: str = "weight") -> tuple[ShardId, ...]:
        return ("q", "k", "v")

    def load_weight(
        self, loaded: torch.Tensor, shard_id: ShardId = None, param_name: str = "weight"
    ) -> None:
        """Copy this rank's heads of the full ``q_proj``, ``k_proj`` or ``v_proj`` tensor."""
        if shard_id == "q":
            full_heads, first_head = self.num_qo_heads, self.tp_rank * self.local_qo_heads
            num_heads, dst_head = self.local_qo_heads, 0
        elif shard_id in ("k", "v"):
            full_heads = self.num_kv_heads
            first_head = first_local_kv_head(self.num_kv_heads, self.tp_rank, self.tp_size)
            num_heads = self.local_kv_heads
            # k follows the query heads, v follows k.
            dst_head = self.local_qo_heads + (0 if shard_id == "k" else self.local_kv_heads)
        else:
            raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        d = self.head_dim
        what = f"QKVParallelLinear.{param_name}[{shard_id}]"
        src = take_slice(loaded, 0, first_head * d, num_heads * d, full_heads * d, what)
        copy_checked(getattr(self, param_name).narrow(0, dst_head * d, num_heads * d), src, what)


class RowParallelLinear(_LinearBase):
    """A linear layer whose input features are split; partial outputs are summed by all-reduce.

    It consumes the sharded output of a column-parallel layer as is (each rank already holds the
    matching slice of ``x``), so the pair needs one communication instead of two.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_info().size
        super().__init__(divide(input_size, tp_size, "input_size"), output_size, bias)
        self.input_size = input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return matmul(x, self.weight, self.bias)
        y = all_reduce(matmul(x, self.weight))
        # The bias is added once, after the sum; adding it on every rank would count it tp times.
        return y if self.bias is None else y + self.bias

    def load_weight(
        self, loaded: torch.Tensor, shard_id: ShardId = None, param_name: str = "weight"
    ) -> None:
        what = f"RowParallelLinear.{param_name}"
        if param_name == "bias":  # one output vector, the same on every rank
            copy_checked(self.bias, loaded, what)
            return
        cols = self.local_input_size
        src = take_slice(loaded, 1, self.tp_rank * cols, cols, self.input_size, what)
        copy_checked(self.weight, src, what)
