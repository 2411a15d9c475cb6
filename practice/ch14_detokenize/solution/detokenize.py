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
    read_offset: int = 0  # the tokens whose text has been returned

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is unfinished)."""
        self.token_ids.append(token_id)
        prefix_text = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self.decode(self.token_ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The text not returned yet, broken last character and all: the stream has ended."""
        prefix_text = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self.decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]


@dataclass
class StopMatcher:
    """Cuts a stream of text at the first of its stop strings."""

    stop: tuple[str, ...]
    held: str = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return what may be sent, and whether a stop string was reached."""
        text = self.held + text
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.held = ""
            return text[:min(found)], True
        keep = self._partial_match(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False

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
