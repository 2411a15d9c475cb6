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
    q_x = 1.0 if q is None else q[x]
    if q_x <= 0:
        raise ValueError(f"the draft gives token {x} no probability, so it cannot propose it")
    return min(1.0, p[x] / q_x)


def residual(p: Dist, q: Dist | None, x: int) -> list[float]:
    """``norm(max(0, p - q))``, what a rejected guess ``x`` is replaced from; ``q`` None is
    one-hot at ``x``; ``p`` itself when the residual has no mass."""
    q_full = [1.0 if i == x else 0.0 for i in range(len(p))] if q is None else q
    left = [max(0.0, a - b) for a, b in zip(p, q_full)]
    total = sum(left)
    if total <= 0:
        return list(p)
    return [w / total for w in left]


def verify(drafts: Sequence[int], qs: Sequence[Dist] | None, ps: Sequence[Dist],
           uniforms: Sequence[float], u_last: float) -> list[int]:
    """The tokens one target pass emits for the guesses ``drafts``. See README.md."""
    if len(ps) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} guesses need {len(drafts) + 1} target distributions, "
                         f"got {len(ps)}")
    if len(uniforms) != len(drafts) or (qs is not None and len(qs) != len(drafts)):
        raise ValueError("one uniform number and one draft distribution per guess")
    emitted: list[int] = []
    for j, x in enumerate(drafts):
        q = None if qs is None else qs[j]
        if uniforms[j] < acceptance_probability(ps[j], q, x):
            emitted.append(x)
        else:
            return emitted + [draw(residual(ps[j], q, x), u_last)]
    return emitted + [draw(ps[len(drafts)], u_last)]
