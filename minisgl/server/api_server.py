"""The OpenAI-compatible HTTP API: the FastAPI app and its routes.

Each route parses its body (:mod:`minisgl.server.protocol`), submits the request through the
:class:`~minisgl.server.frontend.RequestRouter`, and answers either with the whole text or
with a Server-Sent Events stream of it. The routes: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``, ``GET /health`` and ``GET /metrics``, built by
:func:`create_app`.

A streaming client that disconnects makes Starlette cancel the stream; the cancellation turns
into an :class:`~minisgl.message.AbortRequest`, so the scheduler stops generating for nobody.

Every request ends, and ends cleanly, whatever happens: a client that
disconnects while it waits for a whole answer, a prompt the workers refuse (answered with an
OpenAI error and its status, streamed or not), an error of any kind (answered as OpenAI's
error object), the server shutting down. ``/metrics`` shows what the frontend still holds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minisgl.message import UserReply
from minisgl.server.frontend import RequestRouter
from minisgl.server.lifecycle import ClientDisconnected, wait_or_disconnect
from minisgl.server.protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    prompt_schema,
    validation_error,
)
from minisgl.server.responses import (
    ResponseMeta,
    chat_body,
    completion_body,
    stream_chat,
    stream_completion,
)
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)


async def abort_on_disconnect(frontend: RequestRouter, uid: int,
                              chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass ``chunks`` through; if the stream stops before they end, abort request ``uid``.

    When the client disconnects, Starlette stops the response: it cancels the task iterating
    this generator (a ``CancelledError`` rises out of the ``await`` the stream waits in, through
    every generator below), or, when the disconnect shows as a failed write, stops iterating
    it. Either way ``finally`` runs with the stream unfinished (:class:`SSEResponse`
    closes this generator explicitly, so "finally" means now, not when the garbage collector
    gets to it). :meth:`RequestRouter.abort` only schedules its send: a cancelled task may
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


def sse_response(frontend: RequestRouter, uid: int,
                 chunks: AsyncIterator[bytes]) -> SSEResponse:
    return SSEResponse(abort_on_disconnect(frontend, uid, chunks))


# =========================================================================== routes
class Utf8BodyRoute(APIRoute):
    """A route whose body must be UTF-8, as JSON is: anything else is HTTP 400 saying where
    the first bad byte is (FastAPI would only say "There was an error parsing the body")."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            try:
                body = await request.body()  # read once; the handler reads the same copy
            except ClientDisconnect:  # gone before its body arrived: a 400, as FastAPI answers
                raise APIError(400, "the client disconnected before its request body "
                                    "arrived") from None
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise APIError(400, f"the body is not valid UTF-8: byte 0x{body[exc.start]:02x} "
                                    f"at position {exc.start} ({exc.reason}); JSON bodies must "
                                    "be encoded in UTF-8") from None
            return await handler(request)

        return checked


# Every error the routes may answer with, in the schema (FastAPI would list 422, which this
# server never sends: a malformed body is a 400 with OpenAI's error object).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "The request is malformed or asks for "
                                                 "something this server does not support"},
    404: {"model": ErrorResponse, "description": "No such model"},
    500: {"model": ErrorResponse, "description": "A worker failed while serving the request"},
    503: {"model": ErrorResponse, "description": "A worker has died, or the server is "
                                                 "shutting down"},
}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The completion, or with `stream` a stream of Server-Sent Events",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **ERROR_RESPONSES,
}

router = APIRouter(route_class=Utf8BodyRoute)


@dataclass
class AccessRecord:
    """What the access log line says of one generation request (filled in as it goes)."""

    uids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)

    def add(self, reply: UserReply) -> None:
        """Note a request's last reply."""
        if reply.usage is not None:
            self.prompt_tokens += reply.usage.prompt_tokens
            self.completion_tokens += reply.usage.completion_tokens
        self.finish_reasons.append(reply.finish_reason or "error")


def _frontend(request: Request) -> RequestRouter:
    return request.app.state.frontend


def _meta(request: Request, prefix: str) -> ResponseMeta:
    # Random, as OpenAI's are: unique across restarts (the access log pairs it with the uids).
    meta = ResponseMeta(f"{prefix}-{uuid.uuid4().hex}", int(time.time()),
                        request.app.state.model_name)
    request.state.response_id = meta.id
    return meta


def _access(request: Request) -> AccessRecord:
    record = AccessRecord()
    request.state.access = record
    return record


def check_model(request: Request, model: str | None) -> None:
    """An unknown ``model`` is HTTP 404 ``model_not_found``, as OpenAI, vLLM and SGLang answer;
    the served name and the path the server was started with are both known. Left out, the
    one model served answers."""
    if model is not None and model not in request.app.state.model_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{request.app.state.model_name!r}", "model",
                       code="model_not_found")


