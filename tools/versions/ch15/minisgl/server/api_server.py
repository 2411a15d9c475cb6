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
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortRequest,
    FrontendMessage,
    SerializationError,
    TokenizeRequest,
    TokenizerMessage,
    TokenUsage,
    UserReply,
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
class APIError(Exception):
    """An error the client caused, answered as OpenAI does: a status and ``{"error": {...}}``."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.kind = kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}
        return JSONResponse(body, status_code=self.status_code)


def _validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """pydantic's error list as one readable message naming the field(s)."""
    parts, param = [], None
    for error in errors:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        param = param or where or None
        parts.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return APIError(400, "; ".join(parts) or "invalid request body", param)


# =========================================================================== request bodies
TokenId = Annotated[int, Field(ge=0)]


# --8<-- [start:request_models]
class TextPart(BaseModel):
    """One part of a message's content given as a list (OpenAI's multi-part form)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn of a conversation."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        """The turn as the chat template expects it: role and plain-text content."""
        text = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)
        return {"role": self.role, "content": text}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _GenerationBody(BaseModel):
    """What chat and completion requests share: the sampling parameters and ``stream``.

    ``None`` (or leaving a field out) means the default. Unknown fields are rejected: a typo
    such as ``max_token`` would otherwise be ignored without a word. Fields that OpenAI defines
    but this server does not implement are accepted only at their neutral value.
    """

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension (vLLM, SGLang)
    min_p: float | None = None  # an extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # an extension
    ignore_eos: bool = False  # an extension: benchmarks use it for outputs of known length
    n: int = 1
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
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens


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
class _Pending:
    """A request the frontend is waiting on: replies not read yet, and a flag to wake it."""

    replies: list[UserReply] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class FrontendStats:
    """Counters the frontend keeps for ``/metrics`` (totals since start)."""

    submitted: int = 0
    finished: int = 0
    aborted: int = 0


class FrontendManager:
    """Sends requests to the tokenizer workers and routes every reply to its request.

    Many HTTP requests are in flight at once, but replies come back through a single queue.
    Each request gets a *uid*, a reply buffer and an :class:`asyncio.Event`; one listener task
    reads the queue, appends each reply to its uid's buffer and sets that uid's event, and the
    request's handler, waiting on its own event only, takes its buffer when woken.

    Args:
        tokenizers: one outgoing queue per tokenizer worker; request ``uid`` goes to
            ``tokenizers[uid % len(tokenizers)]``, and so does its abort, which therefore can
            never overtake it.
        inbox: the queue the detokenizer sends every :class:`UserReply` to.

    Use it from one event loop. :meth:`start` (or the first :meth:`submit`) starts the listener;
    it has to run inside the loop, which is why the app builds the manager in its lifespan.
    """

    def __init__(self, tokenizers: Sequence[_Outbox], inbox: _Inbox) -> None:
        if not tokenizers:
            raise ValueError("FrontendManager needs at least one tokenizer queue")
        self._tokenizers = list(tokenizers)
        self._inbox = inbox
        self._next_uid = 0
        self._pending: dict[int, _Pending] = {}
        self._listener: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # abort sends still in flight
        self.stats = FrontendStats()
    # --8<-- [end:frontend_state]

    @classmethod
    def connect(cls, tokenizer_addrs: Sequence[str], inbox_addr: str) -> FrontendManager:
        """A manager on real ZMQ queues: it binds ``inbox_addr`` and connects to each
        tokenizer's inbox."""
        from minisgl.utils.mp import ZmqAsyncPullQueue, ZmqAsyncPushQueue

        inbox = ZmqAsyncPullQueue(inbox_addr, FrontendMessage, bind=True)
        tokenizers = [ZmqAsyncPushQueue(addr, TokenizerMessage, bind=False)
                      for addr in tokenizer_addrs]
        return cls(tokenizers, inbox)

    @property
    def num_live(self) -> int:
        """Requests whose replies the frontend still waits for (``/metrics`` shows it)."""
        return len(self._pending)

    def start(self) -> None:
        """Start the listener task (once); call from inside the event loop."""
        if self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(self._listen())
            self._listener.add_done_callback(_report_listener_exit)

    # ----------------------------------------------------------------- requests out
    # --8<-- [start:frontend_submit]
    async def submit(self, params: SamplingParams, *, text: str | None = None,
                     input_ids: list[int] | None = None,
                     messages: list[dict[str, Any]] | None = None) -> int:
        """Number a new request, send it to its tokenizer and return its uid.

        Exactly one of ``text``, ``input_ids`` and ``messages`` is the prompt. Read the replies
        with :meth:`replies` (or :meth:`collect`).
        """
        self.start()
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        request = TokenizeRequest(uid, params, text=text, input_ids=input_ids, messages=messages)
        # The buffer exists before the request leaves, so no reply can find it missing.
        self._pending[uid] = _Pending()
        try:
            await self._tokenizer_of(uid).put(request)
        except BaseException:
            self._pending.pop(uid, None)
            raise
        self.stats.submitted += 1
        return uid

    def abort(self, uid: int) -> None:
        """Forget request ``uid`` and tell the workers to drop it.

        Synchronous on purpose: it is called while a cancelled stream unwinds, where nothing
        may be awaited. The send runs as a task of its own.
        """
        self._pending.pop(uid, None)
        self.stats.aborted += 1
        logger.info("aborting request %d", uid)
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
        pending = self._pending.get(reply.uid)
        if pending is None:  # aborted, or finished already: nobody waits for it
            logger.debug("dropping a reply for request %d, which nobody waits for", reply.uid)
            return
        pending.replies.append(reply)
        pending.event.set()

    async def replies(self, uid: int) -> AsyncIterator[UserReply]:
        """Request ``uid``'s replies, in order, up to and including its last one."""
        pending = self._pending[uid]
        try:
            while True:
                await pending.event.wait()
                # Take the whole buffer at once: replies that arrive while we yield these go
                # into a fresh list and set the event again, so none is missed.
                pending.event.clear()
                batch, pending.replies = pending.replies, []
                for reply in batch:
                    yield reply
                    if reply.finished:
                        self.stats.finished += 1
                        return
        finally:
            self._pending.pop(uid, None)

    async def collect(self, uid: int) -> tuple[str, UserReply]:
        """Wait for the whole of request ``uid``: its text and its last reply."""
        parts: list[str] = []
        last: UserReply | None = None
        async for reply in self.replies(uid):
            parts.append(reply.delta)
            last = reply
        assert last is not None and last.finished, f"request {uid} ended without a last reply"
        return "".join(parts), last
    # --8<-- [end:frontend_dispatch]

    async def close(self) -> None:
        """Stop the listener, let the abort sends finish, close the queues."""
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        if self._background:
            await asyncio.wait(self._background, timeout=1.0)
        for queue in (*self._tokenizers, self._inbox):
            close = getattr(queue, "close", None)
            if close is not None:
                close()


