"""The mixture-of-experts layer: a router and ``E`` gated MLPs stacked into two tensors.

A checkpoint stores every expert as three matrices of its own
(``mlp.experts.7.gate_proj.weight`` ...). At load time they are stacked: ``gate_up`` holds
all experts' gate and up rows, ``[E, 2 * inter, hidden]``, ``down`` all down projections,
``[E, hidden, inter]``, so that a kernel can reach any expert by an offset.

Under tensor parallelism each rank keeps every expert, but only its slice of the intermediate
dimension: the gate/up rows ``r * inter/tp ...`` and the same columns of down, exactly as
:class:`~minisgl.layers.linear.MergedColumnParallelLinear` and
:class:`~minisgl.layers.linear.RowParallelLinear` split a dense MLP. Each rank's output is then
a partial sum, and one all-reduce completes it. The router is small and replicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from minisgl.distributed import all_reduce
from minisgl.layers import fast, silu_and_mul
from minisgl.layers.base import BaseLayer, ShardId, copy_checked, divide, new_parameter, take_slice
from minisgl.layers.linear import ReplicatedLinear
from minisgl.moe.grouped import moe_grouped
from minisgl.moe.reference import moe_reference
from minisgl.moe.router import Routing, route_topk

MoEFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Routing], torch.Tensor]


def moe_kernel(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               routing: Routing) -> torch.Tensor:
    """The mixture of experts as the kernels behind :mod:`minisgl.layers.fast` compute it."""
    if not fast.paths.can_moe(x):
        raise RuntimeError(f"no mixture-of-experts kernel takes a {x.dtype} tensor on "
                           f"{x.device} here; use the grouped implementation")
    return fast.paths.moe(x, gate_up, down, routing.expert_ids, routing.weights, silu_and_mul)


MOE_IMPLS: dict[str, MoEFunction] = {
    "reference": moe_reference,
    "grouped": moe_grouped,
    "fused": moe_kernel,
}

# "auto": a kernel where the seam has one (a GPU, chapter 20), the grouped path elsewhere.
_current_impl = "auto"


def moe_function(x: torch.Tensor) -> MoEFunction:
    """The MoE computation in effect for an input like ``x``."""
    if _current_impl != "auto":
        return MOE_IMPLS[_current_impl]
    return moe_kernel if fast.paths.can_moe(x) else moe_grouped


@contextlib.contextmanager
def use_moe_impl(name: str) -> Iterator[None]:
    """Compute every MoE layer of the ``with`` block with ``name`` (auto, or a MOE_IMPLS key)."""
    global _current_impl
    if name != "auto" and name not in MOE_IMPLS:
        raise ValueError(f"unknown MoE implementation {name!r}; choose from auto, "
                         f"{', '.join(MOE_IMPLS)}")
    previous, _current_impl = _current_impl, name
    try:
        yield
    finally:
        _current_impl = previous


class MoEExperts(BaseLayer):
    """``num_experts`` gated MLPs, stacked, sharded along their intermediate dimension.

    Checkpoint tensors arrive one expert at a time with ``shard_id`` ``(expert, 0)`` (gate),
    ``(expert, 1)`` (up) for ``gate_up_proj`` and ``expert`` for ``down_proj``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.local_inter = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.gate_up_proj = new_parameter(num_experts, 2 * self.local_inter, hidden_size)
        self.down_proj = new_parameter(num_experts, hidden_size, self.local_inter)

    def shard_ids(self, param_name: str = "weight") -> tuple[ShardId, ...]:
        if param_name == "gate_up_proj":
            return tuple((e, slot) for e in range(self.num_experts) for slot in (0, 1))
        return tuple(range(self.num_experts))

    def load_weight(self, loaded: torch.Tensor, shard_id: ShardId = None,
                    param_name: str = "weight") -> None:
        what = f"MoEExperts.{param_name}[{shard_id}]"
        expert, slot = shard_id if isinstance(shard_id, tuple) else (shard_id, None)
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(f"{what}: expected an expert index in 0..{self.num_experts - 1}")
        inter, start = self.local_inter, self.tp_rank * self.local_inter
        if param_name == "gate_up_proj" and slot in (0, 1):
            src = take_slice(loaded, 0, start, inter, self.intermediate_size, what)  # rows
            dst = self.gate_up_proj[expert].narrow(0, slot * inter, inter)
        elif param_name == "down_proj" and slot is None:
            src = take_slice(loaded, 1, start, inter, self.intermediate_size, what)  # columns
            dst = self.down_proj[expert]
        else:
            raise ValueError(f"{what}: expected gate_up_proj with shard_id (expert, 0|1) or "
                             "down_proj with shard_id expert")
        copy_checked(dst, src, what)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        out = moe_function(x)(x, self.gate_up_proj, self.down_proj, routing)
        return all_reduce(out) if self.tp_size > 1 else out  # each rank summed a slice of inter


class SparseMoeBlock(torch.nn.Module):
    """Router and experts: what replaces the dense MLP in a sparse decoder layer."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts)  # the router; every rank has it
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = route_topk(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, routing)
