"""Top-k and top-p (nucleus) filtering for a batch of next-token distributions.

Write `top_k_filter` and `top_p_filter`; `top_k_top_p_filter` chains them in the order the
engine uses. See README.md for the rules and hints.
"""

from __future__ import annotations

import torch


def top_k_filter(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``k`` most likely tokens and renormalise.

    Args:
        probs: ``[B, V]`` float32 probabilities, each row summing to 1.
        top_k: ``[B]`` int64: the ``k`` of each row, or ``-1`` to keep the whole row.

    Returns:
        ``[B, V]`` probabilities: tokens outside the row's ``k`` best set to exactly 0, the rest
        rescaled so the row sums to 1. Among equal probabilities the lower token id ranks first.
        ``probs`` is not modified.
    """
    raise NotImplementedError("top_k_filter: keep each row's k largest probabilities")


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus and renormalise.

    The nucleus is the smallest set of most likely tokens whose total probability is at least
    ``top_p``; it always contains the most likely token.

    Args:
        probs: ``[B, V]`` float32 probabilities, each row summing to 1.
        top_p: ``[B]`` float32 in ``(0, 1]``; ``1.0`` keeps the whole row.

    Returns:
        ``[B, V]`` probabilities: tokens outside the nucleus set to exactly 0, the rest rescaled
        so the row sums to 1. ``probs`` is not modified.
    """
    raise NotImplementedError("top_p_filter: keep the smallest prefix whose mass reaches top_p")


def top_k_top_p_filter(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k first, then top-p on the renormalised result (the engine's order)."""
    return top_p_filter(top_k_filter(probs, top_k), top_p)
