"""Qwen2 and Qwen2.5: Llama with a bias on the q, k and v projections.

The bias is always there (config.json has no switch for it) and the output projection has
none. Qwen2 can also use sliding-window attention in its upper layers; the released models
ship with it switched off (``use_sliding_window: false``), and that is the one setting
supported here.
"""

from __future__ import annotations

from minisgl.models.blocks import AttentionOptions, DecoderOnlyLM, refuse_true
from minisgl.models.config import ModelConfig


class Qwen2ForCausalLM(DecoderOnlyLM):
    def check_config(self, config: ModelConfig) -> None:
        refuse_true(config, "use_sliding_window", "Qwen2ForCausalLM")

    def attention_options(self, config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True)
