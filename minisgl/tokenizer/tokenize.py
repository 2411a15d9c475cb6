"""Turning a request into token ids: the tokenizer worker's whole job.

``text`` is ``tokenizer.encode(text)``, what the offline ``LLM`` does, so both feed the model
the same ids; ``messages`` is rendered by the chat template and tokenized in the same call (an
``encode`` of the rendered string would double the special tokens); ``input_ids`` pass through.
No process and no queue here: the worker (``server.py``) feeds it messages. Chapter 14 tells the
story.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from minisgl.message import TokenizeRequest, UserRequest
from minisgl.utils.hf import resolve_model_path

VERY_LARGE = int(1e30)  # transformers' own "no limit" for model_max_length


def load_tokenizer(model_path: str | os.PathLike[str]) -> Any:
    """The checkpoint's tokenizer (a ``transformers`` tokenizer), as ``LLM`` loads it."""
    path = resolve_model_path(model_path)  # first: a bad path fails before the slow import
    from transformers import AutoTokenizer  # imported here: importing transformers is slow

    tokenizer = AutoTokenizer.from_pretrained(path)
    # The scheduler enforces the context and tells the client; the tokenizer's own limit would
    # only log "Token indices sequence length is longer than ..." for every long prompt.
    tokenizer.model_max_length = VERY_LARGE
    return tokenizer


class TokenizeManager:
    """Turns :class:`TokenizeRequest` messages into :class:`UserRequest` messages.

    Args:
        tokenizer: a ``transformers`` tokenizer (:func:`load_tokenizer`).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def tokenize(self, request: TokenizeRequest) -> UserRequest:
        """The scheduler's request for ``request``: the same uid and sampling parameters,
        the prompt as token ids.

        Raises:
            ValueError: the prompt has no tokens (an empty string), or the chat template
                rejects the conversation.
        """
        if request.text is not None:
            ids = self.tokenizer.encode(request.text)
        elif request.messages is not None:
            ids = self.apply_chat_template(request.messages, request.tools)
        else:
            ids = request.input_ids
        if not ids:
            raise ValueError(f"request {request.uid}: the prompt has no tokens")
        return UserRequest(request.uid, list(ids), request.sampling_params,
                           strict_max_tokens=request.strict_max_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids of ``messages`` rendered by the chat template, ending with an open
        assistant turn; ``tools``: the functions the template presents (chapter 22)."""
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                                     add_generation_prompt=True)
        except Exception as exc:  # jinja's errors (an unknown role, a template's own raise)
            raise ValueError(f"the chat template cannot render these messages: {exc}") from exc
        # transformers 4 returns the ids; transformers 5 a BatchEncoding holding them.
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return list(ids)
