"""The OpenAI wire format, inbound: what a request body may say, and the errors it can get.

Everything here is pure data and pure functions; nothing sends, waits or holds state, so every
piece can be tested without a server. It has two parts:

1. :class:`APIError`, the OpenAI-style error (a status and ``{"error": {...}}``), and the
   mapping of pydantic's validation errors onto it;
2. the request bodies, as pydantic models: a malformed body is answered with HTTP 400 and an
   OpenAI-style error before anything reaches a worker; :meth:`_GenerationBody.sampling_params`
   turns a body into the engine's :class:`~minisgl.core.SamplingParams`.

What a response says back (bodies, chunks, the SSE stream) is :mod:`minisgl.server.responses`.
:mod:`minisgl.server.frontend` raises :class:`APIError`; :mod:`minisgl.server.api_server`
parses the bodies and answers with the builders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from minisgl.core import SamplingParams

# OpenAI's documented default for /v1/completions. A chat request without a limit may in
# principle run to the end of the context; 1024 tokens keeps a forgotten limit from holding a
# request slot for minutes, and the scheduler lowers it further where the context is shorter.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 1024
# OpenAI's default temperature: a request that does not ask for greedy decoding samples.
DEFAULT_TEMPERATURE = 1.0


# =========================================================================== errors
class APIError(Exception):
    """An error the client caused, answered as OpenAI does: a status and ``{"error": {...}}``."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.kind = kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}
        return JSONResponse(body, status_code=self.status_code)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """pydantic's error list as one readable message naming the field(s)."""
    parts, param = [], None
    for error in errors:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        param = param or where or None
        parts.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return APIError(400, "; ".join(parts) or "invalid request body", param)


# =========================================================================== request bodies
TokenId = Annotated[int, Field(ge=0)]


class TextPart(BaseModel):
    """One part of a message's content given as a list (OpenAI's multi-part form)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn of a conversation."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        """The turn as the chat template expects it: role and plain-text content."""
        text = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)
        return {"role": self.role, "content": text}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _GenerationBody(BaseModel):
    """What chat and completion requests share: the sampling parameters and ``stream``.

    ``None`` (or leaving a field out) means the default. Unknown fields are rejected: a typo
    such as ``max_token`` would otherwise be ignored without a word. Fields that OpenAI defines
    but this server does not implement are accepted only at their neutral value.
    """

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension (vLLM, SGLang)
    min_p: float | None = None  # an extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # an extension
    ignore_eos: bool = False  # an extension: benchmarks use it for outputs of known length
    n: int = 1
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
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens


class CompletionRequest(_GenerationBody):
    """The body of ``POST /v1/completions``: a prompt as text or as token ids."""

    prompt: str | list[TokenId]
