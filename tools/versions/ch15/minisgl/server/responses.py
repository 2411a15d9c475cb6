"""The OpenAI wire format, outbound: what a response says back.

The bodies of whole answers, the chunks of streamed ones and the Server-Sent Events (SSE)
stream (``data: {json}`` events, ``data: [DONE]`` at the end), all built from the
:class:`~minisgl.message.UserReply` messages a request receives.
Everything here is data and functions of data, with no web framework: the API server sends
what these functions build, and a test (or a client) can read it without a server.
:mod:`minisgl.server.protocol` holds the inbound half, the request bodies.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from minisgl.message import TokenUsage, UserReply


# =========================================================================== responses
@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str


def usage_dict(usage: TokenUsage | None) -> dict[str, int] | None:
    """OpenAI's ``usage`` object."""
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def chat_body(meta: ResponseMeta, text: str, last: UserReply) -> dict[str, Any]:
    """A whole (non-streamed) chat completion."""
    return {"id": meta.id, "object": "chat.completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": last.finish_reason}],
            "usage": usage_dict(last.usage)}


def completion_body(meta: ResponseMeta, text: str, last: UserReply) -> dict[str, Any]:
    """A whole (non-streamed) text completion."""
    return {"id": meta.id, "object": "text_completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": last.finish_reason}],
            "usage": usage_dict(last.usage)}


def chat_chunk(meta: ResponseMeta, delta: dict[str, str],
               finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed piece of a chat completion."""
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason}]}


def completion_chunk(meta: ResponseMeta, text: str,
                     finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed piece of a text completion."""
    return {"id": meta.id, "object": "text_completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}]}


SSE_DONE = b"data: [DONE]\n\n"  # OpenAI's end of stream


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One Server-Sent Event: ``data: <json>`` and a blank line.

    JSON escapes newlines inside strings, so the payload is always a single ``data:`` line and
    the blank line can only mean "end of event".
    """
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def stream_chat(replies: AsyncIterator[UserReply], meta: ResponseMeta,
                      include_usage: bool = False) -> AsyncIterator[bytes]:
    """A chat completion as SSE: the role first, a chunk per piece of text, a chunk with the
    finish reason, the usage (if asked), then ``[DONE]``."""
    extra = {"usage": None} if include_usage else {}  # OpenAI: null on all but the last
    yield sse_event({**chat_chunk(meta, {"role": "assistant", "content": ""}), **extra})
    async for reply in replies:
        if reply.delta:  # empty while a multi-byte character is incomplete
            yield sse_event({**chat_chunk(meta, {"content": reply.delta}), **extra})
        if reply.finished:
            yield sse_event({**chat_chunk(meta, {}, reply.finish_reason), **extra})
            if include_usage:
                yield sse_event({**chat_chunk(meta, {}), "choices": [],
                                 "usage": usage_dict(reply.usage)})
    yield SSE_DONE


async def stream_completion(replies: AsyncIterator[UserReply], meta: ResponseMeta,
                            include_usage: bool = False) -> AsyncIterator[bytes]:
    """A text completion as SSE: a chunk per piece of text, one with the finish reason, the
    usage (if asked), then ``[DONE]``."""
    extra = {"usage": None} if include_usage else {}
    async for reply in replies:
        if reply.delta:
            yield sse_event({**completion_chunk(meta, reply.delta), **extra})
        if reply.finished:
            yield sse_event({**completion_chunk(meta, "", reply.finish_reason), **extra})
            if include_usage:
                yield sse_event({**completion_chunk(meta, ""), "choices": [],
                                 "usage": usage_dict(reply.usage)})
    yield SSE_DONE
