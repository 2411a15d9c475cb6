"""The OpenAI-compatible HTTP API, and the frontend state that ties requests to their replies.

The API server is one asyncio event loop (FastAPI on uvicorn) and two ZMQ queues: it pushes a
:class:`~minisgl.message.TokenizeRequest` to a tokenizer worker for every HTTP request, and it
pulls :class:`~minisgl.message.UserReply` messages (new text) from the detokenizer for all of
them at once. The module has four parts, in this order:

1. the request bodies, as pydantic models: a malformed body is answered with HTTP 400 and an
   OpenAI-style error before anything reaches a worker;
2. :class:`FrontendManager`: numbers requests (the *uid*), sends each to tokenizer
   ``uid % N``, and runs the one *listener* task that reads every reply and hands it to the
   request it belongs to (a buffer and an :class:`asyncio.Event` per uid);
3. the response bodies and the Server-Sent Events (SSE) stream: ``data: {json}`` chunks,
   ``data: [DONE]`` at the end;
4. the routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
   ``GET /health`` and ``GET /metrics``, built by :func:`create_app`.

A streaming client that disconnects makes Starlette cancel the stream; the cancellation turns
into an :class:`~minisgl.message.AbortRequest`, so the scheduler stops generating for nobody.

Chapter 16 makes every request end, and end cleanly, whatever happens: a client that
disconnects while it waits for a whole answer, a prompt the workers refuse (answered with an
OpenAI error and its status, streamed or not), a worker that fails or dies, a client that
reads more slowly than the engine writes (:mod:`minisgl.server.lifecycle`), the server
shutting down. ``/metrics`` shows what the frontend still holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortRequest,
    FrontendMessage,
    RequestError,
    SerializationError,
    TokenizeRequest,
    TokenizerMessage,
    TokenUsage,
    UserReply,
)
from minisgl.server.lifecycle import (
    DEFAULT_REPLY_BUFFER_SIZE,
    DEFAULT_SLOW_READER_TIMEOUT_S,
    SHUTTING_DOWN,
    ClientDisconnected,
    ReplyBuffer,
    slow_reader_error,
    unavailable_error,
    wait_or_disconnect,
)
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

# OpenAI's documented default for /v1/completions. A chat request without a limit may in
# principle run to the end of the context; 1024 tokens keeps a forgotten limit from holding a
# request slot for minutes, and the scheduler lowers it further where the context is shorter.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 1024
# OpenAI's default temperature: a request that does not ask for greedy decoding samples.
DEFAULT_TEMPERATURE = 1.0


# =========================================================================== errors
# --8<-- [start:api_error]
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
        """The HTTP answer to a request that ended with ``error`` (chapter 16). Workers call
        the prompt ``"prompt"``; for a chat request, the prompt is ``"messages"``."""
        param = prompt_param if error.param == "prompt" else error.param
        return cls(error.status, error.message, param, error.kind, error.code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def error_body(error: RequestError, prompt_param: str = "prompt") -> dict[str, Any]:
    """OpenAI's error object for ``error``: the body of an error response or SSE event."""
    return APIError.of(error, prompt_param).body()


def _validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """pydantic's error list as one readable message naming the field(s).

    Chapter 16: a body that is not JSON at all is said so (pydantic locates that error at a
    character offset, which is no parameter).
    """
    parts, param = [], None
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "not valid JSON")
            offset = error.get("loc", ("body", "?"))[-1]
            return APIError(400, f"the body is not valid JSON: {reason} (at character "
                                 f"{offset})")
        where = ".".join(str(p) for p in error.get("loc", ()) if not _union_tag(p))
        if param is None or len(where) > len(param):  # the most precise location
            param = where or None
        parts.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return APIError(400, "; ".join(parts) or "invalid request body", param)


def _union_tag(part: object) -> bool:
    """A part of an error's location that is no field: ``"body"``, or the member of a union
    pydantic tried (``prompt: str | list[int]`` fails at ``prompt.str`` and at
    ``prompt.list[constrained-int].1``)."""
    return part == "body" or (isinstance(part, str) and (
        "[" in part or "-" in part or part in ("str", "int", "float", "bool", "list", "dict")))
# --8<-- [end:api_error]


