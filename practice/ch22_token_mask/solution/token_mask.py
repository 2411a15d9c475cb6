"""The tokens an automaton allows next, and the mask as the sampler takes it (the reference
solution)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

WORD_BITS = 32


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
    sources: dict[int, set[int]] = {}
    for (state, _), target in automaton.edges.items():
        sources.setdefault(target, set()).add(state)
    live = set(automaton.accepting)
    frontier = list(live)
    while frontier:  # a state that steps into a live state is live
        for state in sources.get(frontier.pop(), ()):
            if state not in live:
                live.add(state)
                frontier.append(state)
    return live


def token_mask(automaton: Automaton, state: int, vocab: Sequence[str],
               eos_id: int) -> list[bool]:
    """For each token of ``vocab``, whether it may come next in ``state``. See README.md."""
    if not 0 <= eos_id < len(vocab):
        raise ValueError(f"eos_id {eos_id} is not a token of a {len(vocab)}-token vocabulary")
    live = live_states(automaton)
    if state not in live:
        raise ValueError(f"state {state} cannot reach an accepting state: nothing may follow")
    mask = []
    for token_id, text in enumerate(vocab):
        if token_id == eos_id:
            mask.append(state in automaton.accepting)
        else:
            after = walk(automaton, state, text) if text else None
            mask.append(after is not None and after in live)
    return mask


def pack(mask: Sequence[bool]) -> list[int]:
    """The mask as 32-bit words: token ``t`` is bit ``t % 32`` of word ``t // 32``."""
    words = [0] * -(-len(mask) // WORD_BITS)
    for token_id, allowed in enumerate(mask):
        if allowed:
            words[token_id // WORD_BITS] |= 1 << (token_id % WORD_BITS)
    return words


def apply_mask(logits: Sequence[float], words: Sequence[int]) -> list[float]:
    """``logits`` with every token the packed mask forbids set to ``-inf``."""
    if len(words) != -(-len(logits) // WORD_BITS):
        raise ValueError(f"{len(logits)} logits need {-(-len(logits) // WORD_BITS)} words, "
                         f"got {len(words)}")
    out = [value if words[t // WORD_BITS] >> (t % WORD_BITS) & 1 else float("-inf")
           for t, value in enumerate(logits)]
    if all(value == float("-inf") for value in out):
        raise ValueError("the mask allows no token: sampling from it has no answer")
    return out
