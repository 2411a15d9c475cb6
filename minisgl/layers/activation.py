"""The gated activation of the Qwen3 / Llama MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fast


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``x = [gate | up]`` along the last dimension.

    The MLP computes ``gate`` and ``up`` with one merged projection
    (:class:`~minisgl.layers.linear.MergedColumnParallelLinear`), so they arrive side by side
    in one tensor of width ``2 * intermediate``; this returns width ``intermediate``.
    ``silu(g) = g * sigmoid(g)``: the gate decides, per feature, how much of ``up`` passes.
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul needs an even last dimension, got shape {tuple(x.shape)}")
    out = fast.paths.silu_and_mul(x)
    if out is not None:
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
