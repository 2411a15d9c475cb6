"""The idea of constrained decoding, small enough to read: an automaton and a token mask.

A grammar is, at each moment, in some *state*; a character either moves it to another state or
is refused. A token is several characters, so a token may come next exactly when walking all of
its characters from the current state never fails. Doing that for every token of the vocabulary
gives the *mask*: the tokens whose logits keep their value (the others become ``-inf``). The end
of sequence is allowed only in an accepting state, so the output is always a whole sentence of
the language. This module does it for a deterministic automaton (DFA) in plain Python; the
library that replaces it (:mod:`~minisgl.grammar.states`) does the same for JSON Schema and
context-free grammars, fast enough for a 150k vocabulary at every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

CharClass = Callable[[str], bool]


@dataclass(frozen=True)
class DFA:
    """A deterministic automaton over characters.

    Attributes:
        start: the state before any character.
        edges: for each state, ``(test, next_state)`` pairs tried in order: the first test the
            character passes says where it goes; none passing means the character is refused.
        accepting: the states where the text read so far is a whole sentence.
    """

    start: int
    edges: dict[int, list[tuple[CharClass, int]]]
    accepting: frozenset[int] = field(default_factory=frozenset)

    def step(self, state: int | None, char: str) -> int | None:
        """The state after ``char``; None when ``char`` is refused (or ``state`` already was)."""
        if state is None:
            return None
        return next((target for test, target in self.edges.get(state, []) if test(char)), None)

    def walk(self, state: int | None, text: str) -> int | None:
        """The state after every character of ``text``; None as soon as one is refused."""
        for char in text:
            state = self.step(state, char)
        return state


def allowed_tokens(dfa: DFA, state: int, vocab: Sequence[str],
                   eos_ids: Sequence[int] = ()) -> list[bool]:
    """The mask: for each token of ``vocab`` (its text), whether it may come next from ``state``.

    An end-of-sequence token (``eos_ids``) is allowed exactly when ``state`` accepts; an empty
    token (a special token with no text) would change nothing and is refused.
    """
    mask = [bool(text) and dfa.walk(state, text) is not None for text in vocab]
    for eos in eos_ids:
        mask[eos] = state in dfa.accepting
    return mask


def is_digit(char: str) -> bool:
    return "0" <= char <= "9"


def literal(text: str, start: int) -> dict[int, list[tuple[CharClass, int]]]:
    """Edges that read ``text`` exactly, from state ``start`` to ``start + len(text)``."""
    return {start + i: [(lambda c, want=char: c == want, start + i + 1)]
            for i, char in enumerate(text)}


def integer_field_dfa(key: str) -> DFA:
    """The automaton of ``{"KEY": N}`` with N a non-negative integer without leading zeros:
    the smallest JSON a schema ``{"KEY": {"type": "integer", "minimum": 0}}`` allows."""
    head = '{"' + key + '": '
    edges = literal(head, 0)
    first = len(head)  # the first digit
    zero, digits, done = first + 1, first + 2, first + 3
    edges[first] = [(lambda c: c == "0", zero), (is_digit, digits)]
    edges[zero] = [(lambda c: c == "}", done)]  # "0" and nothing after it but the brace
    edges[digits] = [(is_digit, digits), (lambda c: c == "}", done)]
    return DFA(start=0, edges=edges, accepting=frozenset({done}))
