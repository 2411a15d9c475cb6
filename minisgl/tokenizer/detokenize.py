"""Turning a stream of tokens back into text, a piece per token: the detokenizer's job.

A token decoded alone can end halfway through a character (U+FFFD, "�") or lose a leading
space. :class:`DecodeStream` decodes a window that starts one piece back and holds back text
ending in "�", so its pieces, joined, are always the full decode up to the last complete
character. :class:`StopMatcher` cuts the text at the request's stop strings.
:class:`DetokenizeManager` keeps one :class:`RequestText` per live request and turns each
:class:`~minisgl.message.DetokenizeRequest` into a :class:`~minisgl.message.UserReply`.
Chapter 14 tells the story; chapter 16 adds the error replies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from minisgl.core import TokenLogprobs
from minisgl.message import (AbortRequest, DetokenizeRequest, DetokenizerMessage, RequestError,
                             TextLogprobs, TokenUsage, UserReply, server_error)
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

Decode = Callable[[Sequence[int]], str]  # token ids -> text, e.g. a tokenizer's decode

# What a UTF-8 decoder puts in place of bytes that are not (yet) a whole character.
REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DecodeStream:
    """The text of one request's tokens, a piece at a time, never a broken character.

    Two offsets into ``token_ids`` do the work:

    - ``read_offset``: the tokens whose text has been returned;
    - ``prefix_offset``: where the decode window starts, one returned piece back: the tokens
      before ``read_offset`` that give the new ones their context.

    Both offsets only ever sit at a character boundary (the text up to them did not end in
    U+FFFD), which is what makes the pieces add up to the full decode.
    """

    decode: Decode
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is unfinished)."""
        self.token_ids.append(token_id)
        prefix_text = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self.decode(self.token_ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The text not returned yet, broken last character and all: the stream has ended."""
        prefix_text = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self.decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]


@dataclass
class StopMatcher:
    """Cuts a stream of text at the first of its stop strings.

    A piece may complete a stop string that began pieces ago, so the matcher holds back the end
    of the text that begins some stop string until the next piece rules it out. Nothing it has
    released can be part of a stop string.
    """

    stop: tuple[str, ...]
    held: str = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return what may be sent, and whether a stop string was reached.

        Once a stop string is reached the returned text is everything before it, and the
        stream is over: what follows it is dropped.
        """
        text = self.held + text
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.held = ""
            return text[:min(found)], True
        keep = self._partial_match(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The text held back: the stream has ended without reaching a stop string."""
        held, self.held = self.held, ""
        return held

    def _partial_match(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


@dataclass
class RequestText:
    """What the detokenizer keeps for one request.

    Attributes:
        stream: the incremental decoder of its tokens.
        stop: its stop strings, applied to the decoded text.
        prompt_tokens: its prompt's length (for the usage when a stop string ends it).
        num_tokens: tokens received so far.
        stopped: a stop string has ended its text. The request is a *tombstone* from then on:
            the tokens the scheduler had generated before it heard of the stop are still on
            their way, and are dropped, until its last message arrives.
    """

    stream: DecodeStream
    stop: StopMatcher
    prompt_tokens: int = 0
    num_tokens: int = 0
    stopped: bool = False


class DetokenizeManager:
    """Every live request's text state; turns tokens into replies for the API server.

    Args:
        tokenizer: a ``transformers`` tokenizer; its ``decode`` (special tokens kept) is the
            one ``LLM`` uses, so the server's text equals ``LLM``'s.

    Attributes:
        states: uid -> :class:`RequestText`, for every request that has sent a token and not
            ended (tombstones included).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.decode: Decode = tokenizer.decode
        self.states: dict[int, RequestText] = {}

    def detokenize(self, message: DetokenizeRequest) -> UserReply | None:
        """The reply for one token of a request, or None when the token is to be dropped.

        A reply that finishes the request (``finish_reason`` set) while ``message`` does not
        means a stop string ended it: the caller must tell the scheduler to stop generating.
        """
        state = self.states.get(message.uid)
        if state is None:  # the request's first token carries what we need to know about it
            state = RequestText(DecodeStream(self.decode), StopMatcher(message.stop),
                                prompt_tokens=message.prompt_tokens)
            self.states[message.uid] = state
        if message.finished:  # the scheduler's last word on the request
            del self.states[message.uid]
        if state.stopped:  # a tombstone: its text has ended already
            return None
        state.num_tokens += 1
        # Like LLM: an end-of-sequence or stop token ends the request; it is not text.
        text = "" if message.finish_reason == "stop" else state.stream.push(message.next_token)
        if message.finished:
            text += state.stream.flush()
        text, reached_stop = state.stop.feed(text)
        extra = self._logprobs_as_text(message)  # chapter 21
        if reached_stop:
            state.stopped = True  # a tombstone, unless deleted above
            state.stream = DecodeStream(self.decode)  # its tokens are not needed any more
            return UserReply(message.uid, text, "stop",
                             TokenUsage(state.prompt_tokens, state.num_tokens), **extra)
        if message.finished:
            return UserReply(message.uid, text + state.stop.flush(), message.finish_reason,
                             message.usage, **extra)
        return UserReply(message.uid, text, **extra)

    def _logprobs_as_text(self, message: DetokenizeRequest) -> dict[str, Any]:
        """The message's logprobs for a reply, each token id decoded on its own (as vLLM
        shows them), and the prompt as text when its logprobs are there."""
        extra: dict[str, Any] = {}
        if message.logprobs is not None:
            extra["logprobs"] = self._text(message.next_token, message.logprobs)
        if message.prompt_ids:
            extra["prompt_text"] = self.decode(list(message.prompt_ids))
            extra["prompt_logprobs"] = (TextLogprobs(self.decode(list(message.prompt_ids[:1])),
                                                     None),) + tuple(
                self._text(t, lp) for t, lp in zip(message.prompt_ids[1:],
                                                   message.prompt_logprobs, strict=True))
        return extra

    def _text(self, token: int, logprobs: TokenLogprobs) -> TextLogprobs:
        top = tuple((self.decode([t]), logprob) for t, logprob in logprobs.top)
        return TextLogprobs(self.decode([token]), logprobs.logprob, top)

    def abort(self, uid: int, error: RequestError | None = None) -> UserReply | None:
        """Forget request ``uid``: the scheduler dropped it, and will send nothing more.

        When a worker dropped it because of ``error``, returns the request's last reply, which
        carries the error, unless a stop string had ended its text already: that client has
        its last reply.
        """
        state = self.states.pop(uid, None)
        if error is None or (state is not None and state.stopped):
            return None
        return UserReply.failure(uid, error)

    def fail(self, message: DetokenizeRequest, exc: Exception) -> UserReply:
        """Decoding ``message`` raised. The request ends here, with an error.

        Its state becomes a tombstone (like a request a stop string ended) until the
        scheduler's last word on it, so that the tokens still on their way are dropped; the
        caller tells the scheduler to stop generating.
        """
        logger.error("request %d: the detokenizer failed", message.uid, exc_info=exc)
        if message.finished:
            self.states.pop(message.uid, None)
        else:
            self.states[message.uid] = RequestText(DecodeStream(self.decode), StopMatcher(()),
                                                   stopped=True)
        return UserReply.failure(message.uid, server_error("the detokenizer failed", exc))

    def process(self, messages: list[DetokenizerMessage]
                ) -> tuple[list[UserReply], list[AbortRequest]]:
        """Handle what the scheduler sent, in order.

        Returns the replies for the API server, and the aborts for the scheduler: one for each
        request that a stop string (or a decoding failure) has just ended, which the scheduler
        would otherwise run to its ``max_tokens`` for nothing.
        """
        replies: list[UserReply] = []
        aborts: list[AbortRequest] = []
        for message in messages:
            if isinstance(message, AbortRequest):  # the scheduler's last word on a request
                reply = self.abort(message.uid, message.error)
            else:
                try:
                    reply = self.detokenize(message)
                except Exception as exc:  # noqa: BLE001 - fail it, serve the others
                    reply = self.fail(message, exc)
                if reply is not None and reply.finished and not message.finished:
                    aborts.append(AbortRequest(message.uid))
            if reply is not None:
                replies.append(reply)
        return replies, aborts
