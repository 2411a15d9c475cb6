"""The incremental detokenizer: tokens to text a piece at a time, and stop strings."""

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
        self.token_ids.append(token_id)
        new = self._new_text()
        if new and not new.endswith(REPLACEMENT_CHAR):
            piece = new[self.sent:]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self.sent = 0
            return piece
        # Only the last character may still change (more bytes can finish it); what comes
        # before it is final, a broken character included, and goes out now.
        ready = new.removesuffix(REPLACEMENT_CHAR)
        piece = ready[self.sent:]
        self.sent = max(self.sent, len(ready))
        return piece

    def flush(self) -> str:
        """The text not returned yet, broken last character and all: the stream has ended."""
        piece = self._new_text()[self.sent:]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.sent = 0
        return piece

    def _new_text(self) -> str:
        """The text of the tokens after ``read_offset``, decoded in the window's context."""
        prefix_text = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        return self.decode(self.token_ids[self.prefix_offset:])[len(prefix_text):]


@dataclass
class StopMatcher:
    """Cuts a stream of text at the first of its stop strings."""

    stop: tuple[str, ...]
    held: str = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add ``text``; return what may be sent, and the stop string reached (None if none)."""
        text = self.held + text
        reached = None  # (where it ends, longer first), where it starts, the stop string
        for s in self.stop:
            start = text.find(s)
            if start >= 0:
                key = (start + len(s), -len(s))
                if reached is None or key < reached[0]:
                    reached = (key, start, s)
        if reached is not None:
            # The one that ends first is the one a stream of any cut would see first.
            _, start, s = reached
            self.held = ""
            return text[:start], s
        keep = self._partial_match(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """The text held back: the stream has ended without reaching a stop string."""
        held, self.held = self.held, ""
        return held

    def _partial_match(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
