"""The OpenAI wire format, inbound: the request bodies and the errors a request can get.

- :class:`APIError`, OpenAI's error (a status and ``{"error": {...}}``), and the mapping of
  pydantic's validation errors onto it;
- the request bodies as pydantic models, checked strictly (strict types, integers that fit
  the wire); :meth:`_GenerationBody.sampling_params` turns one into the engine's
  :class:`~minisgl.core.SamplingParams`.

Data and functions of data only, testable without a server; the outbound half is
:mod:`minisgl.server.responses`. Chapter 15 tells the story; chapter 16 makes the checks strict.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from minisgl.core import MAX_TOP_LOGPROBS, SamplingParams
from minisgl.message import RequestError

# OpenAI's documented default for /v1/completions. A chat request without a limit may in
# principle run to the end of the context; 1024 tokens keeps a forgotten limit from holding a
# request slot for minutes, and the scheduler lowers it further where the context is shorter.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 1024
# OpenAI's default temperature: a request that does not ask for greedy decoding samples.
DEFAULT_TEMPERATURE = 1.0
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on a completion's logprobs
MAX_CHOICES = 128  # OpenAI's bound on n


# =========================================================================== errors
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
        """The HTTP answer to a request that ended with ``error``. Workers call the prompt
        ``"prompt"``; for a chat request, the prompt is ``"messages"``."""
        param = prompt_param if error.param == "prompt" else error.param
        return cls(error.status, error.message, param, error.kind, error.code)

    def body(self) -> dict[str, Any]:
        """OpenAI's error object: the body of an error response or SSE event."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """pydantic's error list as one readable message naming the field(s).

    A body that is not JSON at all is said so (pydantic locates that error at a
    character offset, which is no parameter).
    """
    parts, param = [], None
    for error in errors:
        if error["type"] == "json_invalid":  # FastAPI's own: its reason, and where
            return APIError(400, f"the body is not valid JSON: {error['ctx']['error']} (at "
                                 f"character {error['loc'][-1]})")
        where = ".".join(str(p) for p in error.get("loc", ()) if not _union_tag(p))
        if param is None or len(where) > len(param):  # the most precise location
            param = where or None
        message = error.get("msg", "invalid")
        if error.get("type") == "literal_error":  # a role, a content part's type
            message = (f"must be one of {(error.get('ctx') or {}).get('expected')}; got "
                       f"{json.dumps(error.get('input'))}, which this server does not support")
        parts.append(f"{where or 'body'}: {message}")
    return APIError(400, "; ".join(parts) or "invalid request body", param)


def _union_tag(part: object) -> bool:
    """A part of an error's location that is no field: ``"body"``, or the member of a union
    pydantic tried (``prompt: str | list[int]`` fails at ``prompt.str`` and at
    ``prompt.list[constrained-int].1``)."""
    return part == "body" or (isinstance(part, str) and (
        "[" in part or "-" in part or part in ("str", "int", "float", "bool", "list", "dict")))


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error object: the body of every 4xx and 5xx answer (for the schema)."""

    error: ErrorDetail


# =========================================================================== request bodies
# Integers must fit the wire (msgpack packs at most 64 bits); a larger value is the
# client's mistake (HTTP 400 naming the field), not a failure to serialize (500). The bound is
# the largest integer a JSON number holds exactly (2**53 - 1): many clients, and every tool that
# reads the schema's bounds, parse JSON numbers as doubles, which would round 2**63 - 1 up.
MAX_JSON_INT = 2**53 - 1


