"""Messages the tokenizer workers receive: text to tokenize, and tokens to turn back into text.

The **tokenizer** receives :class:`TokenizeRequest` and :class:`AbortRequest` from the API
server. The **detokenizer** receives a :class:`DetokenizeRequest` per generated token from the
scheduler, and every :class:`AbortRequest` the scheduler acted on, as the last word on that
request. Each worker has its own family, so each queue accepts exactly what its process
handles. Chapter 13 tells the story.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minisgl.core import SamplingParams
from minisgl.message.backend import BackendMessage
from minisgl.message.frontend import RequestError, TokenUsage
from minisgl.message.utils import Message

if TYPE_CHECKING:
    from minisgl.core import FinishReason


class TokenizerMessage(Message, family=True):
    """Everything the tokenizer worker receives (from the API server)."""


class DetokenizerMessage(Message, family=True):
    """Everything the detokenizer worker receives (from the scheduler)."""


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
            scheduler's :class:`~minisgl.message.UserRequest`).
    """

    uid: int
    sampling_params: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    strict_max_tokens: bool = False

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
    """

    uid: int
    next_token: int
    finish_reason: FinishReason | None = None
    usage: TokenUsage | None = None
    # Set on a request's first token only: a field at its default is not sent, so
    # every later token costs exactly what it did.
    stop: tuple[str, ...] = ()
    prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        """Whether this is the request's last token."""
        return self.finish_reason is not None
