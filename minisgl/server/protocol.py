"""The OpenAI wire format: what a request body may say, and what a response says back.

Everything here is data and functions of data; nothing sends a request or holds state, so
every piece can be tested without a server. It has three parts:

1. :class:`APIError`, the OpenAI-style error (a status and ``{"error": {...}}``), and the
   mapping of pydantic's validation errors onto it;
2. the request bodies, as pydantic models: a malformed body is answered with HTTP 400 and an
   OpenAI-style error before anything reaches a worker; :meth:`_GenerationBody.sampling_params`
   turns a body into the engine's :class:`~minisgl.core.SamplingParams`;
3. the response bodies and the Server-Sent Events (SSE) stream: ``data: {json}`` chunks,
   ``data: [DONE]`` at the end, built from the :class:`~minisgl.message.UserReply` messages
   a request receives.

:mod:`minisgl.server.frontend` raises :class:`APIError`; :mod:`minisgl.server.api_server`
parses the bodies and answers with the builders.

Chapter 16 tightens the edges: strict types and integers that fit the wire, a body that is
not JSON said so, a request that fails answered with its error's status (or, mid-stream, an
error event), and an SSE stream that closes its replies however it ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from minisgl.core import SamplingParams
from minisgl.message import RequestError, TokenUsage, UserReply

# OpenAI's documented default for /v1/completions. A chat request without a limit may in
# principle run to the end of the context; 1024 tokens keeps a forgotten limit from holding a
# request slot for minutes, and the scheduler lowers it further where the context is shorter.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 1024
# OpenAI's default temperature: a request that does not ask for greedy decoding samples.
DEFAULT_TEMPERATURE = 1.0


# =========================================================================== errors
# --8<-- [start:api_error]
class APIError(Exception):
    """An error the client caused, answered as OpenAI does: a status and ``{"error": {...}}``."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    @classmethod
    def of(cls, error: RequestError, prompt_param: str = "prompt") -> APIError:
        """The HTTP answer to a request that ended with ``error`` (chapter 16). Workers call
        the prompt ``"prompt"``; for a chat request, the prompt is ``"messages"``."""
        param = prompt_param if error.param == "prompt" else error.param
        return cls(error.status, error.message, param, error.kind, error.code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def error_body(error: RequestError, prompt_param: str = "prompt") -> dict[str, Any]:
    """OpenAI's error object for ``error``: the body of an error response or SSE event."""
    return APIError.of(error, prompt_param).body()


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """pydantic's error list as one readable message naming the field(s).

    Chapter 16: a body that is not JSON at all is said so (pydantic locates that error at a
    character offset, which is no parameter).
    """
    parts, param = [], None
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "not valid JSON")
            offset = error.get("loc", ("body", "?"))[-1]
            return APIError(400, f"the body is not valid JSON: {reason} (at character "
                                 f"{offset})")
        where = ".".join(str(p) for p in error.get("loc", ()) if not _union_tag(p))
        if param is None or len(where) > len(param):  # the most precise location
            param = where or None
        parts.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return APIError(400, "; ".join(parts) or "invalid request body", param)


def _union_tag(part: object) -> bool:
    """A part of an error's location that is no field: ``"body"``, or the member of a union
    pydantic tried (``prompt: str | list[int]`` fails at ``prompt.str`` and at
    ``prompt.list[constrained-int].1``)."""
    return part == "body" or (isinstance(part, str) and (
        "[" in part or "-" in part or part in ("str", "int", "float", "bool", "list", "dict")))
# --8<-- [end:api_error]


# =========================================================================== request bodies
# --8<-- [start:body_types]
# Chapter 16: integers must fit the wire (msgpack packs at most 64 bits); a larger value is the
# client's mistake (HTTP 400 naming the field), not a failure to serialize (500).
TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# Chapter 16: strict types. Lax pydantic would take "12" for 12 and "yes" for true; OpenAI's API
# refuses a value of the wrong JSON type, and so does this one (HTTP 400 naming the field).
STRICT_BODY = ConfigDict(extra="forbid", strict=True)
# --8<-- [end:body_types]


