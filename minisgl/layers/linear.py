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
from .activation import silu_and_mul
from .base import (BaseLayer, ShardId, copy_checked, divide, first_local_kv_head, local_kv_heads,
                   new_parameter, take_slice)
from .norm import RMSNorm


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
           gated: bool = False) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, in ``out_dtype`` when given (float32 for the LM head's logits).

    A kernel behind :mod:`~minisgl.layers.fast` may take the product; ``F.linear`` otherwise.
    ``out`` (no bias) receives the product: a CUDA graph's fixed logits, written in place.
    ``gated``: ``x`` is ``[gate | up]`` and the product is of ``silu(gate) * up``, the gated
    MLP's activation, which a kernel may apply as it reads ``x`` instead of in a pass of its own.
    """
    assert out is None or bias is None, "out= is for a product without bias"
    if gated:
        y = fast.paths.gated_matmul(x, weight)
        if y is not None:
            return y if bias is None else y + bias
        x = silu_and_mul(x)
    y = fast.paths.matmul(x, weight, out_dtype, out)
    if y is not None:
        return y if bias is None else y + bias
    y = F.linear(x, weight, bias)
    y = y if out_dtype is None else y.to(out_dtype)
    return y if out is None else out.copy_(y)


def normed_linear(norm: RMSNorm, linear: _LinearBase, x: torch.Tensor,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(norm(x + residual))`` and the new residual ``x + residual`` (``x`` when
    ``residual`` is None): the add, the norm and the first product of a pre-norm sub-layer.

    A kernel behind :mod:`~minisgl.layers.fast` may normalise ``x`` as it reads it for the
    product, one pass instead of two; without one this is the norm, then the layer. ``linear``
    is column-parallel (its input whole on every rank), so the kernel needs no communication.
    """
    fused = fast.paths.normed_matmul(x, residual, norm.weight, norm.eps, linear.weight)
    if fused is not None:
        y, residual = fused
        return (y if linear.bias is None else y + linear.bias), residual
    if residual is None:
        return linear(norm(x)), x
    x, residual = norm(x, residual)
    return linear(x), residual


class _LinearBase(BaseLayer):
    """``y = x @ W.T (+ b)`` with this rank's local ``W`` of shape ``[local_out, local_in]``."""

    def __init__(self, local_input_size: int, local_output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = new_parameter(local_output_size, local_input_size)
        self.bias = new_parameter(local_output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)


class ReplicatedLinear(_LinearBase):
    """A linear layer every rank holds whole (small matrices such as an MoE router)."""


class _ColumnSlots(_LinearBase):
    """A column-parallel layer whose output is one or more checkpoint tensors' rows, side by side.

    ``slots`` maps each checkpoint tensor's ``shard_id`` to (its full rows, the first row this
    rank keeps, how many it keeps), in output order. Each tensor is sliced on its own and copied
    to its offset in the local parameter.
    """

    def __init__(self, input_size: int, slots: dict[ShardId, tuple[int, int, int]],
                 bias: bool) -> None:
        super().__init__(input_size, sum(rows for _, _, rows in slots.values()), bias)
        self.slots = slots

    def shard_ids(self, param_name: str = "weight") -> tuple[ShardId, ...]:
        return tuple(self.slots)

    def load_weight(
        self, loaded: torch.Tensor, shard_id: ShardId = None, param_name: str = "weight"
    ) -> None:
        """Copy this rank's rows of slot ``shard_id``'s full checkpoint tensor into place."""
        name = type(self).__name__
        if shard_id not in self.slots:
            raise ValueError(f"{name} needs shard_id in {self.shard_ids()}, got {shard_id!r}")
        what = f"{name}.{param_name}" + ("" if shard_id is None else f"[{shard_id}]")
        ids = list(self.slots)
        offset = sum(self.slots[s][2] for s in ids[: ids.index(shard_id)])  # earlier slots' rows
        full, first, rows = self.slots[shard_id]
        src = take_slice(loaded, 0, first, rows, full, what)  # W [out, in] and b [out] alike
        copy_checked(getattr(self, param_name).narrow(0, offset, rows), src, what)


class ColumnParallelLinear(_ColumnSlots):
    """A linear layer whose output features are split: rank ``r`` computes block ``r`` of ``y``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = get_tp_info()
        rows = divide(output_size, tp.size, "output_size")
        super().__init__(input_size, {None: (output_size, tp.rank * rows, rows)}, bias)


class MergedColumnParallelLinear(_ColumnSlots):
    """Several column-parallel projections of the same input, stored as one matrix.

    The MLP's ``gate_proj`` and ``up_proj`` both read the same ``x``; stacking their weights
    turns two matrix multiplications into one larger, faster one. Rank ``r``'s parameter holds
    ``[gate block r; up block r]``: *not* block ``r`` of the concatenation ``[gate; up]``, which
    is why each checkpoint tensor is its own slot, by ``shard_id`` (0 for gate, 1 for up).
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        tp = get_tp_info()
        slots: dict[ShardId, tuple[int, int, int]] = {}
        for i, size in enumerate(output_sizes):
            rows = divide(size, tp.size, f"output_sizes[{i}]")
            slots[i] = (size, tp.rank * rows, rows)
        super().__init__(input_size, slots, bias)


class QKVParallelLinear(_ColumnSlots):
    """The q, k and v projections of attention as one column-parallel matrix, split by heads.

    Each rank keeps whole attention heads: ``num_qo_heads / tp`` query heads and
    ``num_kv_heads / tp`` key/value heads (one replicated KV head when there are fewer KV heads
    than ranks). Its output is ``[q | k | v]`` for those heads, which is what
    :class:`~minisgl.layers.attention.AttentionLayer` splits apart again.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_qo_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = get_tp_info()
        local_qo = divide(num_qo_heads, tp.size, "num_qo_heads")
        local_kv = local_kv_heads(num_kv_heads, tp.size)
        first_kv = first_local_kv_head(num_kv_heads, tp.rank, tp.size)
        # In rows: (the checkpoint tensor's, the first this rank keeps, how many it keeps).
        q = (num_qo_heads * head_dim, tp.rank * local_qo * head_dim, local_qo * head_dim)
        kv = (num_kv_heads * head_dim, first_kv * head_dim, local_kv * head_dim)
        super().__init__(hidden_size, {"q": q, "k": kv, "v": kv}, bias)
        self.local_qo_heads = local_qo
        self.local_kv_heads = local_kv


class RowParallelLinear(_LinearBase):
    """A linear layer whose input features are split; partial outputs are summed by all-reduce.

    It consumes the sharded output of a column-parallel layer as is (each rank already holds the
    matching slice of ``x``), so the pair needs one communication instead of two.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_info().size
        super().__init__(divide(input_size, tp_size, "input_size"), output_size, bias)
        self.input_size = input_size

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """``x @ W.T`` summed over ranks; ``gated``: of ``silu(gate) * up`` for ``x = [gate | up]``
        (each rank holds its slice of both halves, so the activation stays local)."""
        if self.tp_size == 1:
            return matmul(x, self.weight, self.bias, gated=gated)
        y = all_reduce(matmul(x, self.weight, gated=gated))
        # The bias is added once, after the sum; adding it on every rank would count it tp times.
        return y if self.bias is None else y + self.bias

    def load_weight(
        self, loaded: torch.Tensor, shard_id: ShardId = None, param_name: str = "weight"
    ) -> None:
        what = f"RowParallelLinear.{param_name}"
        if param_name == "bias":  # one output vector, the same on every rank
            copy_checked(self.bias, loaded, what)
            return
        cols = self.weight.shape[1]
        src = take_slice(loaded, 1, self.tp_rank * cols, cols, self.input_size, what)
        copy_checked(self.weight, src, what)
