"""Error mapping: every error the API server answers with leaves as OpenAI's error object,
with its status; :func:`answer_errors_as_openai` installs one handler per kind of error.

Chapter 16 tells the story.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.server.lifecycle import ClientDisconnected
from minisgl.server.protocol import APIError, validation_error
from minisgl.utils.logger import get_logger

# A failing request is the API server's to report: its lines keep that module's logger name.
logger = get_logger("minisgl.server.api_server")


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
