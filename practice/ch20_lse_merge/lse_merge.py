"""Attention over one query head's keys in pieces, merged exactly with the log-sum-exp (your
code goes in merge; attend is given)."""

from __future__ import annotations

import math
from collections.abc import Sequence

Partial = tuple[list[float], float]  # one piece's (out, lse) for one query head


def attend(q: Sequence[float], keys: Sequence[Sequence[float]],
           values: Sequence[Sequence[float]], scale: float) -> Partial:
    """Attention of the query ``q`` over one piece of keys and values (given).

    The scores are ``scale * dot(q, key)``. Returns ``(out, lse)``: ``out`` is the average of the
    values weighted by the softmax of the scores, ``lse`` the natural log of the sum of the
    exponentials of the scores. A piece with no keys returns zeros (``len(q)`` of them) and
    ``-inf``: the log of an empty sum.
    """
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    if not keys:
        return [0.0] * len(q), -math.inf
    scores = [scale * sum(a * b for a, b in zip(q, key)) for key in keys]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]  # the largest is exp(0) = 1: no overflow
    total = sum(weights)
    out = [sum(w * value[j] for w, value in zip(weights, values)) / total
           for j in range(len(values[0]))]
    return out, top + math.log(total)


def merge(pieces: Sequence[Partial]) -> Partial:
    """The ``(out, lse)`` of attention over all the pieces' keys at once, from each piece's
    ``(out, lse)``. See README.md for the rules."""
    raise NotImplementedError("weight each piece's out by exp(its lse - the merged lse)")
