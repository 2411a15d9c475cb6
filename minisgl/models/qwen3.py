"""Qwen3 (dense): the decoder-only transformer of the Qwen3 0.6B-32B checkpoints.

The architecture, from the token ids up:

    embed_tokens -> [decoder layer] x num_layers -> norm -> lm_head
    decoder layer: x + attention(rmsnorm(x)), then x + mlp(rmsnorm(x))
    attention:     qkv_proj -> q_norm / k_norm per head -> RoPE -> causal attention -> o_proj
    mlp:           gate_up_proj -> silu(gate) * up -> down_proj

What makes it Qwen3 rather than Llama is small: RMSNorm on every query and key head
(``q_norm``/``k_norm``) before the rotation, no bias in the projections, an explicit
``head_dim`` (128 in the released models, not ``hidden_size / heads``). The blocks live in
:mod:`minisgl.models.blocks`, shared with Llama, Qwen2 and Qwen3-MoE; Qwen3 only names its
options.
"""

from __future__ import annotations

import dataclasses

from minisgl.models.blocks import AttentionOptions, DecoderOnlyLM
from minisgl.models.config import ModelConfig


class Qwen3ForCausalLM(DecoderOnlyLM):
    def attention_options(self, config: ModelConfig) -> AttentionOptions:
        return dataclasses.replace(super().attention_options(config), qk_norm=True)