# =========================================================================== request bodies
# --8<-- [start:body_types]
# Chapter 16: integers must fit the wire (msgpack packs at most 64 bits); a larger value is the
# client's mistake (HTTP 400 naming the field), not a failure to serialize (500).
TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# Chapter 16: strict types. Lax pydantic would take "12" for 12 and "yes" for true; OpenAI's API
# refuses a value of the wrong JSON type, and so does this one (HTTP 400 naming the field).
STRICT_BODY = ConfigDict(extra="forbid", strict=True)
# --8<-- [end:body_types]


# --8<-- [start:request_models]
class TextPart(BaseModel):
    """One part of a message's content given as a list (OpenAI's multi-part form)."""

    model_config = STRICT_BODY
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn of a conversation."""

    model_config = STRICT_BODY
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        """The turn as the chat template expects it: role and plain-text content."""
        text = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)
        return {"role": self.role, "content": text}


class StreamOptions(BaseModel):
    model_config = STRICT_BODY
    include_usage: bool = False


class _GenerationBody(BaseModel):
    """What chat and completion requests share: the sampling parameters and ``stream``.

    ``None`` (or leaving a field out) means the default. Unknown fields are rejected: a typo
    such as ``max_token`` would otherwise be ignored without a word. Fields that OpenAI defines
    but this server does not implement are accepted only at their neutral value.
    """

    model_config = STRICT_BODY
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None  # an extension (vLLM, SGLang)
    min_p: float | None = None  # an extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # an extension
    ignore_eos: bool = False  # an extension: benchmarks use it for outputs of known length
    n: Int64 = 1
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
    max_completion_tokens: Int64 | None = None  # OpenAI's newer name for max_tokens


class CompletionRequest(_GenerationBody):
    """The body of ``POST /v1/completions``: a prompt as text or as token ids."""

    prompt: str | list[TokenId]
# --8<-- [end:request_models]


# =========================================================================== the frontend
class _Outbox(Protocol):
    async def put(self, message: TokenizerMessage) -> None: ...


class _Inbox(Protocol):
    async def get(self) -> FrontendMessage: ...


# --8<-- [start:frontend_state]
@dataclass
class FrontendStats:
    """Counters the frontend keeps for ``/metrics`` (totals since start)."""

    submitted: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0  # chapter 16: ended with an error (a worker's, or the frontend's own)
    slow_readers: int = 0  # chapter 16: cut off for reading too slowly


class FrontendManager:
    """Sends requests to the tokenizer workers and routes every reply to its request.

    Many HTTP requests are in flight at once, but replies come back through a single queue.
    Each request gets a *uid* and a :class:`~minisgl.server.lifecycle.ReplyBuffer`; one
    listener task reads the queue and pushes each reply into its uid's buffer, which wakes that
    request's reader, waiting on its own buffer only.

    Chapter 16 makes sure every request ends, and frees what it holds, however it ends:

    - :meth:`replies` owns a request's state. It frees it when it hands out the last reply,
      and its ``finally`` frees it, aborting the request, when the reader stops early: it
      breaks out and closes the generator (every reader in this module does), its task is
      cancelled, or it raises;
    - a reader that stays behind longer than ``slow_reader_timeout_s``, or lets
      ``reply_buffer_size`` replies pile up, has its request ended with an error (which also
      catches a reader that walked away without closing its generator);
    - a *watchdog* task checks ``health`` a few times a second: once a worker process has
      died, every waiting request ends with an error and new ones are refused (HTTP 503),
      instead of waiting for replies that will never come. So does a listener that stopped.

    Args:
        tokenizers: one outgoing queue per tokenizer worker; request ``uid`` goes to
            ``tokenizers[uid % len(tokenizers)]``, and so does its abort, which therefore can
            never overtake it.
        inbox: the queue the detokenizer sends every :class:`UserReply` to.
        reply_buffer_size: the most replies held for one reader.
        slow_reader_timeout_s: the longest a reader may stay behind.
        health: returns None while every worker runs, else what is wrong; None: not checked.

    Use it from one event loop. :meth:`start` (or the first :meth:`submit`) starts the listener
    and the watchdog; it has to run inside the loop, which is why the app builds the manager in
    its lifespan.
    """

    def __init__(self, tokenizers: Sequence[_Outbox], inbox: _Inbox, *,
                 reply_buffer_size: int = DEFAULT_REPLY_BUFFER_SIZE,
                 slow_reader_timeout_s: float = DEFAULT_SLOW_READER_TIMEOUT_S,
                 health: Callable[[], str | None] | None = None) -> None:
        if not tokenizers:
            raise ValueError("FrontendManager needs at least one tokenizer queue")
        if isinstance(reply_buffer_size, bool) or not isinstance(reply_buffer_size, int) \
                or reply_buffer_size < 1:
            raise ValueError(f"reply_buffer_size must be an integer >= 1, "
                             f"got {reply_buffer_size!r}")
        if not (isinstance(slow_reader_timeout_s, (int, float))
                and math.isfinite(slow_reader_timeout_s) and slow_reader_timeout_s > 0):
            raise ValueError(f"slow_reader_timeout_s must be a number of seconds > 0, "
                             f"got {slow_reader_timeout_s!r}")
        self._tokenizers = list(tokenizers)
        self._inbox = inbox
        self.reply_buffer_size = reply_buffer_size
        self.slow_reader_timeout_s = float(slow_reader_timeout_s)
        self._health = health
        self._next_uid = 0
        self._pending: dict[int, ReplyBuffer] = {}
        self._listener: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # abort sends still in flight
        self.unavailable: RequestError | None = None  # set once the frontend cannot serve
        self.stats = FrontendStats()
    # --8<-- [end:frontend_state]

    @classmethod
    def connect(cls, tokenizer_addrs: Sequence[str], inbox_addr: str,
                **options: Any) -> FrontendManager:
        """A manager on real ZMQ queues: it binds ``inbox_addr`` and connects to each
        tokenizer's inbox. ``options`` are the constructor's keyword arguments."""
        from minisgl.utils.mp import ZmqAsyncPullQueue, ZmqAsyncPushQueue

        inbox = ZmqAsyncPullQueue(inbox_addr, FrontendMessage, bind=True)
        tokenizers = [ZmqAsyncPushQueue(addr, TokenizerMessage, bind=False)
                      for addr in tokenizer_addrs]
        return cls(tokenizers, inbox, **options)

    @property
    def num_live(self) -> int:
        """Requests whose replies the frontend still waits for (``/metrics`` shows it)."""
        return len(self._pending)

    @property
    def num_buffered(self) -> int:
        """Replies received and not taken by their readers yet, over all requests."""
        return sum(len(buffer.replies) for buffer in self._pending.values())

    def start(self) -> None:
        """Start the listener and the watchdog (once); call from inside the event loop."""
        if self._listener is None:
            loop = asyncio.get_running_loop()
            self._listener = loop.create_task(self._listen())
            self._listener.add_done_callback(self._on_listener_exit)
            self._watchdog = loop.create_task(self._watch())

    # ----------------------------------------------------------------- requests out
    # --8<-- [start:frontend_submit]
    async def submit(self, params: SamplingParams, *, text: str | None = None,
                     input_ids: list[int] | None = None,
                     messages: list[dict[str, Any]] | None = None) -> int:
        """Number a new request, send it to its tokenizer and return its uid.

        Exactly one of ``text``, ``input_ids`` and ``messages`` is the prompt. Read the replies
        with :meth:`replies` (or :meth:`collect`).

        Raises:
            APIError: the server cannot serve (a worker died, it is shutting down: 503), or
                the request cannot be sent (a value too large for the wire: 400).
        """
        if self.unavailable is not None:
            raise APIError.of(self.unavailable)
        self.start()
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        request = TokenizeRequest(uid, params, text=text, input_ids=input_ids, messages=messages)
        # The buffer exists before the request leaves, so no reply can find it missing.
        self._pending[uid] = ReplyBuffer(self.reply_buffer_size)
        try:
            await self._tokenizer_of(uid).put(request)
        except SerializationError as exc:  # e.g. an integer that does not fit in 64 bits
            self._pending.pop(uid, None)
            raise APIError(400, f"the request cannot be sent to the workers: {exc}") from None
        except BaseException:
            self._pending.pop(uid, None)
            raise
        self.stats.submitted += 1
        return uid

    def abort(self, uid: int) -> None:
        """Forget request ``uid`` and, unless it has finished, tell the workers to drop it.

        Synchronous on purpose: it is called while a cancelled stream unwinds, where nothing
        may be awaited. The send runs as a task of its own. Aborting a request that is not
        waited on any more (finished, aborted already) does nothing.
        """
        buffer = self._pending.pop(uid, None)
        if buffer is None or buffer.finished:
            return
        self.stats.aborted += 1
        logger.info("aborting request %d", uid)
        self._send_abort(uid)

    def _send_abort(self, uid: int) -> None:
        task = asyncio.get_running_loop().create_task(
            self._tokenizer_of(uid).put(AbortRequest(uid)))
        self._background.add(task)  # a task nobody references may be garbage-collected
        task.add_done_callback(self._background.discard)

    def _tokenizer_of(self, uid: int) -> _Outbox:
        return self._tokenizers[uid % len(self._tokenizers)]
    # --8<-- [end:frontend_submit]

    # ----------------------------------------------------------------- replies in
    # --8<-- [start:frontend_dispatch]
    async def _listen(self) -> None:
        """The one reader of the inbox: hand each reply to its request's buffer."""
        while True:
            try:
                reply = await self._inbox.get()
            except (SerializationError, TypeError) as exc:  # a bad frame: drop it, go on
                logger.error("dropping a message the frontend cannot read: %s", exc)
                continue
            self._dispatch(reply)

    def _dispatch(self, reply: UserReply) -> None:
        buffer = self._pending.get(reply.uid)
        if buffer is None or buffer.failed:  # aborted, failed or finished: nobody waits
            logger.debug("dropping a reply for request %d, which nobody waits for", reply.uid)
            return
        if reply.error is not None:
            self.stats.failed += 1
        if not buffer.push(reply, time.monotonic()):  # chapter 16: the reader is too slow
            self._cut_off(reply.uid, buffer)
    # --8<-- [end:frontend_dispatch]

    # --8<-- [start:frontend_replies]
    async def replies(self, uid: int) -> AsyncIterator[UserReply]:
        """Request ``uid``'s replies, in order, up to and including its last one.

        This generator owns the request's state (chapter 16). The state is freed as soon as
        the last reply is taken, *before* it is yielded: a caller that stops there (``break``
        on the finished reply) never resumes the generator, and must leave nothing behind.
        Any other way out (the caller breaks early and closes it, a cancelled task, an
        exception) runs the ``finally``, which frees the state and aborts the request.
        """
        buffer = self._pending.get(uid)
        if buffer is None:
            raise KeyError(f"request {uid} is not waiting for replies (finished, aborted, "
                           "or never submitted)")
        try:
            while True:
                await buffer.event.wait()
                for reply in buffer.take():
                    if reply.finished:
                        self._pending.pop(uid, None)
                        if reply.error is None:
                            self.stats.finished += 1
                    yield reply
                    if reply.finished:
                        return
        finally:
            self.abort(uid)  # nothing to do if the last reply was taken

    async def collect(self, uid: int) -> tuple[str, UserReply]:
        """Wait for the whole of request ``uid``: its text and its last reply (which carries
        the error, if the request failed)."""
        parts: list[str] = []
        last: UserReply | None = None
        async with aclosing(self.replies(uid)) as replies:
            async for reply in replies:
                parts.append(reply.delta)
                last = reply
        assert last is not None and last.finished, f"request {uid} ended without a last reply"
        return "".join(parts), last
    # --8<-- [end:frontend_replies]

    # ----------------------------------------------------------------- ending requests
    # --8<-- [start:frontend_failures]
    def fail(self, uid: int, error: RequestError, *, abort: bool = True) -> None:
        """End request ``uid`` with ``error``: its reader gets it as the last reply, what was
        buffered is dropped, later replies are ignored, and (``abort``) the workers are told
        to drop the request."""
        buffer = self._pending.get(uid)
        if buffer is None or buffer.failed:
            return
        if abort and not buffer.finished:
            self._send_abort(uid)
        buffer.fail(UserReply.failure(uid, error), time.monotonic())
        self.stats.failed += 1

    def fail_all(self, error: RequestError) -> None:
        """End every waiting request with ``error``, and refuse new ones with it.

        For when the server cannot serve any more: a worker died (an abort would go nowhere)
        or the server is shutting down (its workers are stopped next), so no abort is sent.
        """
        if self.unavailable is None:
            self.unavailable = error
            level = logging.INFO if error is SHUTTING_DOWN else logging.ERROR
            if self._pending or level == logging.ERROR:
                logger.log(level, "ending %d waiting request(s): %s", len(self._pending),
                           error.message)
        for uid in list(self._pending):
            self.fail(uid, error, abort=False)

    def _cut_off(self, uid: int, buffer: ReplyBuffer) -> None:
        lag = buffer.lag(time.monotonic())
        logger.warning("request %d: its client reads too slowly (%d replies unread, the "
                       "oldest for %.1f s): aborting it", uid, len(buffer.replies), lag)
        self.stats.slow_readers += 1
        self.fail(uid, slow_reader_error(lag, len(buffer.replies)))

    def check(self, now: float) -> None:
        """What the watchdog does, a few times a second: fail every request if a worker has
        died; cut off readers that have been behind too long; free requests whose reader
        has not even come for the error they were ended with."""
        problem = self._health() if self._health is not None else None
        if problem is not None:
            self.fail_all(unavailable_error(problem, "worker_died"))
        for uid, buffer in list(self._pending.items()):
            if buffer.lag(now) <= self.slow_reader_timeout_s:
                continue
            if buffer.failed:  # abandoned: nobody reads this request any more
                self._pending.pop(uid, None)
            else:
                self._cut_off(uid, buffer)

    async def _watch(self) -> None:
        interval = min(0.25, self.slow_reader_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self.check(time.monotonic())
            except Exception:  # the watchdog must outlive a bad health check
                logger.exception("the frontend's watchdog failed")

    def _on_listener_exit(self, task: asyncio.Task[None]) -> None:
        # Without its listener the frontend is deaf: every request would wait for ever.
        if task.cancelled():
            return
        exc = task.exception()
        logger.error("the frontend's reply listener died: %r", exc)
        self.fail_all(unavailable_error(f"the API server's reply listener stopped: {exc!r}",
                                        "listener_died"))
    # --8<-- [end:frontend_failures]

    async def close(self) -> None:
        """End what still waits, stop the listener and the watchdog, let the abort sends
        finish, close the queues."""
        self.fail_all(SHUTTING_DOWN)
        for task in (self._watchdog, self._listener):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._listener = self._watchdog = None
        if self._background:
            await asyncio.wait(self._background, timeout=1.0)
        for queue in (*self._tokenizers, self._inbox):
            close = getattr(queue, "close", None)
            if close is not None:
                close()


# =========================================================================== responses
@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str


def usage_dict(usage: TokenUsage | None) -> dict[str, int] | None:
    """OpenAI's ``usage`` object."""
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def chat_body(meta: ResponseMeta, text: str, last: UserReply) -> dict[str, Any]:
    """A whole (non-streamed) chat completion."""
    return {"id": meta.id, "object": "chat.completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": last.finish_reason}],
            "usage": usage_dict(last.usage)}