# --8<-- [start:request_models]
class TextPart(BaseModel):
    """One part of a message's content given as a list (OpenAI's multi-part form)."""

    model_config = STRICT_BODY
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn of a conversation."""

    model_config = STRICT_BODY
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        """The turn as the chat template expects it: role and plain-text content."""
        text = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)
        return {"role": self.role, "content": text}


class StreamOptions(BaseModel):
    model_config = STRICT_BODY
    include_usage: bool = False


class _GenerationBody(BaseModel):
    """What chat and completion requests share: the sampling parameters and ``stream``.

    ``None`` (or leaving a field out) means the default. Unknown fields are rejected: a typo
    such as ``max_token`` would otherwise be ignored without a word. Fields that OpenAI defines
    but this server does not implement are accepted only at their neutral value.
    """

    model_config = STRICT_BODY
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None  # an extension (vLLM, SGLang)
    min_p: float | None = None  # an extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # an extension
    ignore_eos: bool = False  # an extension: benchmarks use it for outputs of known length
    n: Int64 = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @model_validator(mode="after")
    def _only_what_we_implement(self) -> _GenerationBody:
        if self.n != 1:
            raise ValueError(f"n must be 1 (one choice per request), got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ValueError(f"{name} is not supported; it must be 0 (or left out)")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
        """The engine's :class:`SamplingParams`; a value it rejects becomes HTTP 400."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        values: dict[str, Any] = {
            "temperature": DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
        }
        if stop:  # text stop strings: the detokenizer applies them
            values["stop"] = stop
        try:
            return SamplingParams(**values)
        except (TypeError, ValueError) as exc:  # the engine's own range checks, one place
            param = next((name for name in values if str(exc).startswith(name)), None)
            raise APIError(400, str(exc), param) from None


class ChatCompletionRequest(_GenerationBody):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None  # OpenAI's newer name for max_tokens


class CompletionRequest(_GenerationBody):
    """The body of ``POST /v1/completions``: a prompt as text or as token ids."""

    prompt: str | list[TokenId]
# --8<-- [end:request_models]


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


# --8<-- [start:sse]
SSE_DONE = b"data: [DONE]\n\n"  # OpenAI's end of stream


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One Server-Sent Event: ``data: <json>`` and a blank line.

    JSON escapes newlines inside strings, so the payload is always a single ``data:`` line and
    the blank line can only mean "end of event".
    """
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def stream_chat(replies: AsyncIterator[UserReply], meta: ResponseMeta,
                      include_usage: bool = False,
                      prompt_param: str = "messages") -> AsyncIterator[bytes]:
    """A chat completion as SSE: the role first, a chunk per piece of text, a chunk with the
    finish reason, the usage (if asked), then ``[DONE]``.

    Chapter 16: a request that fails mid-stream ends with an error event (OpenAI's error
    object, which the ``openai`` client raises as an exception), then ``[DONE]``. Closing this
    generator closes ``replies``, which frees the request's state at once.
    """
    extra = {"usage": None} if include_usage else {}  # OpenAI: null on all but the last
    async with aclosing(replies):
        yield sse_event({**chat_chunk(meta, {"role": "assistant", "content": ""}), **extra})
        async for reply in replies:
            if reply.delta:  # empty while a multi-byte character is incomplete
                yield sse_event({**chat_chunk(meta, {"content": reply.delta}), **extra})
            if reply.error is not None:
                yield sse_event(error_body(reply.error, prompt_param))
            elif reply.finished:
                yield sse_event({**chat_chunk(meta, {}, reply.finish_reason), **extra})
                if include_usage:
                    yield sse_event({**chat_chunk(meta, {}), "choices": [],
                                     "usage": usage_dict(reply.usage)})
        yield SSE_DONE
# --8<-- [end:sse]


async def stream_completion(replies: AsyncIterator[UserReply], meta: ResponseMeta,
                            include_usage: bool = False,
                            prompt_param: str = "prompt") -> AsyncIterator[bytes]:
    """A text completion as SSE: a chunk per piece of text, one with the finish reason, the
    usage (if asked), then ``[DONE]``; an error event instead if the request fails."""
    extra = {"usage": None} if include_usage else {}
    async with aclosing(replies):
        async for reply in replies:
            if reply.delta:
                yield sse_event({**completion_chunk(meta, reply.delta), **extra})
            if reply.error is not None:
                yield sse_event(error_body(reply.error, prompt_param))
            elif reply.finished:
                yield sse_event({**completion_chunk(meta, "", reply.finish_reason), **extra})
                if include_usage:
                    yield sse_event({**completion_chunk(meta, ""), "choices": [],
                                     "usage": usage_dict(reply.usage)})
        yield SSE_DONE

