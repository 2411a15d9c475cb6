"""Tests for the incremental-detokenizer exercise: they are its specification.

Most tests use a toy byte tokenizer (token id = one UTF-8 byte), which splits every non-ASCII
character into several tokens; one uses a SentencePiece-like toy whose first word loses its
leading space; the last ones use the tiny model's real tokenizer.
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


def check_adds_up(decode, ids: list[int]) -> None:
    stream = DecodeStream(decode)
    sent = ""
    for k, token in enumerate(ids, start=1):
        piece = stream.push(token)
        assert not piece.endswith(REPLACEMENT_CHAR), \
            f"push #{k} returned {piece!r}, which ends in a broken character"
        sent += piece
        full = decode(ids[:k])
        assert full.startswith(sent), \
            f"after {k} tokens the pieces {sent!r} are not the start of the full text {full!r}"
        if not full.endswith(REPLACEMENT_CHAR):
            assert sent == full, \
                f"after {k} tokens the pieces give {sent!r}, the full decode is {full!r}"
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


@pytest.mark.parametrize("text", ["hello world", "你好，世界", "ok 👋🏽 🇫🇷", "déjà vu\n\tnaïve"])
def test_pieces_add_up_to_the_full_decode_of_every_prefix(text: str) -> None:
    check_adds_up(byte_decode, byte_ids(text))


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=40))
def test_any_bytes_add_up(data: bytes) -> None:
    # What a model may generate: bytes that never make a character, too.
    check_adds_up(byte_decode, list(data))


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
    assert matcher.feed("Answer: 4") == ("Answer: 4", False)
    assert matcher.feed("2 #") == ("2 ", False), "'#' may start '###': hold it back"
    assert matcher.feed("#") == ("", False)
    assert matcher.feed("# and more") == ("", True), "text from the stop string on is dropped"


def test_text_that_cannot_start_a_stop_string_is_released() -> None:
    matcher = StopMatcher(("</answer>",))
    assert matcher.feed("x </ans") == ("x ", False)
    assert matcher.held == "</ans"
    assert matcher.feed("w!") == ("</answ!", False), "'</answ!' is no stop string: release it"
    assert matcher.held == ""


def test_the_longest_possible_start_is_held() -> None:
    matcher = StopMatcher(("abc", "bcd"))
    assert matcher.feed("xab") == ("x", False), "'ab' may start 'abc'"
    assert matcher.feed("c") == ("", True)


def test_the_first_stop_string_to_appear_wins() -> None:
    assert StopMatcher(("cd", "b")).feed("abcd") == ("a", True)
    assert StopMatcher(("zz",)).feed("no stop here") == ("no stop here", False)


def test_a_stop_string_inside_one_piece() -> None:
    assert StopMatcher(("\n\n",)).feed("one\n\ntwo") == ("one", True)


def test_flush_returns_the_held_text() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.flush() == "ST", "the stream ended: what was held is text after all"
    assert matcher.held == "" and matcher.flush() == ""


def test_pieces_plus_flush_are_the_text_before_the_stop() -> None:
    text, stop = "The answer is 42.\n###\nThe end.", ("\n###", "END")
    for size in range(1, 6):
        matcher = StopMatcher(stop)
        out, reached = "", False
        for start in range(0, len(text), size):
            piece, reached = matcher.feed(text[start:start + size])
            out += piece
            if reached:
                break
        assert reached and out == "The answer is 42.", f"pieces of {size} characters"


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
