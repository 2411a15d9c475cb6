"""The interface every model implements, and how its checkpoint names map to its parameters.

Chapter 3 tells the story.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import ClassVar

import torch
from torch import nn

from minisgl.models.config import ModelConfig


class BaseLLMModel(nn.Module, ABC):
    """A causal language model: token ids and their positions in, next-token logits out.

    There is no batch dimension: the tokens of all requests of a step are one flat sequence of
    ``T`` tokens, each with its own position; the attention backend knows which belong together.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits, float32, of shape [T, vocab] or [len(logits_indices), vocab].

        ``logits_indices`` picks the token rows to score *before* the LM head: during
        generation only the last token of each request needs logits, and the LM head (a
        ``hidden x vocab`` matrix product) is the most expensive layer per scored token.
        ``out``, when given, receives the logits (a CUDA graph's fixed memory: no copy).
        """

    # Checkpoint tensors that our layers fuse: the checkpoint's module name -> (our module
    # name, the shard_id its load_weight expects). Every Llama-family checkpoint uses these.
    merged_modules: ClassVar[dict[str, tuple[str, Hashable]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def checkpoint_to_param(self, name: str) -> tuple[str, Hashable]:
        """Map a checkpoint tensor name to (our parameter name, shard_id).

        ``model.layers.3.self_attn.k_proj.weight`` -> (``model.layers.3.self_attn.qkv_proj.weight``,
        ``"k"``); a name that is not fused maps to itself with shard_id None.
        """
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.merged_modules:
                merged, shard_id = self.merged_modules[part]
                return ".".join(parts[:i] + [merged] + parts[i + 1 :]), shard_id
        return name, None

    def param_to_checkpoint(self, param_name: str, shard_id: Hashable) -> str:
        """The inverse of :meth:`checkpoint_to_param`: which checkpoint tensor fills this slot."""
        *parent, merged, leaf = param_name.split(".")
        for ckpt_module, target in self.merged_modules.items():
            if target == (merged, shard_id):
                return ".".join([*parent, ckpt_module, leaf])
        return param_name if shard_id is None else f"{param_name}[{shard_id}]"
