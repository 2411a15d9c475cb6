"""Messages the API server receives: the text of each request, piece by piece.

The detokenizer sends one :class:`UserReply` per generated token; the API server finds the
waiting HTTP request by ``uid``. A request that fails ends with a reply that carries a
:class:`RequestError`: what the client is told, and with which HTTP status. Chapter 13 tells
the story; chapter 16 adds the errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from minisgl.message.utils import Message, register_wire_type

if TYPE_CHECKING:
    from minisgl.core import FinishReason


class FrontendMessage(Message, family=True):
    """Everything the API server (the frontend) receives."""


@register_wire_type
@dataclass(frozen=True)
class TokenUsage:
    """How many tokens a finished request used (the OpenAI ``usage`` object).

    Not a message itself: a value on the last message of a request
    (:class:`~minisgl.message.tokenizer.DetokenizeRequest` and :class:`UserReply`).
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
    """

    uid: int
    delta: str = ""
    finish_reason: FinishReason | Literal["error"] | None = None
    usage: TokenUsage | None = None
    error: RequestError | None = None

    @property
    def finished(self) -> bool:
        """Whether this is the request's last reply."""
        return self.finish_reason is not None

    @classmethod
    def failure(cls, uid: int, error: RequestError) -> UserReply:
        """The last reply of request ``uid``, which ended in ``error``."""
        return cls(uid, finish_reason="error", error=error)