def _report_listener_exit(task: asyncio.Task[None]) -> None:
    # Without its listener the frontend is deaf: every request would wait for ever. Say so.
    if not task.cancelled() and task.exception() is not None:
        logger.error("the frontend's reply listener died: %r", task.exception())


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
                      include_usage: bool = False) -> AsyncIterator[bytes]:
    """A chat completion as SSE: the role first, a chunk per piece of text, a chunk with the
    finish reason, the usage (if asked), then ``[DONE]``."""
    extra = {"usage": None} if include_usage else {}  # OpenAI: null on all but the last
    yield sse_event({**chat_chunk(meta, {"role": "assistant", "content": ""}), **extra})
    async for reply in replies:
        if reply.delta:  # empty while a multi-byte character is incomplete
            yield sse_event({**chat_chunk(meta, {"content": reply.delta}), **extra})
        if reply.finished:
            yield sse_event({**chat_chunk(meta, {}, reply.finish_reason), **extra})
            if include_usage:
                yield sse_event({**chat_chunk(meta, {}), "choices": [],
                                 "usage": usage_dict(reply.usage)})
    yield SSE_DONE
# --8<-- [end:sse]


async def stream_completion(replies: AsyncIterator[UserReply], meta: ResponseMeta,
                            include_usage: bool = False) -> AsyncIterator[bytes]:
    """A text completion as SSE: a chunk per piece of text, one with the finish reason, the
    usage (if asked), then ``[DONE]``."""
    extra = {"usage": None} if include_usage else {}
    async for reply in replies:
        if reply.delta:
            yield sse_event({**completion_chunk(meta, reply.delta), **extra})
        if reply.finished:
            yield sse_event({**completion_chunk(meta, "", reply.finish_reason), **extra})
            if include_usage:
                yield sse_event({**completion_chunk(meta, ""), "choices": [],
                                 "usage": usage_dict(reply.usage)})
    yield SSE_DONE


# --8<-- [start:abort_on_disconnect]
async def abort_on_disconnect(frontend: FrontendManager, uid: int,
                              chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass ``chunks`` through; if the stream stops before they end, abort request ``uid``.

    When the client disconnects, Starlette stops the response: it cancels the task iterating
    this generator (a ``CancelledError`` rises out of the ``await`` the stream waits in, through
    every generator below), or, when the disconnect shows as a failed write, drops the
    generator, which Python then closes. Either way ``finally`` runs with the stream
    unfinished. :meth:`FrontendManager.abort` only schedules its send: a cancelled task may not
    wait for anything.
    """
    finished = False
    try:
        async for chunk in chunks:
            yield chunk
        finished = True
    finally:
        if not finished:
            frontend.abort(uid)
# --8<-- [end:abort_on_disconnect]


def sse_response(frontend: FrontendManager, uid: int,
                 chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(abort_on_disconnect(frontend, uid, chunks),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# =========================================================================== routes
router = APIRouter()


def _frontend(request: Request) -> FrontendManager:
    return request.app.state.frontend


def _meta(request: Request, prefix: str, uid: int) -> ResponseMeta:
    # The uid is in the id, so a response can be matched with the workers' log lines.
    return ResponseMeta(f"{prefix}-{uid}", int(time.time()), request.app.state.model_name)


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
        chunks = stream_chat(frontend.replies(uid), meta, body.include_usage)
        return sse_response(frontend, uid, chunks)
    text, last = await frontend.collect(uid)
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
        chunks = stream_completion(frontend.replies(uid), meta, body.include_usage)
        return sse_response(frontend, uid, chunks)
    text, last = await frontend.collect(uid)
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
    """200 while every worker process runs; 503 and the reason otherwise."""
    problem = request.app.state.health()
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

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc.errors()).response()

    return app
# --8<-- [end:create_app]
