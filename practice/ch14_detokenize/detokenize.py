"""The incremental detokenizer: tokens to text a piece at a time, and stop strings.

Your code goes in DecodeStream.push / flush and StopMatcher.feed / flush (see README.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Decode = Callable[[Sequence[int]], str]
REPLACEMENT_CHAR = "\ufffd"  # what a decoder puts in place of an incomplete character


@dataclass
class DecodeStream:
    """The text of a stream of tokens, a piece at a time, never a broken character."""

    decode: Decode
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # the decode window starts here (context for the new tokens)
    read_offset: int = 0  # the tokens whose text has been returned

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is unfinished)."""
        raise NotImplementedError("decode the window with and without the new token (README)")

    def flush(self) -> str:
        """The text not returned yet, broken last character and all: the stream has ended."""
        raise NotImplementedError("return what push held back (README rule 5)")


@dataclass
class StopMatcher:
    """Cuts a stream of text at the first of its stop strings."""

    stop: tuple[str, ...]
    held: str = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return what may be sent, and whether a stop string was reached."""
        raise NotImplementedError("find a stop string, or hold back a possible start (README)")

    def flush(self) -> str:
        """The text held back: the stream has ended without reaching a stop string."""
        raise NotImplementedError("return and forget the held text (README rule 9)")