def check_at_most(name: str, value: int, limit: int | None) -> None:
    if limit is not None and value > limit:
        raise APIError(400, f"{name} is {value}, but this server serves at most {limit} tokens "
                            "per request", name, code="context_length_exceeded")


def check_token_ids(request: Request, name: str, token_ids: Sequence[int]) -> None:
    """Token ids the client gives besides the prompt must be the model's (the scheduler
    checks the prompt's)."""
    vocab_size = request.app.state.vocab_size
    bad = next((t for t in token_ids if vocab_size is not None and t >= vocab_size), None)
    if bad is not None:
        raise APIError(400, f"{name}: token id {bad} is outside the vocabulary "
                            f"(0..{vocab_size - 1})", name)


async def _observed(replies: AsyncIterator[UserReply],
                    record: AccessRecord) -> AsyncIterator[UserReply]:
    """``replies`` unchanged; each last reply is noted for the access log."""
    async with aclosing(replies):
        async for reply in replies:
            if reply.finished:
                record.add(reply)
            yield reply


async def whole_answer(request: Request, frontend: RequestRouter, uid: int,
                       prompt_param: str) -> tuple[str, UserReply]:
    """Request ``uid``'s whole text and last reply, for a response that is not streamed.

    Nothing is sent to the client until the answer is complete, so a client that
    disconnects is not noticed by a failed write: a watcher waits for the disconnect at the
    same time, and wins the race if the client goes first. Collecting then stops, and
    :meth:`RequestRouter.replies` aborts the request. A request that failed is answered
    with its error's status and an OpenAI error body.
    """
    text, last = await wait_or_disconnect(frontend.collect(uid), request)
    if last.error is not None:
        raise APIError.of(last.error, prompt_param)
    return text, last


async def first_reply_then_rest(request: Request, frontend: RequestRouter, uid: int,
                                prompt_param: str) -> AsyncIterator[UserReply]:
    """Request ``uid``'s replies for a streamed response, once its first reply has come.

    The response's headers (and its status, 200) go out with the first chunk,
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


@router.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """A chat turn: the tokenizer applies the model's chat template to ``messages``."""
    frontend = _frontend(request)
    check_model(request, body.model)
    body.check_supported()
    max_tokens = (body.max_tokens if body.max_completion_tokens is None
                  else body.max_completion_tokens)
    params = body.sampling_params(max_tokens, DEFAULT_CHAT_MAX_TOKENS)
    if body.max_completion_tokens is not None and body.max_tokens is not None:
        # Both given: max_completion_tokens counts (as in vLLM); the other must still be valid.
        body.sampling_params(body.max_tokens, DEFAULT_CHAT_MAX_TOKENS)
        check_at_most("max_tokens", body.max_tokens, request.app.state.max_seq_len)
    check_token_ids(request, "stop_token_ids", body.stop_token_ids or ())
    record = _access(request)
    uid = await frontend.submit(params, messages=[m.as_dict() for m in body.messages],
                                strict_max_tokens=max_tokens is not None)
    record.uids.append(uid)
    meta = _meta(request, "chatcmpl")
    if body.stream:
        replies = await first_reply_then_rest(request, frontend, uid, "messages")
        return sse_response(frontend, uid, stream_chat(_observed(replies, record), meta,
                                                       body.include_usage))
    text, last = await whole_answer(request, frontend, uid, "messages")
    record.add(last)
    return chat_body(meta, text, last)


