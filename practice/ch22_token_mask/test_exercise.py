"""Tests for the token-mask exercise: they are its specification.

The README's example first, then each rule of ``live_states`` and ``token_mask`` (traps, the
end of sequence, empty tokens, bad input), then the packed words and the masked logits, then
random automata against a brute-force search, and last what constrained decoding relies on:
text sampled under the mask, whatever the logits, is always in the language when it ends.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from token_mask import Automaton, apply_mask, live_states, pack, token_mask, walk

INF = math.inf
DIGITS = "0123456789"


def integers() -> Automaton:
    """The README's automaton: ``-?(0|[1-9][0-9]*)``, and a '+' into the dead state 4."""
    edges = {(0, "-"): 1, (0, "+"): 4}
    for s in (0, 1):
        edges[(s, "0")] = 2
        edges.update({(s, d): 3 for d in DIGITS[1:]})
    edges.update({(3, d): 3 for d in DIGITS})
    return Automaton(start=0, accepting=frozenset({2, 3}), edges=edges)


VOCAB = ["<eos>", "-", "0", "7", "12", "-5", "05", "+", "a", "", "90"]
EXPECTED_FROM_START = [False, True, True, True, True, True, False, False, False, False, True]


# ------------------------------------------------------------------------- the example
def test_the_readme_example() -> None:
    assert live_states(integers()) == {0, 1, 2, 3}
    assert token_mask(integers(), 0, VOCAB, eos_id=0) == EXPECTED_FROM_START
    assert pack(EXPECTED_FROM_START) == [1086]


def test_after_twelve_the_end_is_allowed_and_a_minus_is_not() -> None:
    state = walk(integers(), 0, "12")
    mask = token_mask(integers(), state, VOCAB, eos_id=0)
    assert mask == [True, False, True, True, True, False, True, False, False, False, True]


def test_after_a_zero_only_the_end_may_follow() -> None:
    mask = token_mask(integers(), walk(integers(), 0, "0"), VOCAB, eos_id=0)
    assert mask == [True] + [False] * (len(VOCAB) - 1)


# ------------------------------------------------------------------------------ the rules
def test_a_state_that_only_reaches_a_trap_is_dead() -> None:
    a = Automaton(0, frozenset({3}), {(0, "a"): 1, (1, "b"): 2, (2, "c"): 2, (0, "x"): 3})
    assert live_states(a) == {0, 3}
    assert token_mask(a, 0, ["$", "a", "ab", "x", "xa"], eos_id=0) == [
        False, False, False, True, False]


def test_liveness_follows_long_chains_backwards() -> None:
    n = 60
    a = Automaton(0, frozenset({n}), {(i, "s"): i + 1 for i in range(n)})
    assert live_states(a) == set(range(n + 1))
    vocab = ["$", "s" * n, "s" * (n + 1), "s"]
    assert token_mask(a, 0, vocab, 0) == [False, True, False, True]


def test_an_accepting_state_with_no_edges_is_live() -> None:
    a = Automaton(0, frozenset({1}), {(0, "a"): 1})
    assert live_states(a) == {0, 1}
    assert token_mask(a, 1, ["a", "$"], eos_id=1) == [False, True]


def test_the_end_of_sequence_is_never_walked_and_follows_acceptance_only() -> None:
    a = Automaton(0, frozenset({1}), {(0, "a"): 1, (1, "a"): 1})
    # The end-of-sequence token's own text would walk fine from 0: it must not matter.
    assert token_mask(a, 0, ["a", "a"], eos_id=1) == [True, False]
    assert token_mask(a, 1, ["a", "a"], eos_id=1) == [True, True]
    assert token_mask(a, 1, ["a", ""], eos_id=1) == [True, True]


def test_empty_tokens_other_than_the_end_are_never_allowed() -> None:
    a = Automaton(0, frozenset({0}), {(0, "a"): 0})
    assert token_mask(a, 0, ["", "a", "", "$"], eos_id=3) == [False, True, False, True]


@pytest.mark.parametrize("eos_id", [-1, len(VOCAB)])
def test_an_end_of_sequence_outside_the_vocabulary_is_a_value_error(eos_id: int) -> None:
    with pytest.raises(ValueError):
        token_mask(integers(), 0, VOCAB, eos_id)


def test_a_dead_state_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        token_mask(integers(), 4, VOCAB, eos_id=0)


