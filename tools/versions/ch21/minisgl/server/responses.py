"""The OpenAI wire format, outbound: what a response says back.

The bodies of whole answers, the chunks of streamed ones and the Server-Sent Events stream
(``data: {json}`` events, ``data: [DONE]`` at the end), all built from a request's
:class:`~minisgl.message.UserReply` messages. Data and functions of data, with no web
framework, so a test (or a client) reads them without a server; the inbound half is
:mod:`minisgl.server.protocol`. A request that fails mid-stream ends with an error event.

Chapter 15 tells the story; chapter 16 adds OpenAI's error object and the error event.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import asdict, dataclass
from typing import Any

from minisgl.message import TextLogprobs, TokenUsage, UserReply
from minisgl.server.protocol import APIError


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str

    def body(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """A body or chunk of object type ``kind``, with ``choices`` and ``extra`` fields."""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def usage_dict(usage: TokenUsage | None) -> dict[str, int] | None:
    """OpenAI's ``usage`` object."""
    return None if usage is None else {**asdict(usage), "total_tokens": usage.total_tokens}


def choice(index: int, finish_reason: str | None, logprobs: dict[str, Any] | None = None,
           **content: Any) -> dict[str, Any]:
    """One of ``choices``: its ``content`` (a ``message``, a ``delta`` or a ``text``)."""
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}


def logprobs_object(entries: Sequence[TextLogprobs], chat: bool, offset: int = 0
                    ) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a choice's tokens (chapter 21): a chat completion's
    ``content`` entries, or a completion's parallel lists, whose ``text_offset`` counts from
    ``offset`` (the length of the choice's text before these tokens)."""
    if not entries:
        return None
    if chat:
        return {"content": [{**_token(e.token, e.logprob),
                             "top_logprobs": [_token(t, v) for t, v in e.top]}
                            for e in entries]}
    offsets = list(itertools.accumulate((len(e.token) for e in entries[:-1]), initial=offset))
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],  # null: an echoed first token
            "top_logprobs": [None if e.logprob is None else dict(e.top) for e in entries],
            "text_offset": offsets}


def _token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def total_usage(usages: Sequence[TokenUsage | None], n: int = 1) -> TokenUsage | None:
    """The usage of several requests answered as one (a list of prompts, ``n`` choices each,
    in index order): their sum, each prompt counted once."""
    if any(usage is None for usage in usages):
        return None
    return TokenUsage(sum(u.prompt_tokens for u in usages[::n]),  # type: ignore[union-attr]
                      sum(u.completion_tokens for u in usages))  # type: ignore[union-attr]


def completion_body(meta: ResponseMeta,
                    answers: Sequence[tuple[str, UserReply, Sequence[TextLogprobs]]],
                    chat: bool = False, logprobs: bool = True, n: int = 1) -> dict[str, Any]:
    """A whole (non-streamed) completion: a choice per prompt, in the prompts' order (a chat
    completion has one, whose text is the assistant's ``message``). ``logprobs``: whether
    the client asked for them (an echoed prompt brings its own, to be dropped otherwise)."""
    choices = [choice(i, last.finish_reason,
                      logprobs_object(listed, chat) if logprobs else None,
                      **({"message": {"role": "assistant", "content": text}} if chat
                         else {"text": text}))
               for i, (text, last, listed) in enumerate(answers)]
    return meta.body("chat.completion" if chat else "text_completion", choices,
                     usage=usage_dict(total_usage([last.usage for _, last, _ in answers], n)))


SSE_DONE = b"data: [DONE]\n\n"  # OpenAI's end of stream


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One Server-Sent Event: ``data: <json>`` and a blank line.

    JSON escapes newlines inside strings, so the payload is always a single ``data:`` line and
    the blank line can only mean "end of event".
    """
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def chunk(meta: ResponseMeta, kind: str, extra: Mapping[str, Any], index: int = 0,
          finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
          **content: Any) -> bytes:
    """One streamed piece of choice ``index`` as an SSE event, with ``extra`` fields."""
    return sse_event(meta.body(kind, [choice(index, finish_reason, logprobs, **content)],
                               **extra))


async def stream_completion(replies: AsyncIterator[tuple[int, UserReply]], meta: ResponseMeta,
                            num_choices: int = 1, include_usage: bool = False,
                            chat: bool = False, logprobs: bool = True,
                            n: int = 1) -> AsyncIterator[bytes]:
    """A completion as SSE: a chunk per piece of text, one with the finish reason per choice,
    the usage of all (if asked), then ``[DONE]``. A chat completion's text comes as ``delta``
    messages, after a first chunk that names the assistant's role.

    ``replies`` are ``(choice index, reply)`` pairs, the replies of ``num_choices`` requests
    (one per prompt) as they come. A request that fails ends the stream with an error event
    (OpenAI's error object, which the ``openai`` client raises as an exception), then
    ``[DONE]``. Closing this generator closes ``replies``, which aborts the other requests.
    """
    kind = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}  # OpenAI: null on all but the last
    usages: dict[int, TokenUsage | None] = {}  # by choice index

    sent = [0] * num_choices  # characters of text sent per choice, for text_offset

    def piece(index: int, text: str, finish_reason: str | None = None,
              entries: Sequence[TextLogprobs] = ()) -> bytes:
        content = {"delta": {"content": text} if text else {}} if chat else {"text": text}
        listed = logprobs_object(entries, chat, sent[index]) if logprobs else None
        sent[index] += len(text)
        return chunk(meta, kind, extra, index, finish_reason, listed, **content)

    async with aclosing(replies):
        if chat:
            yield chunk(meta, kind, extra, delta={"role": "assistant", "content": ""})
        async for index, reply in replies:
            if reply.prompt_text:  # echo: the prompt first, as its own piece
                yield piece(index, reply.prompt_text, entries=reply.prompt_logprobs)
            if reply.delta or reply.logprobs:  # no text while a character is incomplete
                yield piece(index, reply.delta,
                            entries=[reply.logprobs] if reply.logprobs else [])
            if reply.error is not None:
                yield sse_event(APIError.of(reply.error, "messages" if chat else "prompt").body())
                break
            if reply.finished:
                yield piece(index, "", reply.finish_reason)
                usages[index] = reply.usage
                if include_usage and len(usages) == num_choices:
                    total = total_usage([usages[i] for i in range(num_choices)], n)
                    yield sse_event(meta.body(kind, [], usage=usage_dict(total)))
        yield SSE_DONE
