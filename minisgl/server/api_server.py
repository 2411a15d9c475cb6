"""The OpenAI-compatible HTTP API: the FastAPI app and its routes.

Each route checks its body (:mod:`minisgl.server.protocol`), submits the request through the
:class:`~minisgl.server.frontend.RequestRouter` and answers with the whole text or a stream of
Server-Sent Events (:mod:`minisgl.server.streaming`). :func:`create_app` builds the app:
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``
and ``GET /metrics``.

Every wait for replies gives up when the HTTP client disconnects
(:func:`~minisgl.server.lifecycle.wait_or_disconnect`), a request that failed is raised as its
:class:`~minisgl.server.protocol.APIError`, and every error leaves as OpenAI's error object,
with its status (:func:`answer_errors_as_openai`).

Chapter 15 tells the story; chapter 16 makes every request end cleanly and adds the access log
and the OpenAPI schema's limits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minisgl.core import SamplingParams
from minisgl.message import TextLogprobs, UserReply
from minisgl.server.access_log import AccessLog, AccessRecord
from minisgl.server.frontend import RequestRouter
from minisgl.server.lifecycle import ClientDisconnected, wait_or_disconnect
from minisgl.server.metrics import metrics_text
from minisgl.server.openapi import ERROR_RESPONSES, GENERATION_RESPONSES, openapi_schema
from minisgl.server.protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from minisgl.server.responses import ResponseMeta, completion_body, stream_completion
from minisgl.server.streaming import SSEResponse
from minisgl.server.structured import response_format_grammar
from minisgl.server.tools import (ToolChoice, attach_tool_calls, parse_tool_choice,
                                  stream_tool_calls)
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)


# =========================================================================== routes
router = APIRouter()


def check_model(request: Request, model: str | None) -> None:
    """An unknown ``model`` is HTTP 404 ``model_not_found``, as OpenAI, vLLM and SGLang answer;
    the served name and the path the server was started with are both known. Left out, the
    one model served answers."""
    if model is not None and model not in request.app.state.model_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{request.app.state.model_name!r}", "model",
                       code="model_not_found")


def checked_params(request: Request, body: ChatCompletionRequest | CompletionRequest,
                   max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
    """The body's sampling parameters, once its model, its fields and its ``stop_token_ids``
    are checked (the scheduler checks the prompt's token ids)."""
    check_model(request, body.model)
    body.check_supported()
    params = body.sampling_params(max_tokens, default_max_tokens)
    vocab_size = request.app.state.vocab_size
    bad = [t for t in params.stop_token_ids if vocab_size is not None and t >= vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids: token id {bad[0]} is outside the vocabulary "
                            f"(0..{vocab_size - 1})", "stop_token_ids")
    return params


@router.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """A chat turn: the tokenizer applies the model's chat template to ``messages``."""
    frontend: RequestRouter = request.app.state.frontend
    max_tokens = (body.max_tokens if body.max_completion_tokens is None
                  else body.max_completion_tokens)
    params = checked_params(request, body, max_tokens, DEFAULT_CHAT_MAX_TOKENS)
    if body.max_completion_tokens is not None and body.max_tokens is not None:
        # Both given: max_completion_tokens counts (as in vLLM); the other must still be valid.
        body.sampling_params(body.max_tokens, DEFAULT_CHAT_MAX_TOKENS)
        limit = request.app.state.max_seq_len
        if limit is not None and body.max_tokens > limit:
            raise APIError(400, f"max_tokens is {body.max_tokens}, but this server serves at "
                                f"most {limit} tokens per request", "max_tokens",
                           code="context_length_exceeded")
    tools = parse_tool_choice(body.tools, body.tool_choice, body.parallel_tool_calls)  # ch. 22
    params = constrained(params, body.response_format, tools)
    messages = [m.as_dict() for m in body.messages]
    uids = await submit_prompts(frontend, [messages], params, max_tokens is not None, body.n,
                                tools=tools.template_tools() if tools else None)
    return await answer(request, body, uids, "chatcmpl", tools)


@router.post("/v1/completions", responses=GENERATION_RESPONSES)
async def completions(body: CompletionRequest, request: Request):
    """A plain completion of ``prompt`` (text, or token ids), no chat template. A list of
    prompts is answered with one choice per prompt, ``index`` in the order given."""
    frontend: RequestRouter = request.app.state.frontend
    params = checked_params(request, body, body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
    params = constrained(params, body.response_format, None)  # chapter 22
    uids = await submit_prompts(frontend, body.prompts(), params, body.max_tokens is not None,
                                body.n)
    return await answer(request, body, uids, "cmpl")


def constrained(params: SamplingParams, response_format: dict[str, Any] | None,
                tools: ToolChoice | None) -> SamplingParams:
    """``params`` with the grammar the request asks for (chapter 22): calls that ``tool_choice``
    requires win over ``response_format``, which still shapes a turn that may call or not."""
    grammar = tools.grammar() if tools is not None else None
    grammar = grammar or response_format_grammar(response_format)
    return params if grammar is None else dataclasses.replace(params, grammar=grammar)


async def answer(request: Request, body: ChatCompletionRequest | CompletionRequest,
                 uids: list[int], id_prefix: str, tools: ToolChoice | None = None
                 ) -> Response | dict[str, Any]:
    """Answer requests ``uids`` (one per prompt; a chat turn has one): as a stream, or as one
    body once all are complete. The response's id is random, as OpenAI's are (unique across
    restarts); the access log's line pairs it with the uids. ``tools``: a chat turn's calls
    are read from its text (chapter 22)."""
    frontend: RequestRouter = request.app.state.frontend
    chat = isinstance(body, ChatCompletionRequest)
    prompt_param = "messages" if chat else "prompt"
    meta = ResponseMeta(f"{id_prefix}-{uuid.uuid4().hex}", int(time.time()),
                        request.app.state.model_name)
    request.state.access = record = AccessRecord(uids, meta.id)
    if body.stream:
        streams = await first_replies_then_rest(request, frontend, uids, prompt_param)
        merged = merge_replies(streams, record)
        if tools is not None and tools.parses_calls:  # chapter 22
            return SSEResponse(stream_tool_calls(merged, meta, len(uids), body.include_usage,
                                                 n=body.n))
        return SSEResponse(stream_completion(merged, meta, len(uids), body.include_usage, chat,
                                             logprobs=body.logprobs_asked() is not None,
                                             n=body.n))
    answers = await whole_answers(request, frontend, uids, prompt_param)
    for _, last, _ in answers:
        record.add(last)
    whole = completion_body(meta, answers, chat, logprobs=body.logprobs_asked() is not None,
                            n=body.n)
    return attach_tool_calls(whole) if tools is not None and tools.parses_calls else whole


async def submit_prompts(frontend: RequestRouter, prompts: Sequence[Any],
                         params: SamplingParams, strict_max_tokens: bool, n: int = 1,
                         tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Send every prompt as ``n`` requests of its own (text, token ids, or a chat's messages;
    choice ``j`` of a seeded request gets ``seed + j``, chapter 21); if one cannot be sent,
    abort the others. The uids are in choice order: prompt by prompt, choice by choice.
    ``tools``: a chat's functions, for its template (chapter 22)."""
    uids: list[int] = []
    try:
        for prompt, choice in itertools.product(prompts, range(n)):
            seeded = params if params.seed is None or choice == 0 else \
                dataclasses.replace(params, seed=params.seed + choice)
            if isinstance(prompt, str):
                source: dict[str, Any] = {"text": prompt}
            elif prompt and isinstance(prompt[0], dict):
                source = {"messages": prompt, "tools": tools}
            else:
                source = {"input_ids": list(prompt)}
            uids.append(await frontend.submit(seeded, strict_max_tokens=strict_max_tokens,
                                              **source))
    except BaseException:
        for uid in uids:
            frontend.abort(uid)
        raise
    return uids


# =========================================================================== replies
async def whole_answers(request: Request, frontend: RequestRouter, uids: Sequence[int],
                        prompt_param: str) -> list[tuple[str, UserReply, list[TextLogprobs]]]:
    """Requests ``uids``' whole texts, last replies and logprobs, for a response that is not
    streamed.

    Nothing is sent to the client until the answers are complete, so a client that
    disconnects is not noticed by a failed write: a watcher waits for the disconnect at the
    same time, and wins the race if the client goes first. Collecting then stops, and
    :meth:`RequestRouter.replies` aborts the requests. The first request that failed answers
    for all, with its error's status and an OpenAI error body.
    """
    async def collect_all() -> list[tuple[str, UserReply, list[TextLogprobs]]]:
        return await asyncio.gather(*(frontend.collect(uid) for uid in uids))

    answers = await wait_or_disconnect(collect_all(), request)
    for _, last, _ in answers:
        if last.error is not None:
            raise APIError.of(last.error, prompt_param)
    return answers


async def first_replies_then_rest(request: Request, frontend: RequestRouter,
                                  uids: Sequence[int],
                                  prompt_param: str) -> list[AsyncIterator[UserReply]]:
    """Requests ``uids``' replies for a streamed response, once each has its first reply.

    The response's headers (and its status, 200) go out with the first chunk, so the first
    replies are awaited before the response starts: a request the workers refuse at once (its
    prompt is too long) is still answered with a 400 and an error body, not a 200 stream
    holding an error. The client may disconnect during that wait, as it can while a whole
    answer is collected.
    """
    streams = [frontend.replies(uid) for uid in uids]

    async def first_replies() -> list[UserReply]:
        return await asyncio.gather(*(replies.__anext__() for replies in streams))

    try:
        firsts = await wait_or_disconnect(first_replies(), request)
        failed = next((first.error for first in firsts if first.error is not None), None)
        if failed is not None:
            raise APIError.of(failed, prompt_param)
    except BaseException:
        for replies in streams:
            await replies.aclose()
        raise
    return [_prepend(first, replies) for first, replies in zip(firsts, streams)]


async def _prepend(first: UserReply, rest: AsyncIterator[UserReply]) -> AsyncIterator[UserReply]:
    async with aclosing(rest):
        yield first
        if not first.finished:
            async for reply in rest:
                yield reply


async def merge_replies(streams: Sequence[AsyncIterator[UserReply]], record: AccessRecord
                        ) -> AsyncIterator[tuple[int, UserReply]]:
    """The replies of several requests as they come, each with its stream's index; each last
    reply is noted in ``record``, for the access log.

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
                    if reply.finished:
                        record.add(reply)
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


# =========================================================================== other routes
@router.get("/v1/models")
async def models(request: Request):
    """The one model this server runs."""
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model_id:path}", responses={404: ERROR_RESPONSES[404]})
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
    unavailable = request.app.state.frontend.unavailable
    problem = request.app.state.health() or (unavailable.message if unavailable else None)
    if problem is not None:
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    """Prometheus text: the workers' shared counters and the frontend's own."""
    text = metrics_text(request.app.state.metrics(), request.app.state.frontend)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


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


def answer_errors_as_openai(app: FastAPI) -> None:
    """Make every error leave as OpenAI's error object: FastAPI's and Starlette's own bodies
    (``{"detail": ...}``, status 422 for a bad body) are not what OpenAI clients expect."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return refusal(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refusal(request, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error = unreadable_body(exc.__cause__) or APIError(
            exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
            kind="invalid_request_error" if exc.status_code < 500 else "server_error")
        return error.response(headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: the client has gone

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unexpected error while serving a request", exc_info=exc)
        return APIError(500, f"internal server error: {type(exc).__name__}",
                        kind="server_error").response()


def refusal(request: Request, error: APIError) -> JSONResponse:
    """The response to a request refused with ``error``; the access log names its parameter."""
    request.state.access = getattr(request.state, "access", None) or AccessRecord()
    request.state.access.refused = error.param
    return error.response()


def unreadable_body(cause: BaseException | None) -> APIError | None:
    """Why FastAPI could not read a body, which it answers with a bare HTTP 400 "There was an
    error parsing the body": a body that is not UTF-8, as JSON must be (where its first bad
    byte is), or a client that left before its body arrived."""
    if isinstance(cause, UnicodeDecodeError):
        return APIError(400, f"the body is not valid UTF-8: byte 0x{cause.object[cause.start]:02x} "
                             f"at position {cause.start} ({cause.reason}); JSON bodies must be "
                             "encoded in UTF-8")
    if isinstance(cause, ClientDisconnect):
        return APIError(400, "the client disconnected before its request body arrived")
    return None
