"""The router of a mixture-of-experts layer: which experts each token visits, and how much each counts.

A router is a ``hidden x num_experts`` linear layer; its scores go through a softmax over all
experts, and each token keeps its ``top_k`` most probable experts. Qwen3-MoE then rescales the
kept probabilities to sum to one (``norm_topk_prob``), so a token's output is a weighted
average of its experts' outputs rather than a fraction of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Each token's chosen experts, best first, and their weights.

    ``expert_ids`` is [T, top_k] (int64) and ``weights`` [T, top_k] (float32).
    """

    expert_ids: torch.Tensor
    weights: torch.Tensor


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over the experts, keep the ``top_k`` most probable, optionally rescaled to sum 1.

    The softmax runs in float32 whatever the logits' dtype: in bfloat16 two close experts
    would round to the same probability and the choice between them would depend on rounding.
    Ties go to the lower expert index (a stable sort keeps equal values in index order), so
    routing is the same on every device. ``top_k`` is between 1 and the number of experts:
    ``ModelConfig`` checks ``num_experts_per_tok``, where it enters.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    weights, expert_ids = sorted_probs[:, :top_k], order[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(expert_ids=expert_ids, weights=weights)
