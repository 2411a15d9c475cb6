"""How a route waits for its requests' replies (one, or one per prompt of a list): the whole
answers, or the first replies and then the rest, for a stream.

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


async def whole_answers(request: Request, frontend: RequestRouter, uids: Sequence[int],
                        prompt_param: str) -> list[tuple[str, UserReply]]:
    """Requests ``uids``' whole texts and last replies, for a response that is not streamed.

    Nothing is sent to the client until the answers are complete, so a client that
    disconnects is not noticed by a failed write: a watcher waits for the disconnect at the
    same time, and wins the race if the client goes first. Collecting then stops, and
    :meth:`RequestRouter.replies` aborts the requests. The first request that failed answers
    for all, with its error's status and an OpenAI error body.
    """
    async def collect_all() -> list[tuple[str, UserReply]]:
        return await asyncio.gather(*(frontend.collect(uid) for uid in uids))

    answers = await wait_or_disconnect(collect_all(), request)
    for _, last in answers:
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
