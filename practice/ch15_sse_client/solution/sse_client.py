"""The client's side of a streamed chat completion: Server-Sent Events back into an answer.

Write :func:`parse_chat_stream`. See README.md for the rules;
`python practice/judge.py ch15_sse_client` checks your work.
"""

from __future__ import annotations

import json
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
    result = ChatStream()
    buffer = b""
    data_lines: list[str] = []
    done = False
    for read in reads:
        buffer += read
        # Split on the byte \n only: UTF-8 never uses it inside a character, so a character
        # cut by a read is decoded only once its line is whole.
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8").removesuffix("\r")
            if line == "":  # a blank line ends the event
                if data_lines:
                    if done:
                        raise ValueError(f"an event after data: [DONE]: {data_lines!r}")
                    result.events += 1
                    done = _apply("\n".join(data_lines), result)
                    data_lines = []
            elif line.startswith(":"):
                continue  # a comment (a keep-alive)
            else:
                name, _, value = line.partition(":")
                if name == "data":
                    data_lines.append(value.removeprefix(" "))
    if not done:
        raise ValueError(f"the stream ended without data: [DONE] after {result.events} "
                         f"event(s): it was cut off (unread: {buffer!r}, {data_lines!r})")
    return result


def _apply(data: str, result: ChatStream) -> bool:
    """Fold one event's data into ``result``; True for ``[DONE]``."""
    if data == "[DONE]":
        return True
    chunk: dict[str, Any] = json.loads(data)
    if chunk.get("usage"):
        result.usage = chunk["usage"]
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if "role" in delta:
            result.role = delta["role"]
        if delta.get("content"):
            result.pieces.append(delta["content"])
        if choice.get("finish_reason") is not None:
            result.finish_reason = choice["finish_reason"]
    return False
