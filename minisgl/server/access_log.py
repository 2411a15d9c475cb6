"""The access log: one line per HTTP request, written once its response has been sent to the
end (for a stream, when the stream ends).

A generation route fills in an :class:`AccessRecord` (``request.state.access``) as it goes;
the :class:`AccessLog` middleware writes the line. Chapter 16 tells the story.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from minisgl.message import UserReply
from minisgl.utils.logger import get_logger

# The access log speaks for the API server: its lines keep that module's logger name.
logger = get_logger("minisgl.server.api_server")


@dataclass
class AccessRecord:
    """What the access log line says of one generation request (filled in as it goes)."""

    uids: list[int] = field(default_factory=list)
    response_id: str | None = None  # pairs the response's id with the uids
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    refused: str | None = None  # the parameter an error response named (a 400's field)

    def add(self, reply: UserReply) -> None:
        """Note a request's last reply."""
        if reply.usage is not None:
            self.prompt_tokens += reply.usage.prompt_tokens
            self.completion_tokens += reply.usage.completion_tokens
        self.finish_reasons.append(reply.finish_reason or "error")

    def line(self, method: str, path: str, status: int, seconds: float) -> str:
        """``POST /v1/completions 200 uid=3 prompt_tokens=5 completion_tokens=16
        finish=length id=cmpl-... 0.052s``; the fields a request did not get to are ``-``. An
        error that named a parameter adds it: ``... id=- param=logit_bias 0.001s``."""
        done = bool(self.finish_reasons)
        refused = f"param={self.refused} " if self.refused else ""
        return (f"{method} {path} {status} uid={','.join(map(str, self.uids)) or '-'} "
                f"prompt_tokens={self.prompt_tokens if done else '-'} "
                f"completion_tokens={self.completion_tokens if done else '-'} "
                f"finish={','.join(self.finish_reasons) or '-'} id={self.response_id or '-'} "
                f"{refused}{seconds:.3f}s")


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
            record = state.get("access") or AccessRecord()  # no uid yet: every field is "-"
            logger.info("%s", record.line(scope["method"], scope["path"], status or 500,
                                          time.perf_counter() - start))
