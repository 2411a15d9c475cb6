"""Messages the scheduler receives (the *backend*: the process that owns the model).

Two kinds arrive, both from the tokenizer worker:

- :class:`UserRequest`: a new request, already turned into token ids;
- :class:`~minisgl.message.tokenizer.AbortRequest`: drop a request. It is defined with the
  tokenizer's messages because the API server sends it there first; the tokenizer forwards it
  unchanged, behind any request of the same uid it is still tokenizing, so the scheduler can
  never see the abort before the request. It belongs to both families.

Many messages can travel in one frame (``put_many`` on the queues of
``minisgl.utils.queues``): the tokenizer sends everything it tokenized in one go, and the
scheduler reads them all before its next step.
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
