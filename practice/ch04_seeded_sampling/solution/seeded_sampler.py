"""Seeded sampling where every request owns its random stream (reference solution)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def gumbel_race(logits: torch.Tensor, temperatures: Sequence[float],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``logits``: the argmax at temperature 0, else a draw from
    ``softmax(logits / T)`` whose noise comes from that row's own generator."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if len(temperatures) != rows or len(generators) != rows:
        raise ValueError(f"{rows} rows of logits need {rows} temperatures and generators, "
                         f"got {len(temperatures)} and {len(generators)}")
    tokens = logits.argmax(dim=-1)
    tiny = torch.finfo(torch.float32).tiny
    for row, (temperature, generator) in enumerate(zip(temperatures, generators)):
        if temperature == 0:
            continue  # greedy: the argmax above, and no draw from any stream
        if generator is None:
            raise ValueError(f"row {row} samples at temperature {temperature} but has no generator")
        noise = torch.empty(vocab, dtype=torch.float32).exponential_(generator=generator)
        # log(p / E) = logits / T - log Z - log E: the race's winner, without a softmax;
        # clamping keeps -log E finite so a -inf logit stays -inf and never wins
        scores = logits[row].float() / temperature - noise.clamp_(min=tiny).log()
        tokens[row] = scores.argmax()
    return tokens


class RequestSampler:
    """Samples the rows of a changing batch, each live request from its own random stream."""

    def __init__(self, shared_seed: int = 0) -> None:
        self._shared = torch.Generator().manual_seed(shared_seed)
        self._temperatures: dict[int, float] = {}
        self._generators: dict[int, torch.Generator | None] = {}

    def add(self, uid: int, temperature: float, seed: int | None = None) -> None:
        if uid in self._temperatures:
            raise ValueError(f"request {uid} is already live")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
        self._temperatures[uid] = temperature
        self._generators[uid] = None if seed is None else torch.Generator().manual_seed(seed)

    def remove(self, uid: int) -> None:
        if uid not in self._temperatures:
            raise KeyError(f"request {uid} is not live")
        del self._temperatures[uid], self._generators[uid]

    def step(self, uids: Sequence[int], logits: torch.Tensor) -> list[int]:
        if len(set(uids)) != len(uids):
            raise ValueError(f"a request appears twice in the batch {list(uids)}")
        unknown = [uid for uid in uids if uid not in self._temperatures]
        if unknown:
            raise KeyError(f"requests {unknown} are not live")
        if logits.shape[0] != len(uids):
            raise ValueError(f"{len(uids)} requests need {len(uids)} rows of logits, "
                             f"got {logits.shape[0]}")
        generators = [self._generators[uid] or self._shared for uid in uids]
        temperatures = [self._temperatures[uid] for uid in uids]
        return gumbel_race(logits, temperatures, generators).tolist()
