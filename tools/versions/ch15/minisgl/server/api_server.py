"""The OpenAI-compatible HTTP API: the FastAPI app and its routes.

Each route parses its body (:mod:`minisgl.server.protocol`), submits the request through the
:class:`~minisgl.server.frontend.RequestRouter` and answers with the whole text or a stream of
Server-Sent Events (:mod:`minisgl.server.streaming`). :func:`create_app` builds the app:
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``
and ``GET /metrics``. Chapter 15 tells the story.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse

from minisgl.server.frontend import RequestRouter
from minisgl.server.metrics import metrics_text
from minisgl.server.protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from minisgl.server.responses import (
    ResponseMeta,
    chat_body,
    completion_body,
    stream_chat,
    stream_completion,
)
from minisgl.server.streaming import sse_response


# =========================================================================== routes
router = APIRouter()


def _frontend(request: Request) -> RequestRouter:
    return request.app.state.frontend


def _meta(request: Request, prefix: str, uid: int) -> ResponseMeta:
    # The uid is in the id, so a response can be matched with the workers' log lines.
    return ResponseMeta(f"{prefix}-{uid}", int(time.time()), request.app.state.model_name)


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


# =========================================================================== the app
def create_app(frontend_factory: Callable[[], RequestRouter], model_name: str, *,
               model_root: str | None = None,
               metrics: Callable[[], Mapping[str, int]] | None = None,
               health: Callable[[], str | None] | None = None) -> FastAPI:
    """The FastAPI application.

    Args:
        frontend_factory: builds the :class:`RequestRouter`. It is called in the app's
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
        return validation_error(exc.errors()).response()

    return app