def test_nothing_given_is_changed() -> None:
    a = integers()
    edges, vocab = dict(a.edges), list(VOCAB)
    logits = [float(i) for i in range(len(VOCAB))]
    words = pack(token_mask(a, 0, vocab, 0))
    apply_mask(logits, words)
    assert a.edges == edges and vocab == VOCAB and logits == [float(i) for i in range(11)]


# --------------------------------------------------------------------- packing and applying
@pytest.mark.parametrize("size", [1, 31, 32, 33, 64, 65, 100])
def test_token_t_is_bit_t_mod_32_of_word_t_div_32(size: int) -> None:
    for t in {0, size // 2, size - 1}:
        mask = [i == t for i in range(size)]
        words = pack(mask)
        assert len(words) == -(-size // 32)
        assert words[t // 32] == 1 << (t % 32) and sum(words) == 1 << (t % 32)


def test_words_are_unsigned_32_bit_and_bits_past_the_end_are_zero() -> None:
    words = pack([True] * 40)
    assert words == [2**32 - 1, 2**8 - 1]
    assert pack([]) == []


def test_apply_keeps_allowed_logits_and_forbids_the_rest() -> None:
    rng = random.Random(0)
    for size in (5, 32, 70):
        mask = [rng.random() < 0.5 for _ in range(size)]
        mask[rng.randrange(size)] = True
        logits = [rng.gauss(0, 3) for _ in range(size)]
        got = apply_mask(logits, pack(mask))
        assert got == [x if ok else -INF for x, ok in zip(logits, mask)]


def test_apply_refuses_words_of_the_wrong_length_and_a_mask_that_allows_nothing() -> None:
    with pytest.raises(ValueError):
        apply_mask([0.0] * 40, [1])
    with pytest.raises(ValueError):
        apply_mask([0.0] * 4, [1, 0])
    with pytest.raises(ValueError):
        apply_mask([0.0] * 4, [0])


# ------------------------------------------------------------------ against brute force
def random_automaton(rng: random.Random, alphabet: str) -> Automaton:
    n = rng.randint(1, 7)
    edges = {(s, c): rng.randrange(n) for s in range(n) for c in alphabet if rng.random() < 0.45}
    accepting = frozenset(s for s in range(n) if rng.random() < 0.3)
    return Automaton(0, accepting, edges)


def can_finish(a: Automaton, state: int, alphabet: str) -> bool:
    """Brute force: some string of at most as many characters as there are states reaches
    an accepting state (a shortest path never repeats a state)."""
    for length in range(len(a.states()) + 1):
        for chars in itertools.product(alphabet, repeat=length):
            end = walk(a, state, "".join(chars))
            if end is not None and end in a.accepting:
                return True
    return False


def test_random_automata_agree_with_brute_force() -> None:
    rng = random.Random(22)
    alphabet = "ab{"
    vocab = ["<eos>", "", *("".join(p) for n in (1, 2, 3) for p in itertools.product(alphabet,
                                                                                       repeat=n))]
    checked = 0
    for _ in range(120):
        a = random_automaton(rng, alphabet)
        live = {s for s in a.states() if can_finish(a, s, alphabet)}
        assert live_states(a) == live
        for state in sorted(live):
            expected = [state in a.accepting] + [False] + [
                (end := walk(a, state, text)) is not None and end in live for text in vocab[2:]]
            assert token_mask(a, state, vocab, eos_id=0) == expected
            checked += 1
    assert checked > 100


# --------------------------------------------------------- what constrained decoding needs
def test_text_sampled_under_the_mask_is_in_the_language_whatever_the_logits() -> None:
    """The engine's loop on a toy model with random logits: mask, sample, advance. Every text
    that ends (with the end-of-sequence token) is accepted, and no step is ever stuck."""
    rng = random.Random(7)
    a = integers()
    vocab = ["<eos>", "-", "+", "0", "1", "9", "00", "12", "-0", "x", "", "345"]
    ended = 0
    for _ in range(300):
        state, text = a.start, ""
        for _ in range(12):
            logits = [rng.gauss(0, 2) for _ in vocab]
            masked = apply_mask(logits, pack(token_mask(a, state, vocab, eos_id=0)))
            token = max(range(len(vocab)), key=masked.__getitem__)
            if token == 0:
                assert state in a.accepting, text
                assert walk(a, a.start, text) in a.accepting
                ended += 1
                break
            text += vocab[token]
            state = walk(a, state, vocab[token])
            assert state is not None and state in live_states(a)
    assert ended > 100
