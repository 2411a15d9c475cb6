"""The client's side of a streamed chat completion: Server-Sent Events back into an answer.

Write :func:`parse_chat_stream`. See README.md for the rules;
`python practice/judge.py ch15_sse_client` checks your work.
"""

from __future__ import annotations

import json  # noqa: F401  (you will need it)
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChatStream:
    """What a streamed chat completion said (given)."""

    role: str | None = None
    pieces: list[str] = field(default_factory=list)  # every non-empty delta.content, in order
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    events: int = 0  # data events read, [DONE] included

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def parse_chat_stream(reads: Iterable[bytes]) -> ChatStream:
    """Read a chat completion's SSE body, arriving as ``reads`` (any byte boundaries)."""
    raise NotImplementedError("parse_chat_stream: split the bytes into lines and the lines "
                              "into events; fold each event's JSON into a ChatStream; stop "
                              "at data: [DONE]")
