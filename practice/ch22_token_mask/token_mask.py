"""The tokens an automaton allows next, and the mask as the sampler takes it (your code goes
in live_states, token_mask, pack and apply_mask; Automaton and walk are given)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Automaton:
    """A deterministic automaton over characters.

    ``edges[(state, char)]`` is the state after reading ``char`` in ``state``; a pair that is
    not there is a dead end: no text that continues that way belongs to the language. The text
    read so far belongs to the language when its state is in ``accepting``.
    """

    start: int
    accepting: frozenset[int]
    edges: dict[tuple[int, str], int] = field(default_factory=dict)

    def states(self) -> set[int]:
        """Every state the automaton names."""
        names = {self.start, *self.accepting}
        for (state, _), target in self.edges.items():
            names.update((state, target))
        return names


def walk(automaton: Automaton, state: int, text: str) -> int | None:
    """The state after reading ``text`` from ``state``; None at a dead end (given)."""
    for char in text:
        nxt = automaton.edges.get((state, char))
        if nxt is None:
            return None
        state = nxt
    return state


def live_states(automaton: Automaton) -> set[int]:
    """The states from which some text (possibly empty) reaches an accepting state."""
    raise NotImplementedError("walk the edges backwards from the accepting states")


def token_mask(automaton: Automaton, state: int, vocab: Sequence[str],
               eos_id: int) -> list[bool]:
    """For each token of ``vocab``, whether it may come next in ``state``. See README.md."""
    raise NotImplementedError("a token is allowed when its walk ends in a live state")


def pack(mask: Sequence[bool]) -> list[int]:
    """The mask as 32-bit words: token ``t`` is bit ``t % 32`` of word ``t // 32``."""
    raise NotImplementedError


def apply_mask(logits: Sequence[float], words: Sequence[int]) -> list[float]:
    """``logits`` with every token the packed mask forbids set to ``-inf``."""
    raise NotImplementedError
