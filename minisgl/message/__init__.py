"""The messages the engine's processes send each other (``utils`` holds their serializer).

One request travels through four processes; each arrow is a ZMQ queue
(``minisgl.utils.queues``) carrying one family of messages::

    API server --TokenizeRequest, AbortRequest--> tokenizer
    tokenizer  --UserRequest, AbortRequest------> scheduler
    scheduler  --DetokenizeRequest--------------> detokenizer
    detokenizer --UserReply---------------------> API server

Each process receives one family, so each queue accepts exactly what its process handles; the
detokenizer also receives every :class:`AbortRequest` the scheduler acted on, as the last word
on that request. A request that fails ends with a :class:`RequestError` on its last message.
Chapter 13 tells the story; chapter 16 adds the errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from minisgl.core import FinishReason, SamplingParams, TokenLogprobs
from minisgl.message.utils import (Message, SerializationError, dumps, loads, register_wire_type,
                                   registered_types)

__all__ = [
    "AbortRequest", "BackendMessage", "DetokenizeRequest", "DetokenizerMessage",
    "FrontendMessage", "Message", "RequestError", "SerializationError", "TextLogprobs",
    "TokenUsage", "TokenizeRequest", "TokenizerMessage", "UserReply", "UserRequest", "dumps",
    "loads", "register_wire_type", "registered_types", "server_error",
]


class TokenizerMessage(Message, family=True):
    """Everything the tokenizer worker receives (from the API server)."""


class BackendMessage(Message, family=True):
    """Everything the scheduler receives."""


class DetokenizerMessage(Message, family=True):
    """Everything the detokenizer worker receives (from the scheduler)."""


class FrontendMessage(Message, family=True):
    """Everything the API server (the frontend) receives."""


@register_wire_type
@dataclass(frozen=True)
class TokenUsage:
    """How many tokens a finished request used (the OpenAI ``usage`` object).

    Not a message itself: a value on the last message of a request
    (:class:`DetokenizeRequest` and :class:`UserReply`).
    """

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@register_wire_type
@dataclass(frozen=True)
class RequestError:
    """Why a request failed, as the client will be told.

    A worker that cannot serve a request sends this along the request's normal path, as its
    last message, so that every process on the way forgets the request and the client hears
    why. The fields are OpenAI's error object, plus the HTTP status.

    Attributes:
        message: what went wrong, for a person.
        status: the HTTP status: 400 for a request that can never be served (its prompt is
            too long), 500 for a failure of the server's own, 503 while it cannot serve.
        kind: OpenAI's error ``type`` (``"invalid_request_error"``, ``"server_error"`` ...).
        param: the request field at fault, if one is.
        code: a machine-readable code, e.g. ``"context_length_exceeded"``.
    """

    message: str
    status: int = 400
    kind: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


def server_error(what: str, exc: BaseException) -> RequestError:
    """The error a request gets when a worker fails while serving it (HTTP 500)."""
    return RequestError(f"{what}: {type(exc).__name__}: {exc}", status=500, kind="server_error")


@dataclass(frozen=True)
class TokenizeRequest(TokenizerMessage):
    """A new request as the API server received it: API server -> tokenizer.

    Exactly one of ``text``, ``input_ids`` and ``messages`` is set: a completion prompt, a
    prompt already tokenized by the client, or a chat conversation that the tokenizer renders
    with the model's chat template.

    Attributes:
        uid: the request's id, unique while the API server runs.
        sampling_params: how to sample and when to stop (validated by the API server).
        text: a completion prompt.
        input_ids: a completion prompt as token ids.
        messages: a chat conversation, ``[{"role": "user", "content": "..."}, ...]``.
        strict_max_tokens: the client chose ``max_tokens`` (passed on to the
            scheduler's :class:`UserRequest`).
        tools: with ``messages``, the functions the chat template shows the model
            (OpenAI's ``tools``; chapter 22).
    """

    uid: int
    sampling_params: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    strict_max_tokens: bool = False
    tools: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("text", "input_ids", "messages")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"TokenizeRequest {self.uid} needs exactly one of text, input_ids "
                             f"and messages; got {given or 'none'}")


@dataclass(frozen=True)
class AbortRequest(TokenizerMessage, BackendMessage, DetokenizerMessage):
    """Drop request ``uid``: API server -> tokenizer -> scheduler, forwarded unchanged.

    Going through the tokenizer keeps it behind the request it cancels: sent straight to the
    scheduler, it could overtake a request still being tokenized and cancel nothing. The
    detokenizer sends one to the scheduler when a stop string ends a request; the scheduler
    passes each abort that dropped a request on to the detokenizer, after its last token.

    A worker that cannot serve a request sends an abort that carries ``error``; the scheduler
    passes it on even when it had nothing to drop, and the detokenizer turns it into the
    request's last reply.
    """

    uid: int
    error: RequestError | None = None  # why a worker dropped the request


@dataclass(frozen=True)
class UserRequest(BackendMessage):
    """A new request for the scheduler: tokenizer -> scheduler.

    Attributes:
        uid: the request's id, chosen by the API server; every reply carries it back.
        input_ids: the prompt's token ids (chat template applied, if any).
        sampling_params: how to sample and when to stop.
        strict_max_tokens: the client chose ``max_tokens``; if the prompt leaves
            less room, refuse the request (HTTP 400) instead of lowering it.
    """

    uid: int
    input_ids: list[int]
    sampling_params: SamplingParams
    strict_max_tokens: bool = False


@dataclass(frozen=True)
class DetokenizeRequest(DetokenizerMessage):
    """One generated token of request ``uid``: scheduler -> detokenizer.

    Attributes:
        uid: the request.
        next_token: the token id the request just generated.
        finish_reason: None while the request runs; on its last token, why it ended
            (``"stop"``: end of sequence or a stop token; ``"length"``: ``max_tokens``).
        usage: the request's token counts, on its last token only.
        stop: the request's stop strings, on its first token only (the
            detokenizer applies them; the scheduler works on tokens).
        prompt_tokens: the prompt's length, on its first token only, for the
            usage of a request that a stop string ends (the scheduler's usage never comes).
        logprobs: the token's logprobs, when the request asked for them (chapter 21).
        prompt_ids, prompt_logprobs: on the first token of a request that asked for its
            prompt's logprobs (chapter 21), the prompt and the logprobs of its tokens but the
            first.
    """

    uid: int
    next_token: int
    finish_reason: FinishReason | None = None
    usage: TokenUsage | None = None
    # Set on a request's first token only: a field at its default is not sent, so
    # every later token costs exactly what it did.
    stop: tuple[str, ...] = ()
    prompt_tokens: int = 0
    logprobs: TokenLogprobs | None = None
    prompt_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    @property
    def finished(self) -> bool:
        """Whether this is the request's last token."""
        return self.finish_reason is not None


@register_wire_type
@dataclass(frozen=True)
class TextLogprobs:
    """A generated token as text, its logprob, and the most likely tokens in its place (text
    and logprob, most likely first): what OpenAI's ``logprobs`` show (chapter 21)."""

    token: str
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class UserReply(FrontendMessage):
    """New text for request ``uid``: detokenizer -> API server, one per generated token.

    Attributes:
        uid: the request, as the API server numbered it.
        delta: the text added since the previous reply; empty when the last token ended in
            the middle of a multi-byte character (the detokenizer holds it back until the
            character is complete).
        finish_reason: None while the request runs; why it ended on its last reply
            (``"stop"``, ``"length"`` or ``"error"``).
        usage: the request's token counts, on the last reply only.
        error: why the request failed, on the last reply of a request that ended
            in an error (``finish_reason`` is then ``"error"``).
        logprobs: the reply's token with its logprobs, as text, when the request asked for
            them (chapter 21).
        prompt_text, prompt_logprobs: on the first reply of a request that asked for its
            prompt's logprobs, the prompt as text, and each of its tokens with its logprobs
            (none for the first).
    """

    uid: int
    delta: str = ""
    finish_reason: FinishReason | Literal["error"] | None = None
    usage: TokenUsage | None = None
    error: RequestError | None = None
    logprobs: TextLogprobs | None = None
    prompt_text: str = ""
    prompt_logprobs: tuple[TextLogprobs, ...] = ()

    @property
    def finished(self) -> bool:
        """Whether this is the request's last reply."""
        return self.finish_reason is not None

    @classmethod
    def failure(cls, uid: int, error: RequestError) -> UserReply:
        """The last reply of request ``uid``, which ended in ``error``."""
        return cls(uid, finish_reason="error", error=error)