def completion_body(meta: ResponseMeta, text: str, last: UserReply) -> dict[str, Any]:
    """A whole (non-streamed) text completion."""
    return {"id": meta.id, "object": "text_completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": last.finish_reason}],
            "usage": usage_dict(last.usage)}


def chat_chunk(meta: ResponseMeta, delta: dict[str, str],
               finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed piece of a chat completion."""
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason}]}


def completion_chunk(meta: ResponseMeta, text: str,
                     finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed piece of a text completion."""
    return {"id": meta.id, "object": "text_completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}]}


# --8<-- [start:sse]
SSE_DONE = b"data: [DONE]\n\n"  # OpenAI's end of stream


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One Server-Sent Event: ``data: <json>`` and a blank line.

    JSON escapes newlines inside strings, so the payload is always a single ``data:`` line and
    the blank line can only mean "end of event".
    """
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def stream_chat(replies: AsyncIterator[UserReply], meta: ResponseMeta,
                      include_usage: bool = False,
                      prompt_param: str = "messages") -> AsyncIterator[bytes]:
    """A chat completion as SSE: the role first, a chunk per piece of text, a chunk with the
    finish reason, the usage (if asked), then ``[DONE]``.

    Chapter 16: a request that fails mid-stream ends with an error event (OpenAI's error
    object, which the ``openai`` client raises as an exception), then ``[DONE]``. Closing this
    generator closes ``replies``, which frees the request's state at once.
    """
    extra = {"usage": None} if include_usage else {}  # OpenAI: null on all but the last
    async with _closing(replies):
        yield sse_event({**chat_chunk(meta, {"role": "assistant", "content": ""}), **extra})
        async for reply in replies:
            if reply.delta:  # empty while a multi-byte character is incomplete
                yield sse_event({**chat_chunk(meta, {"content": reply.delta}), **extra})
            if reply.error is not None:
                yield sse_event(error_body(reply.error, prompt_param))
            elif reply.finished:
                yield sse_event({**chat_chunk(meta, {}, reply.finish_reason), **extra})
                if include_usage:
                    yield sse_event({**chat_chunk(meta, {}), "choices": [],
                                     "usage": usage_dict(reply.usage)})
        yield SSE_DONE
# --8<-- [end:sse]


async def stream_completion(replies: AsyncIterator[UserReply], meta: ResponseMeta,
                            include_usage: bool = False,
                            prompt_param: str = "prompt") -> AsyncIterator[bytes]:
    """A text completion as SSE: a chunk per piece of text, one with the finish reason, the
    usage (if asked), then ``[DONE]``; an error event instead if the request fails."""
    extra = {"usage": None} if include_usage else {}
    async with _closing(replies):
        async for reply in replies:
            if reply.delta:
                yield sse_event({**completion_chunk(meta, reply.delta), **extra})
            if reply.error is not None:
                yield sse_event(error_body(reply.error, prompt_param))
            elif reply.finished:
                yield sse_event({**completion_chunk(meta, "", reply.finish_reason), **extra})
                if include_usage:
                    yield sse_event({**completion_chunk(meta, ""), "choices": [],
                                     "usage": usage_dict(reply.usage)})
        yield SSE_DONE


@asynccontextmanager
async def _closing(iterator: AsyncIterator[Any]) -> AsyncIterator[None]:
    """Close ``iterator`` (an async generator) on the way out, however that is.

    ``async for`` does not close what it iterates when the loop is left early: a generator
    left suspended is closed only when it is garbage-collected. Closing it here runs its
    ``finally`` now.
    """
    try:
        yield
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


# --8<-- [start:abort_on_disconnect]
async def abort_on_disconnect(frontend: FrontendManager, uid: int,
                              chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass ``chunks`` through; if the stream stops before they end, abort request ``uid``.

    When the client disconnects, Starlette stops the response: it cancels the task iterating
    this generator (a ``CancelledError`` rises out of the ``await`` the stream waits in, through
    every generator below), or, when the disconnect shows as a failed write, stops iterating
    it. Either way ``finally`` runs with the stream unfinished (chapter 16: :class:`SSEResponse`
    closes this generator explicitly, so "finally" means now, not when the garbage collector
    gets to it). :meth:`FrontendManager.abort` only schedules its send: a cancelled task may
    not wait for anything.
    """
    finished = False
    try:
        async with _closing(chunks):
            async for chunk in chunks:
                yield chunk
        finished = True
    finally:
        if not finished:
            frontend.abort(uid)
# --8<-- [end:abort_on_disconnect]


# --8<-- [start:sse_response]
class SSEResponse(StreamingResponse):
    """A Server-Sent Events response that closes its chunk generator however it ends.

    Starlette iterates the generator and, when the client goes away, cancels that iteration;
    if the cancellation finds the response waiting to write (a slow client), the generator
    stays suspended at its ``yield``, and its ``finally`` (which aborts the request and frees
    its state) would wait for the garbage collector. Closing it here makes that immediate.
    """

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse_response(frontend: FrontendManager, uid: int,
                 chunks: AsyncIterator[bytes]) -> SSEResponse:
    return SSEResponse(abort_on_disconnect(frontend, uid, chunks))
# --8<-- [end:sse_response]


# =========================================================================== routes
router = APIRouter()


def _frontend(request: Request) -> FrontendManager:
    return request.app.state.frontend


def _meta(request: Request, prefix: str, uid: int) -> ResponseMeta:
    # The uid is in the id, so a response can be matched with the workers' log lines.
    return ResponseMeta(f"{prefix}-{uid}", int(time.time()), request.app.state.model_name)


# --8<-- [start:answer]
async def whole_answer(request: Request, frontend: FrontendManager, uid: int,
                       prompt_param: str) -> tuple[str, UserReply]:
    """Request ``uid``'s whole text and last reply, for a response that is not streamed.

    Chapter 16: nothing is sent to the client until the answer is complete, so a client that
    disconnects is not noticed by a failed write: a watcher waits for the disconnect at the
    same time, and wins the race if the client goes first. Collecting then stops, and
    :meth:`FrontendManager.replies` aborts the request. A request that failed is answered
    with its error's status and an OpenAI error body.
    """
    text, last = await wait_or_disconnect(frontend.collect(uid), request)
    if last.error is not None:
        raise APIError.of(last.error, prompt_param)
    return text, last


async def first_reply_then_rest(request: Request, frontend: FrontendManager, uid: int,
                                prompt_param: str) -> AsyncIterator[UserReply]:
    """Request ``uid``'s replies for a streamed response, once its first reply has come.

    Chapter 16: the response's headers (and its status, 200) go out with the first chunk,
    so the first reply is awaited before the response starts: a request the workers refuse
    at once (its prompt is too long) is still answered with a 400 and an error body, not a
    200 stream holding an error. The client may disconnect during that wait, as it can
    while a whole answer is collected.
    """
    replies = frontend.replies(uid)
    try:
        first = await wait_or_disconnect(replies.__anext__(), request)
    except BaseException:
        await replies.aclose()
        raise
    if first.error is not None:
        await replies.aclose()
        raise APIError.of(first.error, prompt_param)
    return _prepend(first, replies)


async def _prepend(first: UserReply, rest: AsyncIterator[UserReply]) -> AsyncIterator[UserReply]:
    async with _closing(rest):
        yield first
        if not first.finished:
            async for reply in rest:
                yield reply
# --8<-- [end:answer]


# --8<-- [start:chat_endpoint]
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """A chat turn: the tokenizer applies the model's chat template to ``messages``."""
    frontend = _frontend(request)
    max_tokens = (body.max_tokens if body.max_completion_tokens is None
                  else body.max_completion_tokens)
    params = body.sampling_params(max_tokens, DEFAULT_CHAT_MAX_TOKENS)
    uid = await frontend.submit(params, messages=[m.as_dict() for m in body.messages])
    meta = _meta(request, "chatcmpl", uid)
    if body.stream:
        replies = await first_reply_then_rest(request, frontend, uid, "messages")
        return sse_response(frontend, uid, stream_chat(replies, meta, body.include_usage))
    text, last = await whole_answer(request, frontend, uid, "messages")
    return chat_body(meta, text, last)
# --8<-- [end:chat_endpoint]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """A plain completion of ``prompt`` (text, or token ids), no chat template."""
    frontend = _frontend(request)
    if not body.prompt:
        raise APIError(400, "prompt is empty: it needs at least one character or token",
                       "prompt")
    params = body.sampling_params(body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
    if isinstance(body.prompt, str):
        uid = await frontend.submit(params, text=body.prompt)
    else:
        uid = await frontend.submit(params, input_ids=list(body.prompt))
    meta = _meta(request, "cmpl", uid)
    if body.stream:
        replies = await first_reply_then_rest(request, frontend, uid, "prompt")
        return sse_response(frontend, uid, stream_completion(replies, meta, body.include_usage))
    text, last = await whole_answer(request, frontend, uid, "prompt")
    return completion_body(meta, text, last)


@router.get("/v1/models")
async def models(request: Request):
    """The one model this server runs."""
    state = request.app.state
    return {"object": "list",
            "data": [{"id": state.model_name, "object": "model", "created": state.started,
                      "owned_by": "minisgl", "root": state.model_root}]}


@router.get("/health")
async def health(request: Request):
    """200 while every worker process runs; 503 and the reason otherwise (chapter 16: also
    while the API server cannot serve: its reply listener stopped, or it is shutting down)."""
    problem = request.app.state.health()
    unavailable = _frontend(request).unavailable
    if problem is None and unavailable is not None:
        problem = unavailable.message
    if problem is not None:
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    """Prometheus text: the workers' shared counters and the frontend's own."""
    state = request.app.state
    text = metrics_text(state.metrics(), _frontend(request))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


# =========================================================================== /metrics
# --8<-- [start:metrics]
# Worker counter name -> (metric, Prometheus type, help).
WORKER_METRICS: dict[str, tuple[str, str, str]] = {
    "running": ("minisgl_running_requests", "gauge", "Requests in the running batch."),
    "waiting": ("minisgl_waiting_requests", "gauge", "Requests waiting to be admitted."),
    "kv_pages_in_use": ("minisgl_kv_pages_in_use", "gauge",
                        "KV pages held by requests (not counting the prefix cache)."),
    "prompt_tokens": ("minisgl_prompt_tokens_total", "counter", "Prompt tokens admitted."),
    "generation_tokens": ("minisgl_generation_tokens_total", "counter", "Tokens generated."),
    "live_states": ("minisgl_detokenizer_live_states", "gauge",
                    "Requests the detokenizer holds text state for."),
}


def metrics_text(worker_counters: Mapping[str, int], frontend: FrontendManager) -> str:
    """The Prometheus text exposition of the workers' counters and the frontend's."""
    rows = [(*WORKER_METRICS.get(name, (f"minisgl_{name}", "gauge", name)), value)
            for name, value in worker_counters.items()]
    rows += [
        ("minisgl_frontend_live_requests", "gauge",
         "Requests the API server waits on.", frontend.num_live),
        ("minisgl_frontend_requests_total", "counter",
         "Requests sent to the workers.", frontend.stats.submitted),
        ("minisgl_frontend_finished_total", "counter",
         "Requests answered to the end.", frontend.stats.finished),
        ("minisgl_frontend_aborted_total", "counter",
         "Requests aborted because their client went away.", frontend.stats.aborted),
        # Chapter 16.
        ("minisgl_frontend_buffered_replies", "gauge",
         "Replies received and not yet taken by their reader.", frontend.num_buffered),
        ("minisgl_frontend_failed_total", "counter",
         "Requests that ended with an error.", frontend.stats.failed),
        ("minisgl_frontend_slow_readers_total", "counter",
         "Requests cut off because their client read too slowly.", frontend.stats.slow_readers),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"
# --8<-- [end:metrics]


# =========================================================================== the app
# --8<-- [start:create_app]
def create_app(frontend_factory: Callable[[], FrontendManager], model_name: str, *,
               model_root: str | None = None,
               metrics: Callable[[], Mapping[str, int]] | None = None,
               health: Callable[[], str | None] | None = None) -> FastAPI:
    """The FastAPI application.

    Args:
        frontend_factory: builds the :class:`FrontendManager`. It is called in the app's
            lifespan, inside the server's event loop, where its async queues must live.
        model_name: the name ``/v1/models`` and every response report.
        model_root: the checkpoint directory, for ``/v1/models``.
        metrics: returns the workers' counters (name -> value) for ``/metrics``.
        health: returns None while all is well, else a sentence on what is wrong.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        frontend = frontend_factory()
        frontend.start()
        app.state.frontend = frontend
        try:
            yield
        finally:
            await frontend.close()

    app = FastAPI(title="minisgl", lifespan=lifespan)
    app.state.model_name = model_name
    app.state.model_root = model_root or model_name
    app.state.started = int(time.time())
    app.state.metrics = metrics or dict
    app.state.health = health or (lambda: None)
    app.include_router(router)

    # --8<-- [start:error_handlers]
    # Every error leaves as OpenAI's error object; FastAPI's and Starlette's own bodies
    # ({"detail": ...}, status 422 for a bad body) are not what OpenAI clients expect.
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error = APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                         kind="invalid_request_error" if exc.status_code < 500
                         else "server_error")
        return error.response(headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: the client has gone

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unexpected error while serving a request", exc_info=exc)
        return APIError(500, f"internal server error: {type(exc).__name__}",
                        kind="server_error").response()
    # --8<-- [end:error_handlers]

    return app
# --8<-- [end:create_app]
