"""Messages the scheduler receives (the *backend*: the process that owns the model).

Both kinds come from the tokenizer worker: :class:`UserRequest`, a new request as token ids, and
:class:`~minisgl.message.tokenizer.AbortRequest`, defined with the tokenizer's messages because
the API server sends it there first; forwarded behind any request of its uid, it never reaches
the scheduler before that request. Chapter 13 tells the story.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.core import SamplingParams
from minisgl.message.utils import Message


class BackendMessage(Message, family=True):
    """Everything the scheduler receives."""


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
