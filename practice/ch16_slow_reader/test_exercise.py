"""Tests for the bounded reply buffer: they are its specification.

The last two plug your buffer into the real FrontendManager (chapter 16), over fake workers,
and check that it catches a slow reader. Every scenario runs under a time limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from reply_buffer import ReplyBuffer

from minisgl.core import SamplingParams
from minisgl.message import AbortRequest, RequestError, TokenizeRequest, TokenUsage, UserReply

ERROR = UserReply.failure(1, RequestError("too slow", status=408, kind="timeout_error"))


def reply(text: str, last: bool = False) -> UserReply:
    return UserReply(1, text, "length" if last else None, TokenUsage(2, 3) if last else None)


def run(scenario: Callable[[], Awaitable[Any]], limit_s: float = 5.0) -> Any:
    async def limited() -> Any:
        try:
            return await asyncio.wait_for(scenario(), limit_s)
        except asyncio.TimeoutError:
            pytest.fail(f"still waiting after {limit_s} s: a reply was lost, or the event was "
                        "not set when it should have been")

    return asyncio.run(limited())


def test_capacity_must_be_a_positive_int() -> None:
    for bad in (0, -3, True, 2.5, "4"):
        with pytest.raises(ValueError, match=repr(bad) if not isinstance(bad, str) else "'4'"):
            ReplyBuffer(bad)
    assert ReplyBuffer(1).capacity == 1


def test_push_keeps_replies_in_order_and_take_hands_them_all_over() -> None:
    buffer = ReplyBuffer(8)
    assert buffer.push(reply("a"), now=1.0) is True, "push returns True when it keeps the reply"
    assert buffer.push(reply("b"), now=2.0) is True
    assert buffer.event.is_set(), "push must set the event: a reader may be waiting on it"
    assert [r.delta for r in buffer.take()] == ["a", "b"], "take: every reply, oldest first"
    assert not buffer.event.is_set(), "take must clear the event: nothing is left to take"
    assert buffer.take() == [] and len(buffer.replies) == 0


def test_a_full_buffer_refuses_and_keeps_nothing() -> None:
    buffer = ReplyBuffer(2)
    assert buffer.push(reply("a"), 0.0) and buffer.push(reply("b"), 0.0)
    assert buffer.push(reply("c"), 0.0) is False, "a full buffer must refuse (return False)"
    assert [r.delta for r in buffer.replies] == ["a", "b"], "a refused reply must not be kept"
    buffer.take()
    assert buffer.push(reply("d"), 0.0) is True, "room again once the reader took its replies"


def test_the_lag_runs_from_the_oldest_reply_not_taken() -> None:
    buffer = ReplyBuffer(8)
    assert buffer.lag(now=5.0) == 0.0, "nothing waits: no lag"
    buffer.push(reply("a"), now=10.0)
    buffer.push(reply("b"), now=12.0)  # the oldest still says 10.0
    assert buffer.lag(now=13.5) == pytest.approx(3.5), "lag = now - when the oldest arrived"
    assert buffer.lag(now=9.0) == 0.0, "the lag is never negative"
    buffer.take()
    assert buffer.lag(now=20.0) == 0.0 and buffer.behind_since is None, \
        "take: the reader caught up, the clock stops"
    buffer.push(reply("c"), now=21.0)
    assert buffer.lag(now=22.0) == pytest.approx(1.0), "the clock restarts on an empty buffer"


def test_the_last_reply_marks_the_buffer_finished() -> None:
    buffer = ReplyBuffer(8)
    buffer.push(reply("a"), 0.0)
    assert not buffer.finished
    buffer.push(reply("", last=True), 0.0)
    assert buffer.finished, "a pushed reply that is the request's last sets finished"
    buffer.take()
    assert buffer.finished, "finished stays True once the last reply has arrived"


def test_fail_leaves_the_error_alone_and_wakes_the_reader() -> None:
    buffer = ReplyBuffer(2)
    buffer.push(reply("a"), 1.0)
    buffer.push(reply("b"), 2.0)  # full
    buffer.take()
    buffer.push(reply("c"), 3.0)
    buffer.event.clear()  # pretend the reader is waiting
    buffer.fail(ERROR, now=4.0)
    assert list(buffer.replies) == [ERROR], "fail: the buffered replies go, the error stays"
    assert buffer.failed and buffer.finished, "fail sets both failed and finished"
    assert buffer.event.is_set(), "fail must wake the reader: it has an error to read"
    assert buffer.lag(now=6.0) == pytest.approx(2.0), "fail restarts the clock at now"
    full = ReplyBuffer(1)
    full.push(reply("x"), 0.0)
    full.fail(ERROR, 0.0)
    assert list(full.replies) == [ERROR], "the error always fits, even in a full buffer"


def test_a_waiting_reader_is_woken_by_push() -> None:
    async def scenario() -> list[str]:
        buffer = ReplyBuffer(8)

        async def reader() -> list[str]:
            got: list[str] = []
            while not got or not got[-1].endswith("!"):
                await buffer.event.wait()
                got += [r.delta for r in buffer.take()]
            return got

        task = asyncio.ensure_future(reader())
        for text in ("one", "two", "three!"):
            await asyncio.sleep(0.01)
            buffer.push(reply(text), asyncio.get_running_loop().time())
        return await task

    assert run(scenario) == ["one", "two", "three!"]


# --------------------------------------------------------------------------- in the frontend
class EndlessWorkers:
    """Stand-ins for the workers: every request generates a reply every 10 ms, until it is
    aborted."""

    def __init__(self) -> None:
        self.replies: asyncio.Queue[UserReply] = asyncio.Queue()
        self.received: list[Any] = []

    async def put(self, message: Any) -> None:
        self.received.append(message)
        if isinstance(message, TokenizeRequest):
            asyncio.ensure_future(self._generate(message.uid))

    async def _generate(self, uid: int) -> None:
        for i in range(500):
            if AbortRequest(uid) in self.received:
                return
            await self.replies.put(UserReply(uid, f"w{i} "))
            await asyncio.sleep(0.01)

    async def get(self) -> UserReply:
        return await self.replies.get()


def frontend_with_your_buffer(monkeypatch: pytest.MonkeyPatch, **options: Any) -> Any:
    from minisgl.server import frontend

    monkeypatch.setattr(frontend, "ReplyBuffer", ReplyBuffer)
    workers = EndlessWorkers()
    return frontend.FrontendManager([workers], workers, **options), workers


def test_the_frontend_cuts_off_a_reader_that_stays_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> tuple[UserReply, list[Any]]:
        frontend, workers = frontend_with_your_buffer(monkeypatch, slow_reader_timeout_s=0.2)
        uid = await frontend.submit(SamplingParams(), text="go")
        replies = frontend.replies(uid)
        await replies.__anext__()
        await asyncio.sleep(0.8)  # the reader does not come back in time
        last = [r async for r in replies][-1]
        await frontend.close()
        return last, workers.received

    last, received = run(scenario)
    assert last.finish_reason == "error" and last.error.code == "slow_reader", \
        "a reader behind for longer than the timeout gets the slow-reader error"
    assert AbortRequest(0) in received, "and its request is aborted"


def test_the_frontend_never_holds_more_than_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> tuple[int, UserReply]:
        frontend, _ = frontend_with_your_buffer(monkeypatch, reply_buffer_size=5,
                                                slow_reader_timeout_s=30)
        uid = await frontend.submit(SamplingParams(), text="go")
        most = 0
        for _ in range(20):  # nobody reads; the replies pile up
            most = max(most, frontend.num_buffered)
            await asyncio.sleep(0.01)
        last = [r async for r in frontend.replies(uid)][-1]
        await frontend.close()
        return most, last

    most, last = run(scenario)
    assert most <= 5, f"the frontend held {most} replies for one reader; the bound is 5"
    assert last.error is not None and last.error.code == "slow_reader"
