"""The pieces every Llama-family decoder shares, so that a model file only says how it differs.

=============  ==========  =========  ==========  ===================
family         q/k/v bias  o bias     qk-norm     feed-forward
=============  ==========  =========  ==========  ===================
Llama          config      config     no          gated MLP
Qwen2          yes         no         no          gated MLP
Qwen3          config      config     yes         gated MLP
Qwen3-MoE      config      config     yes         gated MLP or experts
=============  ==========  =========  ==========  ===================

A family subclasses :class:`DecoderOnlyLM` and overrides up to three hooks. Module names are the
checkpoints' (``model.layers.3.self_attn.o_proj``), so the loader's name mapping applies
unchanged. Chapter 18 tells the story.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minisgl.layers import (MergedColumnParallelLinear, ParallelLMHead, RMSNorm, RowParallelLinear,
                            VocabParallelEmbedding, get_rope)
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.linear import normed_linear
from minisgl.models.base import BaseLLMModel
from minisgl.models.config import ConfigError, ModelConfig


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one column-parallel matrix;
    the down projection applies the activation as it reads (``gated=True``)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), gated=True)


@dataclass(frozen=True)
class AttentionOptions:
    """What a family's attention has beyond the common core."""

    qkv_bias: bool = False  # a bias on the q, k and v projections
    o_bias: bool = False  # a bias on the output projection
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE (Qwen3)


class DecoderLayer(nn.Module):
    """One pre-norm block, the residual carried beside the stream."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm is taken with the product that reads it (normed_linear), which a kernel
        # may do in one pass; an MLP without one first product (experts) takes it whole.
        qkv, residual = normed_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        x = self.self_attn.attend(qkv, positions)
        if isinstance(self.mlp, GatedMLP):
            gate_up, residual = normed_linear(self.post_attention_layernorm,
                                              self.mlp.gate_up_proj, x, residual)
            return self.mlp.down_proj(gate_up, gated=True), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm (``model.*`` in a checkpoint)."""

    def __init__(self, config: ModelConfig, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, positions, residual)
        x, _ = self.norm(x, residual)
        return x


class DecoderOnlyLM(BaseLLMModel):
    """A Llama-family causal LM; a family overrides the three hooks below that it needs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if config.hidden_act != "silu":  # the activation of every MLP and expert here
            raise ConfigError(f"{type(self).__name__} supports hidden_act 'silu', "
                              f"got {config.hidden_act!r}")
        self.check_config(config)
        rope = get_rope(config.head_dim, config.rotary_dim, config.max_position_embeddings,
                        config.rope_theta, config.rope_scaling)  # one table for every layer
        options = self.attention_options(config)
        qk_norm_eps = config.rms_norm_eps if options.qk_norm else None
        layers = []
        for i in range(config.num_layers):
            attn = AttentionLayer(i, config.hidden_size, config.num_qo_heads, config.num_kv_heads,
                                  config.head_dim, rope, qk_norm_eps=qk_norm_eps,
                                  qkv_bias=options.qkv_bias, o_bias=options.o_bias)
            layers.append(DecoderLayer(config, attn, self.make_mlp(config, i)))
        self.model = DecoderModel(config, layers)
        tie_to = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tie_to=tie_to)

    def check_config(self, config: ModelConfig) -> None:
        """Refuse config settings this family's code does not implement (none by default)."""

    def attention_options(self, config: ModelConfig) -> AttentionOptions:
        """Which optional parts this family's attention has; by default, as in transformers'
        Llama and Qwen3, a bias on all four projections exactly when ``attention_bias`` is set."""
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        """The feed-forward block of layer ``layer_id``: a dense gated MLP unless overridden."""
        return GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.model(input_ids, positions)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return self.lm_head(hidden, out=out)


def refuse_true(config: ModelConfig, key: str, family: str) -> None:
    """Raise if config.json sets ``key`` to true: a feature ``family`` here does not implement."""
    if config.raw.get(key):
        raise ValueError(f"{family}: config.json sets {key}=true, which this engine does not "
                         f"implement; only {key}=false (or absent) is supported")
