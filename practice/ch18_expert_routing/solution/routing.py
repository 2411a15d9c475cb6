"""Routing tokens to experts, and grouping them by expert (reference solution)."""

from __future__ import annotations

import math

Route = list[tuple[int, float]]  # one token's (expert, weight) pairs, best first


def _softmax(row: list[float]) -> list[float]:
    top = max(row)  # subtracting the maximum keeps exp() from overflowing
    exps = [math.exp(x - top) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def route(logits: list[list[float]], top_k: int, renormalize: bool,
          bias: list[float] | None = None) -> list[Route]:
    if not logits:
        raise ValueError("logits has no rows: nothing to route")
    num_experts = len(logits[0])
    if any(len(row) != num_experts for row in logits):
        raise ValueError(f"every row needs {num_experts} scores (one per expert)")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    bias = [0.0] * num_experts if bias is None else list(bias)
    if len(bias) != num_experts:
        raise ValueError(f"bias has {len(bias)} entries; there are {num_experts} experts")
    routes = []
    for row in logits:
        probs = _softmax(row)
        # The bias decides which experts; the unbiased probabilities decide how much.
        best = sorted(range(num_experts), key=lambda e: (-(probs[e] + bias[e]), e))[:top_k]
        kept = [probs[e] for e in best]
        scale = sum(kept) if renormalize else 1.0
        routes.append([(e, p / scale) for e, p in zip(best, kept)])
    return routes


def group_by_expert(routes: list[Route], num_experts: int) -> list[list[tuple[int, float]]]:
    groups: list[list[tuple[int, float]]] = [[] for _ in range(num_experts)]
    for token, pairs in enumerate(routes):
        for expert, weight in pairs:
            if not 0 <= expert < num_experts:
                raise ValueError(f"token {token} names expert {expert}; experts are "
                                 f"0..{num_experts - 1}")
            groups[expert].append((token, weight))
    return groups
