"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, experts in place of the MLP.

Which layers are sparse is read from config.json: layer ``i`` has experts when it is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; the others keep a dense MLP of
``intermediate_size``. (The released models make every layer sparse; the keys exist so that
dense and sparse layers can be mixed.) Each expert is a gated MLP of ``moe_intermediate_size``.

The checkpoint stores experts one by one; :meth:`Qwen3MoeForCausalLM.checkpoint_to_param`
sends ``mlp.experts.5.up_proj.weight`` to slot ``(5, 1)`` of the stacked ``gate_up_proj``.
"""

from __future__ import annotations

import re
from collections.abc import Hashable

from torch import nn

from minisgl.models.config import ConfigError, ModelConfig
from minisgl.models.qwen3 import Qwen3ForCausalLM
from minisgl.moe import SparseMoeBlock
from minisgl.utils.checks import check_int, is_int

# checkpoint projection -> (our stacked parameter, slot within an expert; None for down)
_EXPERT_SLOTS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}
# One expert's projection in a checkpoint: (...mlp.experts).(5).(up_proj).weight
_EXPERT_TENSOR = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def sparse_layer_ids(config: ModelConfig) -> list[int]:
    """The layers whose feed-forward block is a mixture of experts."""
    step = config.raw.get("decoder_sparse_step", 1)
    only_mlp = config.raw.get("mlp_only_layers") or []
    step = check_int("decoder_sparse_step", step, at_least=1, error=ConfigError)
    if not isinstance(only_mlp, list) or not all(is_int(i) for i in only_mlp):
        raise ConfigError(f"mlp_only_layers must be a list of layer indices, got {only_mlp!r}")
    return [i for i in range(config.num_layers)
            if config.is_moe and i not in only_mlp and (i + 1) % step == 0]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def check_config(self, config: ModelConfig) -> None:
        if not config.is_moe or config.moe_intermediate_size <= 0:
            raise ConfigError("Qwen3MoeForCausalLM needs num_experts, num_experts_per_tok and "
                              "moe_intermediate_size in config.json, all positive")
        sparse_layer_ids(config)  # validates decoder_sparse_step and mlp_only_layers

    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        if layer_id not in sparse_layer_ids(config):
            return super().make_mlp(config, layer_id)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, renormalize=config.norm_topk_prob)

    def checkpoint_to_param(self, name: str) -> tuple[str, Hashable]:
        """``...mlp.experts.5.up_proj.weight`` -> (``...mlp.experts.gate_up_proj``, (5, 1))."""
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            return super().checkpoint_to_param(name)
        experts, expert, (param, slot) = match[1], int(match[2]), _EXPERT_SLOTS[match[3]]
        return f"{experts}.{param}", expert if slot is None else (expert, slot)

    def param_to_checkpoint(self, param_name: str, shard_id: Hashable) -> str:
        module, _, leaf = param_name.rpartition(".")
        if module.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            expert, slot = shard_id if isinstance(shard_id, tuple) else (shard_id, None)
            proj = next(p for p, target in _EXPERT_SLOTS.items() if target == (leaf, slot))
            return f"{module}.{expert}.{proj}.weight"
        return super().param_to_checkpoint(param_name, shard_id)
