"""Speculative sampling's acceptance rule over plain lists (your code goes in
acceptance_probability, residual and verify; draw is given)."""

from __future__ import annotations

from collections.abc import Sequence

Dist = Sequence[float]  # a distribution over the vocabulary: one probability per token id


def draw(weights: Dist, u: float) -> int:
    """The token that the uniform number ``u`` in [0, 1) picks from ``weights`` (given).

    Inverse CDF: the first token whose cumulative weight exceeds ``u * sum(weights)``. The
    weights need not sum to 1; a token of weight 0 is never picked.
    """
    total = sum(weights)
    if total <= 0:
        raise ValueError("the weights have no mass")
    target, cumulative = u * total, 0.0
    last = max(i for i, w in enumerate(weights) if w > 0)
    for i, w in enumerate(weights):
        cumulative += w
        if w > 0 and target < cumulative:
            return i
    return last  # u * total rounded up to the full sum: the last token with weight


def acceptance_probability(p: Dist, q: Dist | None, x: int) -> float:
    """The chance of keeping the guess ``x``: ``min(1, p[x] / q[x])``; ``q`` None is a
    deterministic proposer (``q[x] = 1``)."""
    raise NotImplementedError("keep x with probability min(1, p(x) / q(x))")


def residual(p: Dist, q: Dist | None, x: int) -> list[float]:
    """``norm(max(0, p - q))``, what a rejected guess ``x`` is replaced from; ``q`` None is
    one-hot at ``x``; ``p`` itself when the residual has no mass."""
    raise NotImplementedError("what p has more of than q, renormalised")


def verify(drafts: Sequence[int], qs: Sequence[Dist] | None, ps: Sequence[Dist],
           uniforms: Sequence[float], u_last: float) -> list[int]:
    """The tokens one target pass emits for the guesses ``drafts``. See README.md."""
    raise NotImplementedError("walk the guesses; stop at the first rejection")
