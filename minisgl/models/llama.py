"""Llama (2, 3, 3.1, 3.2): the plain member of the family.

No qk-norm, no bias unless ``attention_bias`` asks for one (then on all four projections),
``head_dim`` usually ``hidden_size / heads``. Llama 3.1 and later stretch RoPE to long contexts
with ``rope_scaling`` of type ``llama3`` (:func:`~minisgl.layers.get_rope` has it);
the 1B and 3B models tie the LM head to the embedding, the larger ones do not. Both come from
config.json, so the shared blocks' defaults are Llama's: this file only refuses ``mlp_bias``.
"""

from __future__ import annotations

from minisgl.models.blocks import DecoderOnlyLM, refuse_true
from minisgl.models.config import ModelConfig


class LlamaForCausalLM(DecoderOnlyLM):
    def check_config(self, config: ModelConfig) -> None:
        refuse_true(config, "mlp_bias", "LlamaForCausalLM")
