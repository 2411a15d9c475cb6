"""Server-Sent Events responses that abort their request when the stream stops early.

A streaming client that disconnects makes Starlette stop the response; :func:`sse_response`
turns that into :meth:`RequestRouter.abort <minisgl.server.frontend.RequestRouter.abort>`, so
the scheduler stops generating for nobody. Chapter 15 tells the story; chapter 16 closes the
generator chain at once however the response ends (:class:`SSEResponse`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import StreamingResponse

from minisgl.server.frontend import RequestRouter


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