@router.post("/v1/completions", responses=GENERATION_RESPONSES)
async def completions(body: CompletionRequest, request: Request):
    """A plain completion of ``prompt`` (text, or token ids), no chat template. A list of
    prompts is answered with one choice per prompt, ``index`` in the order given."""
    frontend = _frontend(request)
    check_model(request, body.model)
    body.check_supported()
    prompts = body.prompts()
    params = body.sampling_params(body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
    check_token_ids(request, "stop_token_ids", body.stop_token_ids or ())
    record = _access(request)
    uids = await submit_prompts(frontend, prompts, params, body.max_tokens is not None)
    record.uids += uids
    meta = _meta(request, "cmpl")
    if len(uids) == 1:
        uid = uids[0]
        if body.stream:
            replies = await first_reply_then_rest(request, frontend, uid, "prompt")
            return sse_response(frontend, uid, stream_completion(
                _indexed(_observed(replies, record)), meta, 1, body.include_usage))
        text, last = await whole_answer(request, frontend, uid, "prompt")
        record.add(last)
        return completion_body(meta, [(text, last)])
    if body.stream:
        streams = await first_replies_then_rest(request, frontend, uids)
        merged = merge_replies([_observed(replies, record) for replies in streams])
        return SSEResponse(stream_completion(merged, meta, len(uids), body.include_usage))
    answers = await whole_answers(request, frontend, uids)
    for _, last in answers:
        record.add(last)
    return completion_body(meta, answers)


async def submit_prompts(frontend: RequestRouter, prompts: Sequence[str | list[int]],
                         params: Any, strict_max_tokens: bool) -> list[int]:
    """Send every prompt as a request of its own; if one cannot be sent, abort the others."""
    uids: list[int] = []
    try:
        for prompt in prompts:
            if isinstance(prompt, str):
                uids.append(await frontend.submit(params, text=prompt,
                                                  strict_max_tokens=strict_max_tokens))
            else:
                uids.append(await frontend.submit(params, input_ids=list(prompt),
                                                  strict_max_tokens=strict_max_tokens))
    except BaseException:
        for uid in uids:
            frontend.abort(uid)
        raise
    return uids


async def whole_answers(request: Request, frontend: RequestRouter,
                        uids: Sequence[int]) -> list[tuple[str, UserReply]]:
    """:func:`whole_answer` for several requests at once; the first error answers for all."""
    answers = await wait_or_disconnect(
        asyncio.gather(*(frontend.collect(uid) for uid in uids)), request)
    for _, last in answers:
        if last.error is not None:
            raise APIError.of(last.error, "prompt")
    return answers


async def first_replies_then_rest(request: Request, frontend: RequestRouter,
                                  uids: Sequence[int]) -> list[AsyncIterator[UserReply]]:
    """:func:`first_reply_then_rest` for several requests: the stream starts once each has
    its first reply, so a prompt refused at once is a 400 for the whole request."""
    streams = [frontend.replies(uid) for uid in uids]
    try:
        firsts = await wait_or_disconnect(
            asyncio.gather(*(replies.__anext__() for replies in streams)), request)
    except BaseException:
        for replies in streams:
            await replies.aclose()
        raise
    failed = next((first for first in firsts if first.error is not None), None)
    if failed is not None:
        for replies in streams:
            await replies.aclose()
        raise APIError.of(failed.error, "prompt")
    return [_prepend(first, replies) for first, replies in zip(firsts, streams)]


async def _indexed(replies: AsyncIterator[UserReply]) -> AsyncIterator[tuple[int, UserReply]]:
    async with aclosing(replies):
        async for reply in replies:
            yield 0, reply


async def merge_replies(streams: Sequence[AsyncIterator[UserReply]]
                        ) -> AsyncIterator[tuple[int, UserReply]]:
    """The replies of several requests as they come, each with its stream's index.

    One task per stream moves its replies into a queue of one place, so a slow reader still
    leaves the replies in the frontend's buffers, where the slow-reader policy sees them.
    Closing this generator (the client went away) cancels the tasks, which closes every
    stream and so aborts every request not finished yet.
    """
    queue: asyncio.Queue[tuple[int, UserReply | BaseException | None]] = asyncio.Queue(1)

    async def pump(index: int, replies: AsyncIterator[UserReply]) -> None:
        try:
            async with aclosing(replies):
                async for reply in replies:
                    await queue.put((index, reply))
            await queue.put((index, None))
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, replies)) for i, replies in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()  # every pump ends with None or its error
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@router.get("/v1/models")
async def models(request: Request):
    """The one model this server runs."""
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model_id:path}",
            responses={404: ERROR_RESPONSES[404]})
async def model(model_id: str, request: Request):
    """The model ``model_id``: this server's (by its served name or the path it was started
    with), or HTTP 404 ``model_not_found``."""
    check_model(request, model_id)
    return _model_card(request)


def _model_card(request: Request) -> dict[str, Any]:
    state = request.app.state
    return {"id": state.model_name, "object": "model", "created": state.started,
            "owned_by": "minisgl", "root": state.model_root}


@router.get("/health", responses={503: {"description": "A worker has stopped, or the server "
                                                      "cannot serve"}})
async def health(request: Request):
    """200 while every worker process runs; 503 and the reason otherwise (also
    while the API server cannot serve: its reply listener stopped, or it is shutting down)."""
    problem = request.app.state.health()
    unavailable = _frontend(request).lifecycle.unavailable
    if problem is None and unavailable is not None:
        problem = unavailable.message
    if problem is not None:
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    """Prometheus text: the workers' shared counters and the frontend's own."""
    state = request.app.state
    text = metrics_text(state.metrics(), _frontend(request))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


# =========================================================================== /metrics
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


