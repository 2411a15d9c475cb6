"""The logit adjustments of OpenAI's sampling API, on plain lists (reference solution)."""

from __future__ import annotations

from collections import Counter
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
    if len(logits) != len(reqs):
        raise ValueError(f"{len(logits)} rows of logits for {len(reqs)} requests")
    if len({len(row) for row in logits}) > 1:
        raise ValueError("the rows of logits differ in length")
    return [_adjusted(list(row), req, stop_ids) for row, req in zip(logits, reqs)]


def _adjusted(row: list[float], req: Request, stop_ids: Collection[int]) -> list[float]:
    vocab = len(row)
    for token, bias in req.logit_bias.items():
        if token < vocab:
            row[token] += bias
    if len(req.output) < req.min_tokens:
        for token in stop_ids:
            if token < vocab:
                row[token] = float("-inf")
    if req.repetition_penalty != 1.0:
        r = req.repetition_penalty
        for token in {t for t in (*req.prompt, *req.output) if t < vocab}:
            row[token] = row[token] / r if row[token] > 0 else row[token] * r
    for token, count in Counter(t for t in req.output if t < vocab).items():
        row[token] -= req.frequency_penalty * count + req.presence_penalty
    return row
