"""Tests for the incremental-detokenizer exercise: they are its specification.

Most tests use a toy byte tokenizer (token id = one UTF-8 byte), which splits every non-ASCII
character into several tokens; some use toy vocabularies whose tokens hold several bytes, the
end of one character and the start of the next; one uses a SentencePiece-like toy whose first
word loses its leading space; the last ones use the tiny model's real tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from detokenize import REPLACEMENT_CHAR, DecodeStream, StopMatcher
from hypothesis import given, settings
from hypothesis import strategies as st


def byte_decode(ids: Sequence[int]) -> str:
    """A byte-level tokenizer whose tokens are single bytes."""
    return bytes(ids).decode("utf-8", errors="replace")


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def pushed(stream: DecodeStream, ids: list[int]) -> list[str]:
    return [stream.push(t) for t in ids]


def settled(full: str) -> str:
    """What must have been sent once the tokens so far decode to ``full``: all of it, but an
    unfinished last character (one more token may still finish it)."""
    return full.removesuffix(REPLACEMENT_CHAR)


def check_adds_up(decode, ids: list[int]) -> None:
    stream = DecodeStream(decode)
    sent = ""
    for k, token in enumerate(ids, start=1):
        piece = stream.push(token)
        sent += piece
        full = decode(ids[:k])
        assert sent == settled(full), (
            f"after {k} tokens the pieces give {sent!r}; the full decode is {full!r}, so "
            f"{settled(full)!r} should have been sent by now")
    rest = stream.flush()
    assert sent + rest == decode(ids), "pieces + flush() must equal the full decode"


# ---------------------------------------------------------------------------------- DecodeStream
def test_ascii_comes_out_one_piece_per_token() -> None:
    assert pushed(DecodeStream(byte_decode), byte_ids("Hi!")) == ["H", "i", "!"]


def test_a_split_character_is_held_until_complete() -> None:
    pieces = pushed(DecodeStream(byte_decode), byte_ids("a你b"))
    assert pieces == ["a", "", "", "你", "b"], \
        "the first two bytes of 你 decode to '\\ufffd': return '' until the third arrives"


def test_a_four_byte_emoji_is_held_until_complete() -> None:
    assert pushed(DecodeStream(byte_decode), byte_ids("👋")) == ["", "", "", "👋"]


def vocab_decode(vocab: list[bytes]):
    """A byte-level tokenizer whose tokens are the byte strings of ``vocab``."""
    return lambda ids: b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


def test_the_finished_characters_of_a_token_are_sent_at_once() -> None:
    # 你 is e4 bd a0: token 0 ends with its first byte, token 1 holds the rest and a "b"
    decode = vocab_decode([b"a\xe4", b"\xbd\xa0b"])
    assert pushed(DecodeStream(decode), [0, 1]) == ["a", "你b"], (
        "'a' is finished after the first token: only the start of 你 waits")


def test_a_broken_character_is_sent_once_it_cannot_be_finished() -> None:
    stream = DecodeStream(byte_decode)
    assert pushed(stream, [0xE4, 0xE4]) == ["", REPLACEMENT_CHAR], (
        "a second start byte shows the first can never be finished: send its '\ufffd' now")
    assert pushed(stream, [0xBD, 0xA0, ord("!")]) == ["", "你", "!"]


@pytest.mark.parametrize("text", ["hello world", "你好，世界", "ok 👋🏽 🇫🇷", "déjà vu\n\tnaïve"])
def test_pieces_add_up_to_the_full_decode_of_every_prefix(text: str) -> None:
    check_adds_up(byte_decode, byte_ids(text))


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=40))
def test_any_bytes_add_up(data: bytes) -> None:
    # What a model may generate: bytes that never make a character, too.
    check_adds_up(byte_decode, list(data))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=4), min_size=1, max_size=12),
       st.lists(st.integers(0, 11), max_size=30))
def test_any_tokens_of_several_bytes_add_up(vocab: list[bytes], picks: list[int]) -> None:
    check_adds_up(vocab_decode(vocab), [p % len(vocab) for p in picks])


def test_flush_returns_a_broken_last_character() -> None:
    stream = DecodeStream(byte_decode)
    assert pushed(stream, [ord("x"), 0xE4, 0xBD]) == ["x", "", ""]
    assert stream.flush() == REPLACEMENT_CHAR, \
        "at the end of the stream the held bytes are text (a broken character) after all"
    assert stream.flush() == "", "a second flush has nothing left"


def test_flush_after_a_complete_stream_is_empty() -> None:
    stream = DecodeStream(byte_decode)
    pushed(stream, byte_ids("abc"))
    assert stream.flush() == ""


# A SentencePiece-like tokenizer: words carry a leading "▁" that decodes to a space, except at
# the very start of a text, where it is dropped.
WORDS = ["▁Hello", "▁world", ",", "▁again"]


def sentencepiece_decode(ids: Sequence[int]) -> str:
    text = "".join(WORDS[i] for i in ids).replace("▁", " ")
    return text.removeprefix(" ")


def test_tokens_are_decoded_in_context() -> None:
    pieces = pushed(DecodeStream(sentencepiece_decode), [0, 1, 2, 3])
    assert "".join(pieces) == "Hello world, again", \
        f"got {pieces}: decoding a token alone drops its leading space; decode a window"
    check_adds_up(sentencepiece_decode, [0, 1, 2, 3, 1])


def test_the_decode_window_stays_small() -> None:
    sizes: list[int] = []

    def counting_decode(ids: Sequence[int]) -> str:
        sizes.append(len(ids))
        return byte_decode(ids)

    stream = DecodeStream(counting_decode)
    pushed(stream, byte_ids("a long stream of plain text " * 8))
    assert max(sizes) <= 4, \
        f"decode was given {max(sizes)} tokens at once: decode from prefix_offset only"


def test_the_offsets_move_only_when_text_is_returned() -> None:
    stream = DecodeStream(byte_decode)
    pushed(stream, byte_ids("ab"))
    assert (stream.prefix_offset, stream.read_offset) == (1, 2)
    stream.push(0xE4)  # the start of 你: nothing returned, nothing moves
    assert (stream.prefix_offset, stream.read_offset) == (1, 2)


# ---------------------------------------------------------------------------------- StopMatcher
def test_a_stop_string_split_across_pieces_is_found() -> None:
    matcher = StopMatcher(("###",))
    assert matcher.feed("Answer: 4") == ("Answer: 4", None)
    assert matcher.feed("2 #") == ("2 ", None), "'#' may start '###': hold it back"
    assert matcher.feed("#") == ("", None)
    assert matcher.feed("# and more") == ("", "###"), "text from the stop string on is dropped"


def test_text_that_cannot_start_a_stop_string_is_released() -> None:
    matcher = StopMatcher(("</answer>",))
    assert matcher.feed("x </ans") == ("x ", None)
    assert matcher.held == "</ans"
    assert matcher.feed("w!") == ("</answ!", None), "'</answ!' is no stop string: release it"
    assert matcher.held == ""


def test_the_longest_possible_start_is_held() -> None:
    matcher = StopMatcher(("abc", "bcd"))
    assert matcher.feed("xab") == ("x", None), "'ab' may start 'abc'"
    assert matcher.feed("c") == ("", "abc")


def test_the_stop_string_reached_is_named() -> None:
    assert StopMatcher(("zz", "\n\n")).feed("one\n\ntwo") == ("one", "\n\n")
    assert StopMatcher(("zz",)).feed("no stop here") == ("no stop here", None)


def test_the_stop_string_that_ends_first_wins() -> None:
    # "abc" starts first, but "b" is complete one character earlier: a stream that brought
    # "xab" first would have stopped at "b" before "c" arrived
    assert StopMatcher(("abc", "b")).feed("xabc") == ("xa", "b")
    matcher = StopMatcher(("abc", "b"))
    assert matcher.feed("xa") == ("x", None)
    assert matcher.feed("bc") == ("a", "b")


def test_of_two_that_end_together_the_longer_wins() -> None:
    assert StopMatcher(("bc", "abc")).feed("xabcd") == ("x", "abc")


def test_flush_returns_the_held_text() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("go ST") == ("go ", None)
    assert matcher.flush() == "ST", "the stream ended: what was held is text after all"
    assert matcher.held == "" and matcher.flush() == ""


def run_stops(stop: tuple[str, ...], text: str, size: int) -> tuple[str, str | None]:
    """Feed ``text`` in pieces of ``size`` characters; return what was sent and the stop."""
    matcher = StopMatcher(stop)
    out = ""
    for start in range(0, len(text), size):
        piece, reached = matcher.feed(text[start:start + size])
        out += piece
        if reached is not None:
            return out, reached
    return out + matcher.flush(), None


def test_pieces_plus_flush_are_the_text_before_the_stop() -> None:
    text, stop = "The answer is 42.\n###\nThe end.", ("\n###", "END")
    for size in range(1, 6):
        assert run_stops(stop, text, size) == ("The answer is 42.", "\n###"), (
            f"pieces of {size} characters")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text("ab#", min_size=1, max_size=4), min_size=1, max_size=3),
       st.text("ab#", max_size=16), st.integers(1, 5))
def test_how_the_text_is_cut_does_not_change_the_answer(stop: list[str], text: str,
                                                        size: int) -> None:
    whole = run_stops(tuple(stop), text, max(len(text), 1))
    assert run_stops(tuple(stop), text, size) == whole, (
        f"stop strings {stop}, text {text!r}: in pieces of {size} characters the answer "
        f"differs from the answer for the whole text, {whole}")


# ------------------------------------------------------------------------------ a real tokenizer
@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    pytest.importorskip("transformers", reason="the tiny model's tokenizer needs transformers "
                        "(not in the browser): the local judge runs these tests")
    from minisgl.tokenizer.tokenize import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.mark.parametrize("text", ["Hello, world.", "你好，世界！", "emoji 👋🏽 and 🧑‍💻"])
def test_the_tiny_models_tokenizer_adds_up(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    check_adds_up(tokenizer.decode, ids)
    stream = DecodeStream(tokenizer.decode)
    assert "".join(pushed(stream, ids)) + stream.flush() == text
