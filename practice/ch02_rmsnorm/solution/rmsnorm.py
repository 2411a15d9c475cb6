"""RMSNorm per head of a flat projection, and the in-place residual form. See README.md."""

from __future__ import annotations

import torch


def _normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, statistics in float32, rounded before the scale."""
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * (x32 * inv_rms).to(x.dtype)


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
    width = x.shape[-1]
    if head_dim < 1 or width % head_dim:
        raise ValueError(f"head_dim {head_dim} does not divide the row width {width}")
    heads = x.reshape(*x.shape[:-1], width // head_dim, head_dim)  # one head per row
    return _normalize(heads, weight, eps).reshape(x.shape)


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual`` becomes ``x + residual``, ``x`` its RMSNorm.

    Returns:
        ``(x, residual)``: the tensors given, holding the new values.
    """
    residual.add_(x)  # first: x's old values are still needed here
    x.copy_(_normalize(residual, weight, eps))
    return x, residual
