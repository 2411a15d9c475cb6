"""Where this process sits in the tensor-parallel group, and the one collective layers need.

Tensor parallelism (chapter 17) splits every large weight matrix across ``size`` processes; the
process with index ``rank`` keeps one slice. The layers read this information when they are
built, so that they allocate only their own slice and know which part of a checkpoint tensor
to copy. With the default ``TPInfo(rank=0, size=1)`` every "slice" is the whole tensor and
nothing is communicated, which is how a single device runs.

The only communication the layers need is an all-reduce (a sum of one tensor over all ranks).
It is a hook: the default does nothing on a single rank and refuses to guess on several; the
tensor-parallel chapter registers a real implementation with :func:`set_all_reduce`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the tensor-parallel group: ``rank`` in ``[0, size)``."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank must be in [0, {self.size}), "
                             f"got rank={self.rank}")

    @property
    def is_primary(self) -> bool:
        """True on rank 0, the rank that logs and shows progress bars."""
        return self.rank == 0


AllReduceFn = Callable[[torch.Tensor], torch.Tensor]

# The process-wide state. Layers read it at construction time only, so changing it later does
# not reshape layers that already exist.
_tp_info = TPInfo()
_all_reduce_fn: AllReduceFn | None = None


def get_tp_info() -> TPInfo:
    """Return the tensor-parallel position of this process (``TPInfo(0, 1)`` unless set)."""
    return _tp_info


def set_tp_info(rank: int, size: int) -> TPInfo:
    """Set this process's tensor-parallel position; returns the previous one (to restore it)."""
    global _tp_info
    previous = _tp_info
    _tp_info = TPInfo(rank=rank, size=size)
    return previous


def set_all_reduce(fn: AllReduceFn | None) -> None:
    """Register the function that sums a tensor over all ranks.

    ``fn(x)`` must return the element-wise sum of ``x`` over the group (it may work in place and
    return ``x``). Pass ``None`` to go back to the default.
    """
    global _all_reduce_fn
    _all_reduce_fn = fn


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group.

    On a single rank the sum of one tensor is itself, so this returns ``x`` untouched. On several
    ranks it calls the registered implementation, and fails loudly if there is none: silently
    skipping the reduction would give each rank a partial result that still looks plausible.
    """
    if _all_reduce_fn is not None:
        return _all_reduce_fn(x)
    if _tp_info.size == 1:
        return x
    raise RuntimeError(f"all_reduce called with tensor-parallel size {_tp_info.size} but no "
                       "implementation is registered; call minisgl.distributed.set_all_reduce(fn) "
                       "after setting up the process group")
