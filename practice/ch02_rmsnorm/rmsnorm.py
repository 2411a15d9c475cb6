"""RMSNorm, plain and fused with the residual add. See README.md for the rules."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise ``x`` over its last dimension by its root mean square, then scale by ``weight``.

    Args:
        x: any shape ``[..., n]``, float32 or bfloat16/float16.
        weight: ``[n]``, the learned scale.
        eps: added to the mean of squares before the square root.

    Returns:
        A new tensor of ``x``'s shape and dtype.
    """
    raise NotImplementedError("rms_norm: mean of squares in float32, rsqrt, cast back, scale")


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``residual`` to ``x`` and normalise the sum.

    Returns:
        ``(rms_norm(x + residual), x + residual)``.
    """
    raise NotImplementedError("add_rms_norm: return the normalised sum and the sum")
