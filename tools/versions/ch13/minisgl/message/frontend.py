"""Messages the API server receives: the text of each request, piece by piece.

The detokenizer sends one :class:`UserReply` per generated token. The API server finds the
waiting HTTP request by ``uid`` and either streams ``delta`` to the client at once or appends
it to the full answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl.message.utils import Message, register_wire_type

if TYPE_CHECKING:
    from minisgl.core import FinishReason


class FrontendMessage(Message, family=True):
    """Everything the API server (the frontend) receives."""


@register_wire_type
@dataclass(frozen=True)
class TokenUsage:
    """How many tokens a finished request used (the OpenAI ``usage`` object).

    It rides on the last message of a request only. Not a message itself: a value that two
    messages carry (:class:`~minisgl.message.tokenizer.DetokenizeRequest` and
    :class:`UserReply`).
    """

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class UserReply(FrontendMessage):
    """New text for request ``uid``: detokenizer -> API server, one per generated token.

    Attributes:
        uid: the request, as the API server numbered it.
        delta: the text added since the previous reply; empty when the last token ended in
            the middle of a multi-byte character (the detokenizer holds it back until the
            character is complete).
        finish_reason: None while the request runs; why it ended on its last reply
            (``"stop"``, ``"length"``).
        usage: the request's token counts, on the last reply only.
    """

    uid: int
    delta: str = ""
    finish_reason: FinishReason | None = None
    usage: TokenUsage | None = None

    @property
    def finished(self) -> bool:
        """Whether this is the request's last reply."""
        return self.finish_reason is not None
