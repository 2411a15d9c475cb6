"""How a route waits for its requests' replies: the whole answer, or the first reply and
then the rest, for a stream.

Every wait gives up when the HTTP client disconnects
(:func:`~minisgl.server.lifecycle.wait_or_disconnect`), and a request that failed is raised
as its :class:`~minisgl.server.protocol.APIError`, so the route answers with its status.
Chapter 16 tells the story.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from fastapi import Request

from minisgl.message import UserReply
from minisgl.server.frontend import RequestRouter
from minisgl.server.lifecycle import wait_or_disconnect
from minisgl.server.protocol import APIError


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


async def indexed(replies: AsyncIterator[UserReply]) -> AsyncIterator[tuple[int, UserReply]]:
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
