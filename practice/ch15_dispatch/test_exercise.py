"""Tests for the reply-routing exercise: they are its specification.

Every scenario runs under a time limit: a reader that waits for a reply it should already
have fails with a timeout instead of hanging the judge.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from dispatch import ReplyRouter

from minisgl.message import TokenUsage, UserReply

TIME_LIMIT_S = 3.0


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    async def limited() -> Any:
        try:
            return await asyncio.wait_for(scenario(), TIME_LIMIT_S)
        except asyncio.TimeoutError:
            pytest.fail("a reader was still waiting after 3 s: a reply it should have got was "
                        "lost, or its event was never set (or was cleared too late)")

    return asyncio.run(limited())


def replies_for(uid: int, words: list[str]) -> list[UserReply]:
    """One reply per word; the last one finishes the request."""
    last = len(words) - 1
    return [UserReply(uid, w, "length" if i == last else None,
                      TokenUsage(3, len(words)) if i == last else None)
            for i, w in enumerate(words)]


async def read_all(router: ReplyRouter, uid: int) -> list[UserReply]:
    return [reply async for reply in router.replies(uid)]


def test_replies_come_in_order_and_stop_after_the_finished_one() -> None:
    async def scenario() -> list[UserReply]:
        router = ReplyRouter()
        router.open(7)
        reader = asyncio.ensure_future(read_all(router, 7))
        for reply in replies_for(7, ["a", "b", "c"]):
            await asyncio.sleep(0)  # the reader gets to wait between two replies
            assert router.deliver(reply) is True, "deliver must return True for an open uid"
        return await reader

    got = run(scenario)
    assert [r.delta for r in got] == ["a", "b", "c"], "replies must come out in delivery order"
    assert got[-1].finished, "the finished reply must be yielded too (it carries the usage)"


def test_replies_delivered_before_anyone_reads_are_kept() -> None:
    async def scenario() -> list[str]:
        router = ReplyRouter()
        router.open(1)
        for reply in replies_for(1, ["early", "bird"]):
            router.deliver(reply)  # nobody is waiting yet
        return [r.delta for r in await read_all(router, 1)]

    assert run(scenario) == ["early", "bird"]


def test_each_request_gets_exactly_its_own_replies() -> None:
    words = {uid: [f"{uid}.{i}" for i in range(10)] for uid in range(50)}

    async def scenario() -> dict[int, list[str]]:
        router = ReplyRouter()
        for uid in words:
            router.open(uid)
        readers = {uid: asyncio.ensure_future(read_all(router, uid)) for uid in words}
        # The one inbox: every request's replies, interleaved at random, in bursts.
        queues = {uid: replies_for(uid, w) for uid, w in words.items()}
        rng = random.Random(15)
        while queues:
            uid = rng.choice(sorted(queues))
            router.deliver(queues[uid].pop(0))
            if not queues[uid]:
                del queues[uid]
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        return {uid: [r.delta for r in await reader] for uid, reader in readers.items()}

    assert run(scenario) == words


def test_a_reply_delivered_while_the_reader_is_busy_is_not_lost() -> None:
    async def scenario() -> list[str]:
        router = ReplyRouter()
        router.open(3)
        first, second = replies_for(3, ["first", "second"])
        router.deliver(first)
        got = []
        async for reply in router.replies(3):
            got.append(reply.delta)
            if reply.delta == "first":
                # Arrives while the reader is still handling the batch it took: it must
                # wake the reader again.
                router.deliver(second)
        return got

    assert run(scenario) == ["first", "second"]


def test_a_reply_nobody_waits_for_is_dropped() -> None:
    router = ReplyRouter()
    assert router.deliver(UserReply(42, "stray")) is False, \
        "deliver must return False for a uid that is not open"
    assert router.num_open == 0


def test_the_state_is_freed_after_the_finished_reply() -> None:
    async def scenario() -> int:
        router = ReplyRouter()
        router.open(5)
        for reply in replies_for(5, ["x", "y"]):
            router.deliver(reply)
        await read_all(router, 5)
        return router.num_open

    assert run(scenario) == 0, "a finished request must not stay open"


def test_a_reader_that_stops_early_frees_the_state() -> None:
    async def scenario() -> tuple[int, bool]:
        router = ReplyRouter()
        router.open(9)
        for reply in replies_for(9, ["a", "b", "c", "d"]):
            router.deliver(reply)
        stream = router.replies(9)
        await stream.__anext__()
        await stream.aclose()  # the client went away after one reply
        return router.num_open, router.deliver(UserReply(9, "late"))

    num_open, delivered = run(scenario)
    assert num_open == 0, "free the state in a `finally`: it must run when the reader stops"
    assert delivered is False, "after the reader left, its replies must be dropped"


def test_close_forgets_a_request() -> None:
    router = ReplyRouter()
    router.open(1)
    router.open(2)
    router.close(1)
    router.close(99)  # closing an unknown uid is harmless: the request may have just finished
    assert router.num_open == 1
    assert router.deliver(UserReply(1, "late")) is False
    assert router.deliver(UserReply(2, "on time")) is True


def test_opening_a_uid_twice_is_an_error() -> None:
    router = ReplyRouter()
    router.open(4)
    with pytest.raises(ValueError, match="4"):
        router.open(4)
