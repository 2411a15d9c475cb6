"""Server-Sent Events responses that abort their request when the stream stops early.

A streaming client that disconnects makes Starlette stop the response; :func:`sse_response`
turns that into :meth:`RequestRouter.abort <minisgl.server.frontend.RequestRouter.abort>`, so
the scheduler stops generating for nobody. Chapter 15 tells the story.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from minisgl.server.frontend import RequestRouter


async def abort_on_disconnect(frontend: RequestRouter, uid: int,
                              chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass ``chunks`` through; if the stream stops before they end, abort request ``uid``.

    When the client disconnects, Starlette stops the response: it cancels the task iterating
    this generator (a ``CancelledError`` rises out of the ``await`` the stream waits in, through
    every generator below), or, when the disconnect shows as a failed write, drops the
    generator, which Python then closes. Either way ``finally`` runs with the stream
    unfinished. :meth:`RequestRouter.abort` only schedules its send: a cancelled task may not
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


def sse_response(frontend: RequestRouter, uid: int,
                 chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(abort_on_disconnect(frontend, uid, chunks),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
