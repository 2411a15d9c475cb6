"""The OpenAI-compatible HTTP API: the FastAPI app and its routes.

Each route parses its body (:mod:`minisgl.server.protocol`), submits the request through the
:class:`~minisgl.server.frontend.FrontendManager`, and answers either with the whole text or
with a Server-Sent Events stream of it. The routes: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``, ``GET /health`` and ``GET /metrics``, built by
:func:`create_app`.

A streaming client that disconnects makes Starlette cancel the stream; the cancellation turns
into an :class:`~minisgl.message.AbortRequest`, so the scheduler stops generating for nobody.

Chapter 16 makes every request end, and end cleanly, whatever happens: a client that
disconnects while it waits for a whole answer, a prompt the workers refuse (answered with an
OpenAI error and its status, streamed or not), an error of any kind (answered as OpenAI's
error object), the server shutting down. ``/metrics`` shows what the frontend still holds.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.message import UserReply
from minisgl.server.frontend import FrontendManager
from minisgl.server.lifecycle import ClientDisconnected, wait_or_disconnect
from minisgl.server.protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseMeta,
    chat_body,
    completion_body,
    stream_chat,
    stream_completion,
    validation_error,
)
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)


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
        async with aclosing(chunks):
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
    async with aclosing(rest):
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
    uid = await frontend.submit(params, messages=[m.as_dict() for m in body.messages],
                                strict_max_tokens=max_tokens is not None)
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
    strict = body.max_tokens is not None
    if isinstance(body.prompt, str):
        uid = await frontend.submit(params, text=body.prompt, strict_max_tokens=strict)
    else:
        uid = await frontend.submit(params, input_ids=list(body.prompt), strict_max_tokens=strict)
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
        return validation_error(exc.errors()).response()

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
