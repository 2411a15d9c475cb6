"""Top-k and top-p (nucleus) filtering for a batch of next-token distributions (solution)."""

from __future__ import annotations

import torch


def top_k_filter(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``k`` most likely tokens and renormalise (``k = -1`` keeps all)."""
    vocab_size = probs.shape[-1]
    k = torch.where(top_k < 0, vocab_size, top_k)
    # stable: equal probabilities keep their token-id order, so ties go to the lower id.
    order = probs.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=probs.device)
    keep_sorted = ranks[None, :] < k[:, None]
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return _renormalise(probs.masked_fill(~keep, 0.0))


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus (smallest top set with mass >= top_p) and renormalise."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    # A token is needed while the mass ranked strictly before it is still short of top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return _renormalise(probs.masked_fill(~keep, 0.0))


def top_k_top_p_filter(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k first, then top-p on the renormalised result (the engine's order)."""
    return top_p_filter(top_k_filter(probs, top_k), top_p)


def _renormalise(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)
