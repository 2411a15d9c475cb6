"""The incremental detokenizer: tokens to text a piece at a time, and stop strings.

Your code goes in DecodeStream.push / flush and StopMatcher.feed / flush (see README.md).
You may add helper methods.
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
    read_offset: int = 0  # the tokens whose text has been returned in full
    sent: int = 0  # characters of the later tokens' text returned already

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes: every finished character at once, only
        an unfinished last one held back."""
        raise NotImplementedError("push: see README.md, rules 1 to 4")

    def flush(self) -> str:
        """The text not returned yet, broken last character and all: the stream has ended."""
        raise NotImplementedError("flush: see README.md, rule 5")


@dataclass
class StopMatcher:
    """Cuts a stream of text at the first of its stop strings."""

    stop: tuple[str, ...]
    held: str = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add ``text``; return what may be sent, and the stop string reached (None if none)."""
        raise NotImplementedError("feed: see README.md, rules 6 to 9")

    def flush(self) -> str:
        """The text held back: the stream has ended without reaching a stop string."""
        raise NotImplementedError("flush: see README.md, rule 10")
