"""Routing tokens to experts, and grouping them by expert.

Write `route` and `group_by_expert`. See README.md for the rules and an example.
"""

from __future__ import annotations

Route = list[tuple[int, float]]  # one token's (expert, weight) pairs, best first


def route(logits: list[list[float]], top_k: int, renormalize: bool,
          bias: list[float] | None = None) -> list[Route]:
    """Each token's ``top_k`` experts, chosen with ``bias``, weighted without it.

    Args:
        logits: one row of router scores per token, all rows ``num_experts`` long.
        top_k: how many experts each token keeps, ``1 <= top_k <= num_experts``.
        renormalize: rescale the kept weights of each token to sum to 1.
        bias: one number per expert, added to the probabilities to choose the experts only;
            None for no bias.

    Returns:
        One list per token of ``(expert, weight)``, best biased value first; equal values rank
        the lower expert index first. The weights are the unbiased probabilities.

    Raises:
        ValueError: no rows, rows of different lengths, ``top_k`` out of range, or a bias of
            the wrong length.
    """
    raise NotImplementedError(
        "route: choose by probability plus bias, weigh by probability alone (README.md)")


def group_by_expert(routes: list[Route], num_experts: int) -> list[list[tuple[int, float]]]:
    """For every expert, the ``(token, weight)`` pairs routed to it, in token order.

    Raises:
        ValueError: an expert index outside ``[0, num_experts)``.
    """
    raise NotImplementedError("group_by_expert: one list per expert, tokens in order")
