"""Tests for the SSE-client exercise: they are its specification.

The streams are written by the engine's own `stream_chat` (chapter 15) from lists of replies,
then cut into reads at every byte, at random places, or one byte at a time, as a socket may
deliver them. Hand-written bodies cover what `stream_chat` never sends but a server may:
comments, CRLF line ends, a data field on two lines, a stream cut off. Every failure shows the
input, the expected and the actual value.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
from sse_client import ChatStream, parse_chat_stream

from minisgl.message import TokenUsage, UserReply
from minisgl.server.responses import ResponseMeta, stream_chat

META = ResponseMeta(id="chatcmpl-7", created=1_700_000_000, model="tiny")


def body_of(replies: list[UserReply], include_usage: bool) -> bytes:
    """The bytes the API server writes for these replies."""
    async def feed() -> AsyncIterator[UserReply]:
        for reply in replies:
            yield reply

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in stream_chat(feed(), META, include_usage)])
    return asyncio.run(collect())


def replies_of(pieces: list[str], finish: str = "length", prompt: int = 21) -> list[UserReply]:
    last = UserReply(1, pieces[-1], finish, TokenUsage(prompt, len(pieces)))
    return [UserReply(1, p) for p in pieces[:-1]] + [last]


def cut(body: bytes, where: list[int]) -> list[bytes]:
    edges = [0, *sorted(set(where)), len(body)]
    return [body[a:b] for a, b in zip(edges, edges[1:])]


def check(reads: list[bytes], expected: ChatStream) -> None:
    got = parse_chat_stream(iter(reads))
    for name in ("role", "pieces", "finish_reason", "usage", "events"):
        assert getattr(got, name) == getattr(expected, name), (
            f"input: {b''.join(reads)!r}\n  read as {len(reads)} piece(s): {reads[:6]!r}...\n"
            f"  expected {name} = {getattr(expected, name)!r}, got {getattr(got, name)!r}")


# ----------------------------------------------------------------- the README's example
EXAMPLE_PIECES = ["ield", "ig", "coder"]
EXAMPLE = ChatStream(role="assistant", pieces=EXAMPLE_PIECES, finish_reason="length",
                     usage={"prompt_tokens": 21, "completion_tokens": 3, "total_tokens": 24},
                     events=7)


def test_the_readme_example_in_one_read() -> None:
    check([body_of(replies_of(EXAMPLE_PIECES), include_usage=True)], EXAMPLE)


def test_the_readme_example_one_byte_at_a_time() -> None:
    body = body_of(replies_of(EXAMPLE_PIECES), include_usage=True)
    check([body[i:i + 1] for i in range(len(body))], EXAMPLE)


def test_without_include_usage_there_is_no_usage() -> None:
    expected = ChatStream(role="assistant", pieces=EXAMPLE_PIECES, finish_reason="length",
                          usage=None, events=6)
    check([body_of(replies_of(EXAMPLE_PIECES), include_usage=False)], expected)


def test_empty_deltas_send_no_piece() -> None:
    # a token that ends inside a character: the detokenizer sends "", the server no chunk
    replies = [UserReply(1, "a"), UserReply(1, ""), UserReply(1, ""),
               UserReply(1, "你", "stop", TokenUsage(4, 4))]
    expected = ChatStream(role="assistant", pieces=["a", "你"], finish_reason="stop",
                          usage={"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8},
                          events=6)
    check([body_of(replies, include_usage=True)], expected)


@pytest.mark.parametrize("text", ["你好", "👋", "naïve"])
def test_a_read_that_cuts_a_character_in_two(text: str) -> None:
    body = body_of(replies_of([text, "!"]), include_usage=False)
    start = body.index(text.encode())
    expected = ChatStream(role="assistant", pieces=[text, "!"], finish_reason="length",
                          events=5)
    for offset in range(1, len(text.encode())):
        check(cut(body, [start + offset]), expected)


def test_a_newline_in_the_text_is_not_the_end_of_an_event() -> None:
    pieces = ["line one\n", "\n\nline two", "data: not a field"]
    check([body_of(replies_of(pieces), include_usage=False)],
          ChatStream(role="assistant", pieces=pieces, finish_reason="length", events=6))


# ----------------------------------------------------------------- what other servers send
def test_comments_crlf_other_fields_and_a_data_field_on_two_lines() -> None:
    body = (b": keep-alive\r\n\r\n"
            b"event: message\r\nid: 1\r\n"
            b'data: {"choices": [{"delta": {"role": "assistant"}, "finish_reason": null}]}\r\n\r\n'
            b'data: {"choices": [{"delta": {"content": "Hi"},\r\n'
            b'data:  "finish_reason": null}]}\r\n\r\n'
            b'data:{"choices": [{"delta": {}, "finish_reason": "stop"}]}\r\n\r\n'
            b"data: [DONE]\r\n\r\n")
    check([body], ChatStream(role="assistant", pieces=["Hi"], finish_reason="stop", events=4))


def test_a_stream_cut_off_before_done_is_an_error() -> None:
    body = body_of(replies_of(EXAMPLE_PIECES), include_usage=True)
    cut_off = body[: body.index(b"data: [DONE]")]
    with pytest.raises(ValueError, match="DONE"):
        parse_chat_stream(iter([cut_off]))
        pytest.fail(f"input: {cut_off[-80:]!r} (no data: [DONE])\n  expected a ValueError "
                    "naming [DONE], got a result")


def test_done_without_its_blank_line_is_cut_off_too() -> None:
    body = body_of(replies_of(EXAMPLE_PIECES), include_usage=False)
    with pytest.raises(ValueError, match="DONE"):
        parse_chat_stream(iter([body[:-2]]))
        pytest.fail(f"input ends {body[-30:-2]!r}: the event never ended; expected a "
                    "ValueError naming [DONE]")


# ----------------------------------------------------------------- random streams, random reads
@pytest.mark.parametrize("seed", range(30))
def test_random_streams_cut_at_random_places(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = ["a", "b", " ", "\n", "é", "你", "👋", '"', "\\", "data:", "\r"]
    pieces = ["".join(rng.choices(alphabet, k=rng.randint(1, 4)))
              for _ in range(rng.randint(1, 12))]
    finish = rng.choice(["stop", "length"])
    usage = rng.random() < 0.5
    prompt = rng.randint(1, 99)
    body = body_of(replies_of(pieces, finish, prompt), include_usage=usage)
    expected = ChatStream(
        role="assistant", pieces=pieces, finish_reason=finish,
        usage={"prompt_tokens": prompt, "completion_tokens": len(pieces),
               "total_tokens": prompt + len(pieces)} if usage else None,
        events=len(pieces) + 3 + usage)  # role, pieces, finish, [usage], [DONE]
    check([body], expected)
    check(cut(body, rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(1, 40)))),
          expected)
