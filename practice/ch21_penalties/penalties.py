"""The logit adjustments of OpenAI's sampling API, on plain lists (your code goes in
adjust_batch)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    """One row's request: its prompt, the tokens it has generated so far, and what it asks."""

    prompt: Sequence[int]
    output: Sequence[int] = ()
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0


def adjust_batch(logits: list[list[float]], reqs: Sequence[Request],
                 stop_ids: Collection[int]) -> list[list[float]]:
    """Each row of ``logits`` adjusted as its request asks: logit_bias, min_tokens, then the
    repetition, frequency and presence penalties. See README.md for the rules."""
    raise NotImplementedError("apply the four steps to every row, in order")
