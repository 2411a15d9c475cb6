"""Qwen3 (dense): the decoder-only transformer of the Qwen3 0.6B-32B checkpoints.

The architecture, from the token ids up:

    embed_tokens -> [decoder layer] x num_layers -> norm -> lm_head
    decoder layer: x + attention(rmsnorm(x)), then x + mlp(rmsnorm(x))
    attention:     qkv_proj -> q_norm / k_norm per head -> RoPE -> causal attention -> o_proj
    mlp:           gate_up_proj -> silu(gate) * up -> down_proj

What makes it Qwen3 rather than Llama is small: RMSNorm on every query and key head
(``q_norm``/``k_norm``) before the rotation, no bias in the projections, an explicit
``head_dim`` (128 in the released models, not ``hidden_size / heads``).
Module and parameter names follow the checkpoint's (``model.layers.0.self_attn.o_proj``) except
for the two fused projections, which :meth:`BaseLLMModel.checkpoint_to_param` maps.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
    silu_and_mul,
)
from minisgl.layers.attention import AttentionLayer
from minisgl.models.base import BaseLLMModel
from minisgl.models.config import ModelConfig


class Qwen3Attention(nn.Module):
    """Self-attention: fused qkv projection, the attention layer, output projection."""

    def __init__(self, config: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_qo_heads, config.num_kv_heads,
            bias=config.attention_bias,
        )
        # Registered here first, so their parameters carry the checkpoint's names
        # (self_attn.q_norm.weight); AttentionLayer below holds the same modules.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.attn = AttentionLayer(
            layer_id, config.num_qo_heads, config.num_kv_heads, config.head_dim, rope,
            q_norm=self.q_norm, k_norm=self.k_norm,
        )
        self.o_proj = RowParallelLinear(
            config.num_qo_heads * config.head_dim, config.hidden_size, bias=False
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(self.qkv_proj(x), positions))


class Qwen3MLP(nn.Module):
    """The gated feed-forward block: ``down(silu(gate(x)) * up(x))``, gate and up fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen3MLP supports hidden_act 'silu', got {config.hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size, config.intermediate_size]
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    """One pre-norm transformer block.

    The residual stream is carried separately from the sub-layer output: each norm receives
    the sub-layer output and the residual so far, adds them, and returns the normalised sum
    and the sum itself (:meth:`RMSNorm.forward`'s fused form). The very first layer has no
    residual yet; its input is the residual.
    """

    def __init__(self, config: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_id, rope)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    """The transformer body: embedding, the decoder layers and the final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One rotary table for all layers: they use the same positions and frequencies.
        rotary = config.rotary
        rope = get_rope(rotary.head_dim, rotary.rotary_dim, rotary.max_position,
                        rotary.base, rotary.scaling)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, layer_id, rope) for layer_id in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, positions, residual)
        x, _ = self.norm(x, residual)  # the last layer's output still needs its skip added
        return x


class Qwen3ForCausalLM(BaseLLMModel):
    """Qwen3 with its LM head: the class config.json's ``architectures`` names."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = Qwen3Model(config)
        # Tied checkpoints (the small Qwen3s, tiny-qwen3) store one matrix for both ends of
        # the network; the head then shares the embedding's parameter instead of its own copy.
        tie_to = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tie_to=tie_to)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions)
        if logits_indices is not None:
            hidden = hidden[logits_indices]  # score only the rows asked for
        return self.lm_head(hidden).float()
