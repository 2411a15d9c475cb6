"""Seeded sampling where every request owns its random stream.

Write `gumbel_race` and the four methods of `RequestSampler`. See README.md for the rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def gumbel_race(logits: torch.Tensor, temperatures: Sequence[float],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``logits``.

    Args:
        logits: ``[B, V]`` float32; a filtered token is ``-inf`` (each row keeps one finite).
        temperatures: one per row; ``0`` means greedy.
        generators: one per row: the stream that row draws its noise from (``None`` is allowed
            only on a greedy row).

    Returns:
        ``[B]`` int64 token ids. A greedy row takes the first argmax and draws nothing; any other
        row draws ``V`` exponential values from its generator, in one call, and takes
        ``argmax(logits / T - log E)``.

    Raises:
        ValueError: a sampled row without a generator (naming the row), or lengths that do
            not match the rows of ``logits``.
    """
    raise NotImplementedError("gumbel_race: argmax for greedy rows, the race for the others")


class RequestSampler:
    """Samples the rows of a changing batch, each live request from its own random stream."""

    def __init__(self, shared_seed: int = 0) -> None:
        """``shared_seed`` seeds the one stream that every unseeded request draws from."""
        raise NotImplementedError("RequestSampler: a shared generator and the live requests")

    def add(self, uid: int, temperature: float, seed: int | None = None) -> None:
        """A request becomes live; with a seed it gets its own generator, made here, once.

        Raises:
            ValueError: ``uid`` already live, or a negative temperature.
        """
        raise NotImplementedError("add: remember the temperature, make the generator")

    def remove(self, uid: int) -> None:
        """The request is finished; its generator is forgotten. KeyError if it is not live."""
        raise NotImplementedError("remove")

    def step(self, uids: Sequence[int], logits: torch.Tensor) -> list[int]:
        """One token for each request of this step's batch; row ``i`` of ``logits`` is ``uids[i]``.

        Raises:
            KeyError: a uid that is not live. ValueError: a uid twice, or a row count that does
                not match ``uids``.
        """
        raise NotImplementedError("step: each row's temperature and generator, then the race")
