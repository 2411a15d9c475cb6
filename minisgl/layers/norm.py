"""RMSNorm, and the fused "add the residual, then normalise" form a decoder layer uses."""

from __future__ import annotations

import torch

from . import fast
from .base import BaseLayer, new_parameter


class RMSNorm(BaseLayer):
    """Root-mean-square normalisation over the last dimension, with a learned scale.

    ``y = x / sqrt(mean(x**2) + eps) * weight``. Unlike LayerNorm it neither subtracts the mean
    nor adds a bias: one reduction instead of two, and it works as well for transformers.
    The weight is replicated on every tensor-parallel rank (it is ``hidden_size`` numbers).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares is taken in float32 whatever the input dtype: in bfloat16 the
        # sum of thousands of squares would lose most of its digits.
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        # Round back to the input dtype *before* the scale, as transformers' Qwen3RMSNorm
        # does: the same operations in the same order give the same bits, in bfloat16 too.
        return self.weight * (x32 * inv_rms).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x``; or, given ``residual``, normalise ``x + residual`` and return both.

        The two-output form is the pre-norm residual pattern of a decoder layer: the sum is the
        new residual stream (kept for the next skip connection) and its normalised copy is the
        input of the next sub-layer. A kernel behind :mod:`~minisgl.layers.fast` may do either
        form in place (returning ``x`` and ``residual``, overwritten), so pass tensors you no
        longer need, and use what is returned.
        """
        out = fast.paths.rmsnorm(x, self.weight, self.eps, residual)
        if out is not None:
            return out
        if residual is None:
            return self._normalize(x)
        summed = x + residual
        return self._normalize(summed), summed