def _whole_number(value: Any) -> Any:
    """JSON has one number type: ``12.0`` is the integer 12 (as JSON Schema says), while
    ``12.5`` and ``"12"`` stay what they are, and are refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


TokenId = Annotated[int, Field(ge=0, le=MAX_JSON_INT), BeforeValidator(_whole_number)]
Seed = Annotated[int, Field(ge=0, le=MAX_JSON_INT), BeforeValidator(_whole_number)]
Int64 = Annotated[int, Field(ge=-MAX_JSON_INT, le=MAX_JSON_INT), BeforeValidator(_whole_number)]
# Strict types. Lax pydantic would take "12" for 12 and "yes" for true; OpenAI's API
# refuses a value of the wrong JSON type, and so does this one (HTTP 400 naming the field).
STRICT_BODY = ConfigDict(extra="forbid", strict=True)


# What the OpenAPI schema says of a field, beyond its type: the ranges and lengths that the
# engine's own checks (SamplingParams, the endpoints) enforce. The checks stay where they are,
# with their messages; the schema only tells clients, and schema-driven tools, what they are.
def _documented(**constraints: Any) -> Any:
    """An optional field (default None) whose schema states ``constraints``."""
    return Field(None, json_schema_extra=constraints)


class TextPart(BaseModel):
    """One part of a message's content given as a list (OpenAI's multi-part form)."""

    model_config = STRICT_BODY
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = STRICT_BODY
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call an earlier assistant turn made (chapter 22)."""

    model_config = STRICT_BODY
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One turn of a conversation. ``developer`` is OpenAI's newer name for ``system``; a
    ``name`` is passed on to the chat template, which may use it or not. Chapter 22: an
    assistant turn may carry ``tool_calls``, and a ``tool`` turn answers one
    (``tool_call_id``). A turn without content (an assistant's that only calls tools) reads
    as empty text."""

    model_config = STRICT_BODY
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The turn as the chat template expects it: role and plain-text content (and the
        calls or the call answered, chapter 22)."""
        text = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content or [])
        turn: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                "content": text}
        if self.name is not None:
            turn["name"] = self.name
        if self.tool_calls:
            turn["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn


class StreamOptions(BaseModel):
    # Other keys are ignored, not refused: they only shape how usage is reported, and no
    # stream depends on them (vLLM's continuous_usage_stats, which guidellm sends, asks for
    # usage on every chunk; here it comes once, on the last, as OpenAI sends it).
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


@dataclass(frozen=True)
class Neutral:
    """What a field OpenAI defines, and this server does not implement, accepts: its neutral
    ``values``, which change nothing (the schema lists them); any other value is refused with
    HTTP 400 naming the field, saying what is accepted (``shown``)."""

    values: tuple[Any, ...]
    shown: str

    def __call__(self, schema: dict[str, Any]) -> None:  # pydantic's json_schema_extra hook
        schema["enum"] = list(self.values)


def _neutral(*values: Any, shown: str) -> Any:
    """A field accepted at its neutral ``values`` only; it defaults to the first."""
    return Field(values[0], json_schema_extra=Neutral(values, shown))


def _same_json(value: Any, neutral: Any) -> bool:
    """JSON equality: ``false`` is not ``0`` (Python's ``False == 0`` is), ``0`` is ``0.0``."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


class _GenerationBody(BaseModel):
    """What chat and completion requests share: the sampling parameters and ``stream``.

    ``None`` (or leaving a field out) means the default. Unknown fields are rejected: a typo
    such as ``max_token`` would otherwise be ignored without a word. Fields that OpenAI defines
    but this server does not implement (:class:`Neutral`) are accepted at their neutral
    value only: :meth:`check_supported` refuses any other, naming the field.
    """

    model_config = STRICT_BODY
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int64 | None = _documented(minimum=1)
    temperature: float | None = _documented(minimum=0)
    top_p: float | None = _documented(exclusiveMinimum=0, maximum=1)
    top_k: Int64 | None = _documented(minimum=-1)  # an extension (vLLM, SGLang); -1, 0: off
    min_p: float | None = _documented(minimum=0, maximum=1)  # an extension
    seed: Seed | None = None
    stop: str | list[str] | None = Field(None, json_schema_extra={
        "anyOf": [{"type": "string", "minLength": 1},
                  {"type": "array", "items": {"type": "string", "minLength": 1}},
                  {"type": "null"}]})
    stop_token_ids: list[TokenId] | None = None  # an extension
    ignore_eos: bool = False  # an extension: benchmarks use it for outputs of known length
    user: str | None = None
    # Chapter 21: the logit adjustments. A bias for an id outside the vocabulary is ignored.
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={
        "propertyNames": {"pattern": "^[0-9]+$"},  # token ids, as JSON keys are strings
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})
    presence_penalty: float | None = _documented(minimum=-2, maximum=2)
    frequency_penalty: float | None = _documented(minimum=-2, maximum=2)
    repetition_penalty: float | None = _documented(exclusiveMinimum=0)  # an extension
    min_tokens: Int64 | None = _documented(minimum=0)  # an extension
    # Choices per prompt: a request each, the prompt computed once (chapter 21)
    n: Int64 = Field(1, json_schema_extra={"minimum": 1, "maximum": MAX_CHOICES})
    # OpenAI's fields that this server accepts at their neutral values only.
    service_tier: str | None = _neutral(None, "auto", "default", shown='"auto" or "default"')
    store: bool | None = _neutral(None, False, shown="false")

    def check_supported(self) -> None:
        """Refuse a value this server does not implement (HTTP 400 naming the field)."""
        for name, field in type(self).model_fields.items():
            rule, value = field.json_schema_extra, getattr(self, name)
            if isinstance(rule, Neutral) and not any(_same_json(value, neutral)
                                                     for neutral in rule.values):
                raise APIError(400, f"{name} must be {rule.shown} or left out; other values "
                                    f"are not supported by this server (got {json.dumps(value)})",
                               name, code="unsupported_value")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logprobs_asked(self) -> int | None:
        """How many top logprobs each token should come with; None: no logprobs."""
        return None

    def prompt_logprobs_asked(self) -> int | None:
        """The same for the prompt's tokens, which only ``echo`` returns."""
        return None

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
        """The engine's :class:`SamplingParams`; a value it rejects becomes HTTP 400."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise APIError(400, f"n must be an integer in [1, {MAX_CHOICES}], got {self.n}", "n")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        values: dict[str, Any] = {
            "temperature": DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            # 0 turns top-k off, as in vLLM and transformers; the engine's word for it is -1
            "top_k": -1 if self.top_k in (None, 0) else self.top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "stop": stop,  # after stop_token_ids: an error names the longer one first
            "logit_bias": _token_biases(self.logit_bias or {}),
            "min_tokens": self.min_tokens or 0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None
            else self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "logprobs": self.logprobs_asked(),
            "prompt_logprobs": self.prompt_logprobs_asked(),
        }
        try:
            return SamplingParams(**values)
        except (TypeError, ValueError) as exc:  # the engine's own range checks, one place
            param = next((name for name in values if str(exc).startswith(name)), None)
            raise APIError(400, str(exc), param) from None


def _token_biases(biases: dict[str, float]) -> list[tuple[int, float]]:
    """``logit_bias``'s JSON keys (token ids written as strings) as ``(id, bias)`` pairs."""
    if bad := [key for key in biases if not re.fullmatch(r"[0-9]+", key)]:
        raise APIError(400, f"logit_bias: keys must be token ids (decimal integers as strings), "
                            f"got {bad[0]!r}", "logit_bias")
    return [(int(key), bias) for key, bias in biases.items()]


class ChatCompletionRequest(_GenerationBody):
    """The body of ``POST /v1/chat/completions``."""

    # top_logprobs above 0 needs logprobs: true (chapter 21), as the schema says too
    model_config = ConfigDict(**STRICT_BODY, json_schema_extra={
        "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
               "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}})
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = _documented(minimum=1)  # OpenAI's newer max_tokens
    logprobs: bool | None = None  # chapter 21
    top_logprobs: Int64 | None = _documented(minimum=0, maximum=MAX_TOP_LOGPROBS)
    # Chapter 22: checked by minisgl.server.tools and minisgl.server.structured
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing: let it pass
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= (self.top_logprobs or 0) <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                f"got {self.top_logprobs}", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# A prompt: text, token ids, or (OpenAI's batch form) a list of either, one choice each.
Prompt = str | list[TokenId]


def prompt_schema(max_token_id: int = MAX_JSON_INT) -> dict[str, Any]:
    """The schema of ``prompt``: non-empty text or token ids, or a non-empty list of either.
    The server knows its vocabulary (:func:`~minisgl.server.api_server.create_app`), so the
    schema it serves gives the largest token id the scheduler accepts."""
    token_ids = {"type": "array", "minItems": 1,
                 "items": {"type": "integer", "minimum": 0, "maximum": max_token_id}}
    return {"anyOf": [{"type": "string", "minLength": 1}, token_ids,
                      {"type": "array", "minItems": 1,
                       "items": {"type": "string", "minLength": 1}},
                      {"type": "array", "minItems": 1, "items": token_ids}]}


class CompletionRequest(_GenerationBody):
    """The body of ``POST /v1/completions``: a prompt as text or as token ids, or a list of
    prompts (each answered by its own choice, ``index`` in the order given)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        json_schema_extra=prompt_schema())
    # The number of top tokens, or null: not a switch, as in a chat request (chapter 21).
    logprobs: Int64 | None = _documented(minimum=0, maximum=MAX_COMPLETION_LOGPROBS)
    best_of: Int64 | None = _neutral(None, 1, shown="1")
    echo: bool = False  # chapter 21: the prompt comes back before the completion
    suffix: str | None = _neutral(None, "", shown='null or ""')
    response_format: dict[str, Any] | None = None  # chapter 22 (minisgl.server.structured)

    def logprobs_asked(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise APIError(400, f"logprobs must be null or an integer in [0, "
                                f"{MAX_COMPLETION_LOGPROBS}], got {self.logprobs}", "logprobs")
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        # Echoed, the prompt comes back from the engine with its logprobs (kept only if
        # asked): one path whether the prompt was text or token ids.
        return (self.logprobs or 0) if self.echo else None

    def prompts(self) -> list[Prompt]:
        """The prompts, one per choice; each must be non-empty (HTTP 400 otherwise)."""
        one = isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int)
        prompts: list[Prompt] = [self.prompt] if one else list(self.prompt)  # type: ignore
        for i, prompt in enumerate(prompts):
            if not prompt:
                where = "prompt" if one else f"prompt.{i}"
                raise APIError(400, f"{where} is empty: it needs at least one character or "
                                    "token", where)
        return prompts
