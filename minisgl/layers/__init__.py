"""The building blocks of a decoder-only transformer, each one tensor-parallel aware.

Every layer here is a ``torch.nn.Module`` that matches its Hugging Face ``transformers``
counterpart numerically, and (if it has weights) a ``load_weight`` method that copies this
rank's slice of a full checkpoint tensor into place. The attention layer, which needs the
attention-backend seam, lives in :mod:`minisgl.layers.attention`.
"""

from __future__ import annotations

from .activation import silu_and_mul
from .base import BaseLayer
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                     ReplicatedLinear, RowParallelLinear)
from .norm import RMSNorm
from .rotary import RotaryEmbedding, get_rope

__all__ = ["BaseLayer", "ColumnParallelLinear", "MergedColumnParallelLinear", "ParallelLMHead",
           "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RotaryEmbedding",
           "RowParallelLinear", "VocabParallelEmbedding", "get_rope", "silu_and_mul"]
