"""Server-Sent Events responses that free their request at once when the stream stops early.

A streaming client that disconnects makes Starlette stop the response. Chapter 15 aborted the
request from the response's generator; since chapter 16 the generator chain does it itself
(:meth:`RequestRouter.replies <minisgl.server.frontend.RequestRouter.replies>` aborts its
request however its reader stops), and :class:`SSEResponse` closes that chain at once however
the response ends, so the scheduler stops generating for nobody.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse


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