def metrics_text(worker_counters: Mapping[str, int], frontend: RequestRouter) -> str:
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
        # Ending every request (``lifecycle.py``): replies held, failures, slow readers.
        ("minisgl_frontend_buffered_replies", "gauge",
         "Replies received and not yet taken by their reader.", frontend.num_buffered),
        ("minisgl_frontend_failed_total", "counter",
         "Requests that ended with an error.", frontend.stats.failed),
        ("minisgl_frontend_slow_readers_total", "counter",
         "Requests cut off because their client read too slowly.",
         frontend.lifecycle.slow_readers),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


# =========================================================================== access log
class AccessLog:
    """ASGI middleware: one log line per request, once its response has been sent to the end
    (for a stream, when the stream ends), with what a generation request noted in
    ``request.state.access`` (:class:`AccessRecord`): its uids, tokens and finish reasons."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        state = scope.setdefault("state", {})
        status = 0

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            logger.info("%s", access_line(scope["method"], scope["path"], status or 500,
                                          time.perf_counter() - start, state.get("access"),
                                          state.get("response_id")))


def access_line(method: str, path: str, status: int, seconds: float,
                record: AccessRecord | None, response_id: str | None) -> str:
    """``POST /v1/completions 200 uid=3 id=cmpl-... prompt_tokens=5 completion_tokens=16
    finish=length 0.052s``; the fields a request did not get to are ``-``."""
    def shown(values: Sequence[object]) -> str:
        return ",".join(map(str, values)) or "-"

    if record is None:
        fields = "uid=- prompt_tokens=- completion_tokens=- finish=-"
    else:
        done = bool(record.finish_reasons)
        fields = (f"uid={shown(record.uids)} "
                  f"prompt_tokens={record.prompt_tokens if done else '-'} "
                  f"completion_tokens={record.completion_tokens if done else '-'} "
                  f"finish={shown(record.finish_reasons)}")
    return f"{method} {path} {status} {fields} id={response_id or '-'} {seconds:.3f}s"


# =========================================================================== the schema
def openapi_schema(app: FastAPI, model_name: str, max_token_id: int | None,
                   max_tokens: int | None) -> dict[str, Any]:
    """The OpenAPI schema, as this server answers: its errors (400, never FastAPI's 422), the
    limits of the model it serves (the largest token id, the most tokens a request may ask
    for) and its model's id as the example of ``/v1/models/{model_id}``. Built once, on the
    first request for it."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "model_id":
                    parameter["schema"]["examples"] = [model_name]
    components = schema.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = components.get(name, {}).get("properties", {})
        if max_tokens is not None:
            for field_name in ("max_tokens", "max_completion_tokens"):
                if field_name in properties:
                    properties[field_name]["maximum"] = max_tokens
        if max_token_id is not None and "prompt" in properties:
            properties["prompt"].update(prompt_schema(max_token_id))
        if max_token_id is not None and "stop_token_ids" in properties:
            properties["stop_token_ids"]["anyOf"][0]["items"]["maximum"] = max_token_id
    return schema


# =========================================================================== the app
def answer_errors_as_openai(app: FastAPI) -> None:
    """Make every error leave as OpenAI's error object: FastAPI's and Starlette's own bodies
    (``{"detail": ...}``, status 422 for a bad body) are not what OpenAI clients expect."""

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


def create_app(frontend_factory: Callable[[], RequestRouter], model_name: str, *,
               model_root: str | None = None, aliases: Sequence[str] = (),
               vocab_size: int | None = None, max_seq_len: int | None = None,
               metrics: Callable[[], Mapping[str, int]] | None = None,
               health: Callable[[], str | None] | None = None) -> FastAPI:
    """The FastAPI application.

    Args:
        frontend_factory: builds the :class:`RequestRouter`. It is called in the app's
            lifespan, inside the server's event loop, where its async queues must live.
        model_name: the name ``/v1/models`` and every response report.
        model_root: the checkpoint directory, for ``/v1/models``.
        aliases: other names a request's ``model`` may give (the ``--model`` path as given).
        vocab_size, max_seq_len: the model's vocabulary and the longest request, for the
            limits the OpenAPI schema states (None: not stated).
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
    app.state.model_names = {model_name, *aliases}
    app.state.model_root = model_root or model_name
    app.state.vocab_size, app.state.max_seq_len = vocab_size, max_seq_len
    app.state.started = int(time.time())
    app.state.metrics = metrics or dict
    app.state.health = health or (lambda: None)
    app.include_router(router)
    app.add_middleware(AccessLog)
    max_token_id = None if vocab_size is None else vocab_size - 1

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(app, model_name, max_token_id, max_seq_len)
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]

    answer_errors_as_openai(app)
    return app
