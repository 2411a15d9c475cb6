"""RMSNorm per head of a flat projection, and the in-place residual form. See README.md."""

from __future__ import annotations

import torch


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   head_dim: int) -> torch.Tensor:
    """Normalise every ``head_dim``-wide head of ``x``'s rows on its own, then scale by ``weight``.

    Args:
        x: ``[T, heads * head_dim]``, float32 or bfloat16/float16.
        weight: ``[head_dim]``, the learned scale, shared by every head.
        eps: added to each head's mean of squares before the square root.
        head_dim: the width of one head; must divide ``x``'s last dimension.

    Returns:
        A new tensor of ``x``'s shape and dtype.
    """
    raise NotImplementedError(
        "rms_norm_heads: each head's slice of a row gets its own root mean square; "
        "README.md gives the rules")


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual`` becomes ``x + residual``, ``x`` its RMSNorm.

    Returns:
        ``(x, residual)``: the tensors given, holding the new values.
    """
    raise NotImplementedError(
        "add_rms_norm_: overwrite the two tensors you were given, then return them")
