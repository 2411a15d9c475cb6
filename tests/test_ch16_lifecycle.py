"""Chapter 16: every request ends, and ends cleanly, whatever happens to it.

What these tests pin down, gap by gap (each test fails on chapter 15's code):

1. a reader that stops early (a ``break`` at the last reply, a cancelled task, a reader that
   just goes away, a stream closed while it waits to write) leaves no state in the frontend;
2. a client that disconnects while it waits for a whole (non-streamed) answer gets its request
   aborted: the scheduler stops generating and frees its pages;
3. the detokenizer holds a request's text state while it runs and drops it on abort (through
   the real server and ``/metrics``);
4. a prompt longer than the context (the model's, or what the KV pool can hold), a token id
   outside the vocabulary, a conversation the chat template refuses: answered with HTTP 400
   and an OpenAI error body, streamed or not, and every process forgets the request;
5. the frontend holds a bounded number of replies per request, and a client that reads more
   slowly than the engine writes is cut off with an error event;
6. a failure in a worker becomes an error reply for the requests it hits (HTTP 500, or an
   error event mid-stream) and the worker serves on; a worker process that dies makes every
   waiting request fail at once, ``/health`` answer 503 and new requests be refused;
7. malformed JSON, wrong types, out-of-range values, unknown paths: 4xx with OpenAI's error
   object, naming the parameter;
8. SIGTERM, and Ctrl-C (SIGINT to the whole process group), on a server busy streaming: the
   streams end with an error event and ``[DONE]`` within ``--shutdown-timeout``, and no
   process is left; a launcher killed with SIGKILL leaves no worker either; Ctrl-C in the shell
   stops the answer, not the shell.

And a load test: 128 concurrent streaming clients, a third of them leaving at random points;
afterwards the server holds nothing, and every client that stayed got a complete stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortRequest,
    DetokenizeRequest,
    FrontendMessage,
    TokenizeRequest,
    TokenizerMessage,
    TokenUsage,
    UserReply,
    UserRequest,
)
from minisgl.server.api_server import create_app
from minisgl.server.frontend import RequestRouter
from minisgl.shell import Shell
from minisgl.utils.queues import ZmqAsyncPullQueue, ZmqPushQueue, ipc_address
from server_process import (  # tools/, see conftest.py
    ServerProcess,
    still_running,
    stream_in_thread,
)

STARTUP_TIMEOUT_S = 180.0


# =========================================================================== fake workers
class FakeWorkers:
    """A tokenizer, the scheduler and the detokenizer at once, answering on ``replies``.

    Each word of the prompt comes back as one reply; the last finishes with ``"length"``.
    A prompt may ask for trouble: ``"endless ..."`` never finishes (a reply every 10 ms until
    the request is aborted), ``"refuse ..."`` is
    answered at once with a 400 error (what the scheduler says of a prompt too long),
    ``"crash ..."`` sends two words, then a 500 error (a worker that failed mid-request).
    """

    def __init__(self, replies: asyncio.Queue[UserReply]) -> None:
        self.replies = replies
        self.received: list[Any] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def put(self, message: Any) -> None:
        self.received.append(message)
        if not isinstance(message, TokenizeRequest):
            return
        prompt = (message.messages[-1]["content"] if message.messages is not None
                  else message.text or " ".join(map(str, message.input_ids or ())))
        words = [w + " " for w in prompt.split()] or ["."]
        uid = message.uid
        if words[0] == "refuse ":
            from minisgl.message import RequestError

            await self.replies.put(UserReply.failure(uid, RequestError(
                "the prompt is too long", param="prompt", code="context_length_exceeded")))
            return
        if words[0] == "crash ":
            from minisgl.message import RequestError

            for word in words[:2]:
                await self.replies.put(UserReply(uid, word))
            await self.replies.put(UserReply.failure(uid, RequestError(
                "the detokenizer failed", status=500, kind="server_error")))
            return
        endless = words[0] == "endless "
        for i, word in enumerate(words):
            last = i == len(words) - 1 and not endless
            await self.replies.put(UserReply(uid, word, "length" if last else None,
                                             TokenUsage(len(words), len(words)) if last else None))
        if endless:  # an engine that goes on generating until it is told to stop
            self.tasks.append(asyncio.ensure_future(self._generate(uid)))

    async def _generate(self, uid: int) -> None:
        for _ in range(1000):
            await asyncio.sleep(0.01)
            if AbortRequest(uid) in self.received:
                return
            await self.replies.put(UserReply(uid, "more "))


class FakeInbox:
    def __init__(self, replies: asyncio.Queue[UserReply]) -> None:
        self.replies = replies

    async def get(self) -> UserReply:
        return await self.replies.get()


def fake_frontend(**options: Any) -> tuple[RequestRouter, FakeWorkers]:
    """A frontend over fake workers; call it inside the event loop."""
    replies: asyncio.Queue[UserReply] = asyncio.Queue()
    fake = FakeWorkers(replies)
    return RequestRouter([fake], FakeInbox(replies), **options), fake


def run(scenario: Any, timeout_s: float = 10.0) -> Any:
    """Run a coroutine function; a hang fails the test instead of hanging it."""
    async def limited() -> Any:
        return await asyncio.wait_for(scenario(), timeout_s)

    return asyncio.run(limited())


def aborts(fake: FakeWorkers) -> list[int]:
    return [m.uid for m in fake.received if isinstance(m, AbortRequest)]


# =========================================================================== 1. generators
def test_a_reader_that_stops_at_the_last_reply_leaves_nothing_behind() -> None:
    async def scenario() -> tuple[int, int, list[int]]:
        frontend, fake = fake_frontend()
        uid = await frontend.submit(SamplingParams(), text="three little words")
        replies = frontend.replies(uid)  # kept: the garbage collector cannot close it for us
        async for reply in replies:
            if reply.finished:
                break  # the caller is done; it never resumes the generator
        live_at_once = frontend.num_live
        await asyncio.sleep(0.05)
        await frontend.close()
        return live_at_once, frontend.stats.finished, aborts(fake)

    live, finished, aborted = run(scenario)
    assert live == 0, "the state must be freed when the last reply is taken, not later"
    assert finished == 1 and aborted == [], "a finished request is not aborted"


def test_a_cancelled_reader_aborts_and_frees_its_request() -> None:
    async def scenario() -> tuple[int, list[int], int]:
        frontend, fake = fake_frontend()
        uid = await frontend.submit(SamplingParams(), text="endless story goes on")

        async def read() -> None:
            async for _ in frontend.replies(uid):
                pass

        task = asyncio.ensure_future(read())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # the abort's send runs as a task
        live = frontend.num_live
        await frontend.close()
        return live, aborts(fake), frontend.stats.aborted

    live, aborted, count = run(scenario)
    assert live == 0 and aborted == [0] and count == 1


def test_an_abandoned_reader_is_freed_by_the_watchdog() -> None:
    """A caller that breaks out early and never closes the generator: the request is cut off
    as a slow reader, and its state freed once nobody comes for the error either."""
    async def scenario() -> tuple[list[int], list[int], int]:
        frontend, fake = fake_frontend(slow_reader_timeout_s=0.1)
        uid = await frontend.submit(SamplingParams(), text="endless one two three")
        replies = frontend.replies(uid)
        await replies.__anext__()  # one reply, then the caller walks away (holding it)
        seen = []
        for _ in range(20):  # the engine goes on generating
            seen.append(frontend.num_live)
            await asyncio.sleep(0.05)
        live = frontend.num_live
        await frontend.close()
        return seen, aborts(fake), live

    seen, aborted, live = run(scenario)
    assert seen[0] == 1 and seen[-1] == 0 and live == 0
    assert aborted == [0], "the workers must be told to stop the abandoned request"


# --------------------------------------------------------------------------- a tiny ASGI client
@dataclass
class AsgiCall:
    """One HTTP request played straight into the app, with a client that can stall its reads
    (``send`` blocks after ``stall_after`` body chunks) and disconnect (``disconnect``)."""

    method: str
    path: str
    body: dict[str, Any]
    stall_after: int | None = None
    sent: list[dict[str, Any]] = field(default_factory=list)
    disconnect: asyncio.Event = field(default_factory=asyncio.Event)
    stalled: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, app: Any) -> None:
        data = json.dumps(self.body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": self.method, "scheme": "http",
                 "path": self.path, "raw_path": self.path.encode(), "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(data)).encode())]}
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": data, "more_body": False}
            await self.disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            self.sent.append(message)
            chunks = sum(m["type"] == "http.response.body" for m in self.sent)
            if self.stall_after is not None and chunks >= self.stall_after:
                self.stalled.set()
                await asyncio.Event().wait()  # the client's socket is full: for ever

        await app(scope, receive, send)

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"),
                    None)


def test_a_stream_closed_while_it_waits_to_write_frees_its_request_at_once() -> None:
    """The client stops reading, then disconnects: Starlette cancels the stream while it
    waits in ``send``, which leaves the generator suspended at a ``yield``."""
    async def scenario() -> tuple[int | None, int, list[int]]:
        frontend, fake = fake_frontend()
        app = create_app(lambda: frontend, "fake")
        app.state.frontend = frontend
        call = AsgiCall("POST", "/v1/completions",
                        {"prompt": "endless " + "word " * 50, "stream": True}, stall_after=3)
        task = asyncio.ensure_future(call(app))
        await call.stalled.wait()
        call.disconnect.set()
        await task
        live_at_once = frontend.num_live  # no await since the response returned
        await asyncio.sleep(0)
        await frontend.close()
        return call.status, live_at_once, aborts(fake)

    status, live, aborted = run(scenario)
    assert status == 200
    assert live == 0, "the response must close its generator, not leave it to the GC"
    assert aborted == [0]


# =========================================================================== 2. disconnects
def test_a_whole_answer_is_aborted_when_its_client_disconnects() -> None:
    async def scenario() -> tuple[int, list[int]]:
        frontend, fake = fake_frontend()
        app = create_app(lambda: frontend, "fake")
        app.state.frontend = frontend
        call = AsgiCall("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "endless answer please"}]})
        task = asyncio.ensure_future(call(app))
        await asyncio.sleep(0.1)  # the answer is being collected
        call.disconnect.set()
        await asyncio.wait_for(task, 2)  # chapter 15 waits here for ever
        await asyncio.sleep(0)
        live = frontend.num_live
        await frontend.close()
        return live, aborts(fake)

    live, aborted = run(scenario)
    assert live == 0 and aborted == [0]


# =========================================================================== 5. slow readers
def test_reply_buffer_is_bounded_and_measures_the_readers_lag() -> None:
    from minisgl.server.lifecycle import ReplyBuffer

    async def scenario() -> None:
        buffer = ReplyBuffer(capacity=3)
        assert buffer.lag(now=5.0) == 0.0
        assert all(buffer.push(UserReply(1, str(i)), now=10.0 + i) for i in range(3))
        assert buffer.push(UserReply(1, "3"), now=13.0) is False, "a full buffer refuses"
        assert buffer.lag(now=14.5) == 4.5, "the lag runs from the oldest reply not taken"
        assert [r.delta for r in buffer.take()] == ["0", "1", "2"]
        assert buffer.lag(now=20.0) == 0.0 and not buffer.event.is_set()
        buffer.push(UserReply(1, "4"), now=21.0)
        buffer.fail(UserReply.failure(1, _error()), now=22.0)
        assert [r.finish_reason for r in buffer.take()] == ["error"], "the error alone remains"
        assert buffer.failed and buffer.finished

    run(scenario)


def _error(status: int = 500) -> Any:
    from minisgl.message import RequestError

    return RequestError("boom", status=status, kind="server_error")


def test_a_reader_that_stays_behind_is_cut_off_with_an_error() -> None:
    async def scenario() -> tuple[list[UserReply], list[int], int]:
        frontend, fake = fake_frontend(slow_reader_timeout_s=0.2)
        uid = await frontend.submit(SamplingParams(), text="endless a b c")
        replies = frontend.replies(uid)
        got = [await replies.__anext__()]
        await asyncio.sleep(0.6)  # a reader that does not come back for more in time
        async for reply in replies:
            got.append(reply)
        await asyncio.sleep(0)
        slow = frontend.stats.slow_readers
        await frontend.close()
        return got, aborts(fake), slow

    got, aborted, slow = run(scenario)
    assert got[-1].finish_reason == "error" and got[-1].error.code == "slow_reader"
    # The first batch was taken already; what piled up behind the reader is dropped.
    assert [r.delta for r in got[:-1]] == ["endless ", "a ", "b ", "c "]
    assert aborted == [0] and slow == 1


def test_a_reader_that_lets_replies_pile_up_is_cut_off_at_once() -> None:
    async def scenario() -> tuple[UserReply, int, list[int]]:
        frontend, fake = fake_frontend(reply_buffer_size=4)
        uid = await frontend.submit(SamplingParams(), text="endless " + "w " * 20)
        await asyncio.sleep(0.05)  # 21 replies arrive; nobody reads
        buffered = frontend.num_buffered
        last = [r async for r in frontend.replies(uid)][-1]
        await frontend.close()
        return last, buffered, aborts(fake)

    last, buffered, aborted = run(scenario)
    assert buffered == 1, "the frontend holds the error alone, not 21 replies"
    assert last.error.code == "slow_reader" and aborted == [0]


def test_the_policy_decides_on_the_clock_it_is_given() -> None:
    """The router's rules for ending requests early, run on a clock the test chooses: nothing ends before the
    timeout, a reader behind for longer is cut off (and the workers told), and an error nobody
    comes for is forgotten. The router changes nothing by itself meanwhile."""
    async def scenario() -> tuple[list[Any], list[int], int]:
        frontend, fake = fake_frontend(slow_reader_timeout_s=30)
        uid = await frontend.submit(SamplingParams(), text="endless x")
        await asyncio.sleep(0.05)  # replies arrive; nobody reads them
        now = time.monotonic()
        states = []
        for later in (0, 31, 62):
            frontend.check(now + later)
            await asyncio.sleep(0)  # the abort's send runs as a task
            buffer = frontend._pending.get(uid)  # the router's own state
            states.append(None if buffer is None else
                          (buffer.failed, [r.error.code for r in buffer.replies if r.error]))
        slow = frontend.stats.slow_readers
        await frontend.close()
        return states, aborts(fake), slow

    states, aborted, slow = run(scenario)
    assert states[0] == (False, []), "a reader behind for less than the timeout is left alone"
    assert states[1] == (True, ["slow_reader"]) and aborted == [0] and slow == 1
    assert states[2] is None, "an error nobody came for is forgotten after another timeout"


def test_a_reader_that_keeps_up_is_not_cut_off_by_a_burst(tmp_path: Path) -> None:
    """Replies that reach the inbox while the event loop is busy (a fast engine) come out of
    ZMQ back to back, without a pause; the reader waiting for them is not a slow reader."""
    address = ipc_address("inbox", directory=tmp_path)

    async def scenario() -> tuple[list[UserReply], int]:
        inbox = ZmqAsyncPullQueue(address, FrontendMessage, bind=True)
        detokenizer = ZmqPushQueue(address, FrontendMessage, bind=False)
        frontend = RequestRouter([FakeWorkers(asyncio.Queue())], inbox, reply_buffer_size=4)
        uid = await frontend.submit(SamplingParams(), text="quiet")

        async def read_all() -> list[UserReply]:
            return [r async for r in frontend.replies(uid)]

        reader = asyncio.ensure_future(read_all())
        await asyncio.sleep(0.05)  # the reader waits for its first reply
        for i in range(40):  # 40 frames of one reply, then 1 frame of 40
            detokenizer.put(UserReply(uid, f"{i} "))
        detokenizer.put_many(UserReply(uid, f"{i} ", "length" if i == 79 else None)
                             for i in range(40, 80))
        time.sleep(0.3)  # the loop is busy while they arrive
        got = await reader
        slow = frontend.stats.slow_readers
        await frontend.close()
        detokenizer.close()
        inbox.close()
        return got, slow

    got, slow = run(scenario)
    assert slow == 0, "a reader that was waiting was cut off as a slow reader"
    assert [r.delta for r in got] == [f"{i} " for i in range(80)]
    assert got[-1].finish_reason == "length"


# =========================================================================== 6/7. errors over HTTP
@pytest.fixture()
def fake_client() -> Iterator[TestClient]:
    app = create_app(lambda: fake_frontend()[0], "fake-model", health=lambda: None)
    with TestClient(app) as client:
        yield client


def sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line]


def test_a_refused_request_is_a_400_streamed_or_not(fake_client: TestClient) -> None:
    for path, body, param in (
            ("/v1/completions", {"prompt": "refuse this"}, "prompt"),
            ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "refuse this"}]}, "messages")):
        for stream in (False, True):
            response = fake_client.post(path, json={**body, "stream": stream})
            assert response.status_code == 400, (path, stream, response.text)
            assert response.json() == {"error": {
                "message": "the prompt is too long", "type": "invalid_request_error",
                "param": param, "code": "context_length_exceeded"}}
    metrics = fake_client.get("/metrics").text
    assert "minisgl_frontend_live_requests 0" in metrics
    assert "minisgl_frontend_failed_total 4" in metrics


def test_a_worker_failure_is_a_500_or_an_error_event_mid_stream(
        fake_client: TestClient) -> None:
    response = fake_client.post("/v1/completions", json={"prompt": "crash now"})
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "the detokenizer failed",
                                        "type": "server_error", "param": None, "code": None}
    with fake_client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "crash now"}], "stream": True}) as r:
        assert r.status_code == 200  # the first reply was text: the stream had begun
        lines = sse_lines(r)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["crash ", "now "]
    assert events[-1] == {"error": {"message": "the detokenizer failed", "type": "server_error",
                                    "param": None, "code": None}}
    assert "minisgl_frontend_live_requests 0" in fake_client.get("/metrics").text


@pytest.mark.parametrize("body, status, message, param", [
    (b'{"prompt": "x", ', 400, "the body is not valid JSON", None),
    (b'[1, 2, 3]', 400, "Input should be a valid dictionary", None),
    (b'{"prompt": "x", "temperature": "hot"}', 400, "Input should be a valid number",
     "temperature"),
    (b'{"prompt": "x", "max_tokens": "12"}', 400, "Input should be a valid integer",
     "max_tokens"),
    (b'{"prompt": "x", "stream": "yes"}', 400, "Input should be a valid boolean", "stream"),
    (b'{"prompt": "x", "temperature": -0.5}', 400, "temperature must be a finite number >= 0",
     "temperature"),
    (b'{"prompt": "x", "top_p": 1.5}', 400, "top_p must be a number in (0, 1]", "top_p"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens must be an integer >= 1",
     "max_tokens"),
    (b'{"prompt": "x", "seed": 1180591620717411303424}', 400,
     "Input should be less than or equal to 9007199254740991", "seed"),
    (b'{"prompt": "x", "top_k": 1180591620717411303424}', 400,
     "Input should be less than or equal to", "top_k"),
    (b'{"prompt": [1, 1180591620717411303424]}', 400, "less than or equal to", "prompt.1"),
    (b'{"prompt": "x", "stop": [""]}', 400, "stop must be a sequence of non-empty strings",
     "stop"),
    (b'{"messages": []}', 400, "List should have at least 1 item", "messages"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}', 400, "must be one of 'system'",
     "messages.0.role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', 400, "Input should be a valid",
     "messages.0.content"),
])
def test_bad_bodies_get_an_openai_error_naming_the_parameter(
        fake_client: TestClient, body: bytes, status: int, message: str,
        param: str | None) -> None:
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    response = fake_client.post(path, content=body,
                                headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"], error
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_unknown_paths_and_methods_get_openai_errors(fake_client: TestClient) -> None:
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        response = fake_client.request(method, path)
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert path in response.json()["error"]["message"]


# =========================================================================== 6. dead workers
def test_a_dead_worker_fails_every_waiting_request_and_refuses_new_ones() -> None:
    problem: list[str] = []

    async def scenario() -> tuple[UserReply, float, Any]:
        frontend, _ = fake_frontend(health=lambda: problem[0] if problem else None,
                                    slow_reader_timeout_s=30)
        frontend.start()
        uid = await frontend.submit(SamplingParams(), text="endless wait")
        start = time.monotonic()
        problem.append("the scheduler process (pid 1) exited with code -9")
        last = [r async for r in frontend.replies(uid)][-1]
        waited = time.monotonic() - start
        from minisgl.server.protocol import APIError

        with pytest.raises(APIError) as refused:
            await frontend.submit(SamplingParams(), text="too late")
        await frontend.close()
        return last, waited, refused.value

    last, waited, refused = run(scenario)
    assert last.error.status == 503 and "scheduler" in last.error.message
    assert waited < 1.0, "the watchdog checks the workers a few times a second"
    assert refused.status_code == 503 and "scheduler" in refused.message


def test_a_dead_listener_fails_every_waiting_request() -> None:
    class BrokenInbox:
        def __init__(self) -> None:
            self.go = asyncio.Event()

        async def get(self) -> UserReply:
            await self.go.wait()
            raise RuntimeError("the inbox socket broke")

    async def scenario() -> UserReply:
        inbox = BrokenInbox()
        frontend = RequestRouter([FakeWorkers(asyncio.Queue())], inbox)
        uid = await frontend.submit(SamplingParams(), text="anything")
        inbox.go.set()
        last = [r async for r in frontend.replies(uid)][-1]
        await frontend.close()
        return last

    last = run(scenario)
    assert last.error.status == 503 and "listener" in last.error.message


# =========================================================================== 8. the shell's Ctrl-C
def test_ctrl_c_in_the_shell_stops_the_answer_not_the_shell() -> None:
    lines = iter(["endless story please", "and now?", "/exit"])

    async def scenario() -> tuple[str, list[Any], list[dict[str, str]]]:
        import io

        frontend, fake = fake_frontend()
        out = io.StringIO()
        shell = Shell(frontend, SamplingParams(), out)

        async def read_line(prompt: str) -> str:
            return next(lines)

        async def press_ctrl_c() -> None:
            while "story " not in out.getvalue():
                await asyncio.sleep(0.01)
            shell.interrupt()

        presser = asyncio.ensure_future(press_ctrl_c())
        await shell.run(read_line)
        await presser
        await frontend.close()
        return out.getvalue(), fake.received, shell.history

    output, received, history = run(scenario)
    assert "[interrupted]" in output and "and now? " in output  # the next question's answer
    assert [m.uid for m in received if isinstance(m, AbortRequest)] == [0]
    assert [h["role"] for h in history] == ["user", "assistant"] * 2
    assert history[1]["content"].startswith("endless story please")


def test_ctrl_c_at_the_prompt_leaves_the_shell() -> None:
    async def scenario() -> None:
        import io

        frontend, _ = fake_frontend()
        shell = Shell(frontend, SamplingParams(), io.StringIO())

        async def read_line(prompt: str) -> str:
            await asyncio.Event().wait()  # the user types nothing
            return ""

        loop = asyncio.get_running_loop()
        loop.call_later(0.05, shell.interrupt)
        try:
            with pytest.raises(KeyboardInterrupt):
                await shell.run(read_line)
        finally:
            await frontend.close()

    run(scenario)


def test_the_shell_prints_a_failed_request_s_error() -> None:
    lines = iter(["refuse it", "/exit"])

    async def scenario() -> tuple[str, list[dict[str, str]]]:
        import io

        frontend, _ = fake_frontend()
        out = io.StringIO()
        shell = Shell(frontend, SamplingParams(), out)

        async def read_line(prompt: str) -> str:
            return next(lines)

        await shell.run(read_line)
        await frontend.close()
        return out.getvalue(), shell.history

    output, history = run(scenario)
    assert "[error: the prompt is too long]" in output and history == []


# =========================================================================== workers, in-process
ENGINE_OPTIONS: dict[str, Any] = {"page_size": 4, "num_pages": 256, "max_running_reqs": 8}


def scheduler_io(model_dir: Path, **options: Any) -> Any:
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.io import SchedulerIO, scheduler_counters
    from minisgl.scheduler.scheduler import Scheduler

    config = SchedulerConfig(model_dir, device="cpu", **{**ENGINE_OPTIONS, **options})
    return SchedulerIO(Scheduler(config), scheduler_counters())


def test_the_scheduler_answers_requests_it_cannot_serve(tiny_model_dir: Path) -> None:
    pool_limited = scheduler_io(tiny_model_dir)  # 256 pages x 4 = 1024 tokens
    context_limited = scheduler_io(tiny_model_dir, num_pages=2048)  # the model's 4096
    greedy = SamplingParams(max_tokens=4)
    for io, limit in ((pool_limited, 1024), (context_limited, 4096)):
        assert io.scheduler.max_seq_len == limit
        fits, too_long = [5] * limit, [5] * (limit + 1)
        out = io.receive([UserRequest(1, too_long, greedy), UserRequest(2, fits, greedy),
                          UserRequest(3, [5, 6, 99999], greedy)])
        assert [type(m).__name__ for m in out] == ["AbortRequest", "AbortRequest"]
        long_error, vocab_error = out[0].error, out[1].error
        assert (out[0].uid, long_error.status, long_error.code, long_error.param) == \
            (1, 400, "context_length_exceeded", "prompt")
        assert f"{limit + 1} tokens long" in long_error.message
        assert f"at most {limit} tokens" in long_error.message
        assert out[1].uid == 3 and "outside the vocabulary" in vocab_error.message
        assert set(io.live) == {2}, "the prompt that fits is served (max_tokens lowered)"
    # An abort that carries an error is passed on even though the scheduler never saw the
    # request: the tokenizer refused it, and the client must hear why.
    refused = AbortRequest(7, error=_error(400))
    assert pool_limited.receive([refused]) == [refused]
    assert pool_limited.receive([AbortRequest(8)]) == [], "a plain abort of nothing is not"


def test_a_max_tokens_the_client_chose_is_refused_when_the_prompt_leaves_less_room(
        tiny_model_dir: Path) -> None:
    io = scheduler_io(tiny_model_dir)  # 1024 tokens per request
    prompt = [5] * 1000  # room for 25 tokens: the 25th is sampled but never stored
    exact, over = SamplingParams(max_tokens=25), SamplingParams(max_tokens=26)
    out = io.receive([UserRequest(1, prompt, over, strict_max_tokens=True),
                      UserRequest(2, prompt, exact, strict_max_tokens=True),
                      UserRequest(3, prompt, over)])  # a default limit: lowered, as before
    assert [(type(m).__name__, m.uid) for m in out] == [("AbortRequest", 1)]
    error = out[0].error
    assert (error.status, error.code, error.param) == \
        (400, "context_length_exceeded", "max_tokens")
    assert "max_tokens is 26" in error.message and "at most 25" in error.message
    assert set(io.live) == {2, 3}
    assert io.live[2].params.max_tokens == 25 and io.live[3].params.max_tokens == 25


def test_a_failed_step_fails_its_requests_and_the_scheduler_serves_on(
        tiny_model_dir: Path) -> None:
    from minisgl.llm import LLM

    io = scheduler_io(tiny_model_dir)
    long = SamplingParams(max_tokens=50, ignore_eos=True)
    io.receive([UserRequest(1, [5, 6, 7], long), UserRequest(2, [8, 9], long)])
    for _ in range(3):
        io.step()
    assert io.stats["kv_pages_in_use"] > 0
    engine = io.scheduler.engine
    engine.logits = lambda *args, **kwargs: (_ for _ in ()).throw(
        RuntimeError("the device fell over"))
    out = io.step()
    del engine.logits  # the engine's own method again
    assert sorted(m.uid for m in out) == [1, 2]
    assert all(isinstance(m, AbortRequest) and m.error.status == 500
               and "the device fell over" in m.error.message for m in out)
    assert io.stats["running"] == io.stats["kv_pages_in_use"] == 0 and not io.live
    # The scheduler serves on: a new request gets exactly LLM's greedy tokens.
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    io.receive([UserRequest(3, [5, 6, 7], params)])
    tokens: list[DetokenizeRequest] = []
    while not tokens or not tokens[-1].finished:
        tokens += [m for m in io.step() if m.uid == 3]
        io.scheduler.check_integrity()
    expected = LLM(tiny_model_dir, device="cpu", **ENGINE_OPTIONS).generate(
        [[5, 6, 7]], params)[0]["token_ids"]
    assert [m.next_token for m in tokens] == list(expected)
    while io.scheduler.has_work:
        io.step()
    assert io.stats["kv_pages_in_use"] == 0


def test_a_scheduler_whose_steps_keep_failing_gives_up(tiny_model_dir: Path) -> None:
    from minisgl.scheduler.io import MAX_FAILED_STEPS

    io = scheduler_io(tiny_model_dir)
    io.scheduler.step = lambda: (_ for _ in ()).throw(RuntimeError("broken for good"))
    for uid in range(MAX_FAILED_STEPS - 1):
        io.receive([UserRequest(uid, [5, 6], SamplingParams())])
        assert [m.uid for m in io.step()] == [uid]
    with pytest.raises(RuntimeError, match="steps in a row failed"):
        io.step()


def test_the_tokenizer_answers_what_it_cannot_tokenize() -> None:
    from minisgl.tokenizer.server import tokenize_or_fail
    from minisgl.tokenizer.tokenize import TokenizeManager

    class Tokenizer:
        def encode(self, text: str) -> list[int]:
            if text == "bug":
                raise RuntimeError("tokenizer bug")
            return [] if not text.strip() else [1, 2]

        def apply_chat_template(self, messages: Any, **_: Any) -> list[int]:
            raise ValueError(f"unknown message role: {messages[0]['role']}")

    manager = TokenizeManager(Tokenizer())
    ok = tokenize_or_fail(manager, TokenizeRequest(1, SamplingParams(), text="hi"))
    assert isinstance(ok, UserRequest) and ok.input_ids == [1, 2]
    empty = tokenize_or_fail(manager, TokenizeRequest(2, SamplingParams(), text=" "))
    chat = tokenize_or_fail(manager, TokenizeRequest(
        3, SamplingParams(), messages=[{"role": "robot", "content": "x"}]))
    bug = tokenize_or_fail(manager, TokenizeRequest(4, SamplingParams(), text="bug"))
    assert (empty.error.status, empty.error.param) == (400, "prompt")
    assert (chat.error.status, chat.error.param) == (400, "messages")
    assert "unknown message role: robot" in chat.error.message
    assert bug.error.status == 500 and "tokenizer bug" in bug.error.message


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path) -> Any:
    from minisgl.tokenizer.tokenize import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def test_the_detokenizer_turns_an_error_abort_into_the_last_reply(hf_tokenizer: Any) -> None:
    from minisgl.tokenizer.detokenize import DetokenizeManager

    manager = DetokenizeManager(hf_tokenizer)
    manager.process([DetokenizeRequest(1, 100), DetokenizeRequest(2, 101, stop=("x",))])
    error = _error()
    replies, _ = manager.process([AbortRequest(1, error=error),  # running: gets the error
                                  AbortRequest(3, error=error),  # never ran: gets it too
                                  AbortRequest(2)])  # a plain abort: nobody to tell
    assert replies == [UserReply.failure(1, error), UserReply.failure(3, error)]
    assert len(manager.states) == 0


def test_a_detokenizer_failure_ends_one_request_and_spares_the_others(
        hf_tokenizer: Any) -> None:
    from minisgl.tokenizer.detokenize import DetokenizeManager

    class Fragile:
        def decode(self, ids: Any) -> str:
            if 666 in ids:
                raise RuntimeError("cannot decode 666")
            return hf_tokenizer.decode(ids)

    manager = DetokenizeManager(Fragile())
    ids = hf_tokenizer.encode("Hello there")
    replies, aborts_out = manager.process([
        DetokenizeRequest(1, ids[0]), DetokenizeRequest(2, ids[0]),
        DetokenizeRequest(1, 666), DetokenizeRequest(2, ids[1]),
        DetokenizeRequest(1, ids[1]),  # in flight when it failed: dropped
    ])
    failed = [r for r in replies if r.uid == 1][-1]
    assert failed.finish_reason == "error" and failed.error.status == 500
    assert "cannot decode 666" in failed.error.message
    assert aborts_out == [AbortRequest(1)], "the scheduler is told to stop generating it"
    assert "".join(r.delta for r in replies if r.uid == 2) == hf_tokenizer.decode(ids[:2])
    assert manager.states[1].stopped, "a tombstone until the scheduler's last word"
    manager.process([AbortRequest(1)])
    assert sorted(manager.states) == [2]


# =========================================================================== worker processes
@dataclass
class Pipeline:
    """Tokenizer, scheduler and detokenizer processes; this test plays the API server."""

    send: Any
    receive: Any
    scheduler_stats: Any
    detokenizer_stats: Any

    def idle(self) -> bool:
        s = self.scheduler_stats.snapshot()
        return (s["running"] == s["waiting"] == s["kv_pages_in_use"] == 0
                and self.detokenizer_stats["live_states"] == 0)


# Faults planted in the worker processes (spawned: these functions are their targets).
FAULTY_DETOKENIZER_UID = 13  # the detokenizer cannot decode its third token
FAULTY_SCHEDULER_UID = 15  # the first scheduler step that runs it raises


def detokenizer_with_a_fault(*args: Any, **kwargs: Any) -> None:
    from minisgl.tokenizer import detokenize, server

    real = detokenize.DetokenizeManager.detokenize

    def detokenize_(self: Any, message: DetokenizeRequest) -> Any:
        state = self.states.get(message.uid)
        if message.uid == FAULTY_DETOKENIZER_UID and state is not None and state.num_tokens == 2:
            raise RuntimeError("a token that cannot be decoded")
        return real(self, message)

    detokenize.DetokenizeManager.detokenize = detokenize_
    server.run_detokenizer(*args, **kwargs)


def scheduler_with_a_fault(*args: Any, **kwargs: Any) -> None:
    from minisgl.scheduler import io

    real = io.Scheduler.step
    failed: list[bool] = []

    def step(self: Any) -> Any:
        if not failed and FAULTY_SCHEDULER_UID in self.running:
            failed.append(True)
            raise RuntimeError("the device fell over")
        return real(self)

    io.Scheduler.step = step
    io.run_scheduler(*args, **kwargs)


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir: Path) -> Iterator[Pipeline]:
    """The three workers, with a fault planted for two uids in the scheduler and the
    detokenizer (the other requests are served as usual)."""
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.io import scheduler_counters
    from minisgl.tokenizer.server import detokenizer_counters, run_tokenizer
    from minisgl.utils.processes import new_ready_queue, start_process, stop_processes, wait_ready
    from minisgl.utils.queues import ZmqPullQueue, ZmqPushQueue, ipc_address

    model = str(tiny_model_dir)
    tokenizer_in, scheduler_in, detokenizer_in, frontend_in = (
        ipc_address(name) for name in ("tokenizer", "scheduler", "detokenizer", "frontend"))
    config = SchedulerConfig(model, device="cpu", **ENGINE_OPTIONS)
    ready = new_ready_queue()
    scheduler_stats, detokenizer_stats = scheduler_counters(), detokenizer_counters()
    with ZmqPullQueue(frontend_in, FrontendMessage, bind=True) as receive, \
            ZmqPushQueue(tokenizer_in, TokenizerMessage, bind=False) as send:
        processes = [
            start_process(scheduler_with_a_fault, "ch16-scheduler",
                          args=(config, scheduler_in, detokenizer_in, ready, scheduler_stats)),
            start_process(detokenizer_with_a_fault, "ch16-detokenizer",
                          args=(model, detokenizer_in, frontend_in, scheduler_in, ready,
                                detokenizer_stats)),
            start_process(run_tokenizer, "ch16-tokenizer",
                          args=(model, tokenizer_in, scheduler_in, ready)),
        ]
        try:
            wait_ready(ready, processes, timeout_s=120)
            yield Pipeline(send, receive, scheduler_stats, detokenizer_stats)
        finally:
            stop_processes(processes, timeout_s=10)


@pytest.mark.slow
def test_refused_requests_are_answered_through_every_process(pipeline: Pipeline) -> None:
    greedy = SamplingParams(max_tokens=4)
    requests = [
        TokenizeRequest(1, greedy, messages=[{"role": "robot", "content": "hi"}]),
        TokenizeRequest(2, greedy, input_ids=[5] * 1100),  # more than the 1024 the pool holds
        TokenizeRequest(3, greedy, input_ids=[5, 99999]),
        TokenizeRequest(4, greedy, text="and one that is fine"),
    ]
    last = run_to_the_end(pipeline, requests)
    assert (last[1].error.status, last[1].error.param) == (400, "messages")
    assert "unknown message role: robot" in last[1].error.message
    assert last[2].error.code == "context_length_exceeded"
    assert "outside the vocabulary" in last[3].error.message
    assert last[4].error is None and last[4].finish_reason in ("stop", "length")
    wait_idle(pipeline)  # every process forgot the requests


def run_to_the_end(pipeline: Pipeline, requests: list[TokenizeRequest]) -> dict[int, UserReply]:
    """Send ``requests``; the last reply of each."""
    pipeline.send.put_many(requests)
    last: dict[int, UserReply] = {}
    while len(last) < len(requests):
        reply = pipeline.receive.get(timeout_s=60)
        if reply.finished and reply.uid in {r.uid for r in requests}:
            last[reply.uid] = reply
    return last


def wait_idle(pipeline: Pipeline) -> None:
    deadline = time.monotonic() + 10
    while not pipeline.idle() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pipeline.idle(), (f"state left: {pipeline.scheduler_stats.snapshot()}, "
                             f"{pipeline.detokenizer_stats.snapshot()}")


@pytest.mark.slow
def test_failures_inside_the_workers_are_answered_and_the_workers_serve_on(
        pipeline: Pipeline) -> None:
    long = SamplingParams(max_tokens=300, ignore_eos=True)
    short = SamplingParams(max_tokens=8, ignore_eos=True)
    before = pipeline.scheduler_stats["generation_tokens"]
    last = run_to_the_end(pipeline, [TokenizeRequest(12, short, text="A neighbour"),
                                     TokenizeRequest(13, long, text="Doomed to fail")])
    assert last[12].error is None and last[12].usage.completion_tokens == 8
    assert (last[13].finish_reason, last[13].error.status) == ("error", 500)
    assert "the detokenizer failed" in last[13].error.message
    wait_idle(pipeline)
    spent = pipeline.scheduler_stats["generation_tokens"] - before
    assert spent < 200, f"the scheduler generated {spent} tokens for a request that failed"
    last = run_to_the_end(pipeline, [TokenizeRequest(15, long, text="Caught in a bad step")])
    assert last[15].error.status == 500 and "the device fell over" in last[15].error.message
    wait_idle(pipeline)
    last = run_to_the_end(pipeline, [TokenizeRequest(16, short, text="Anyone still there?")])
    assert last[16].error is None and last[16].finish_reason == "length"
    wait_idle(pipeline)


# =========================================================================== a real server
class Server(ServerProcess):
    """``python -m minisgl`` on the CPU, and what these tests read from it."""

    def wait_idle(self, timeout_s: float = 20) -> dict[str, int]:
        """The metrics once the server holds nothing (or the last ones seen)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if idle(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def worker_pid(self, name: str) -> int:
        found = re.search(rf"{name} \(pid (\d+)\)", self.log_text())
        assert found, f"no pid for {name} in the log"
        return int(found.group(1))


IDLE_GAUGES = ("minisgl_running_requests", "minisgl_waiting_requests", "minisgl_kv_pages_in_use",
               "minisgl_detokenizer_live_states", "minisgl_frontend_live_requests",
               "minisgl_frontend_buffered_replies")


def idle(metrics: dict[str, int]) -> bool:
    return all(metrics[name] == 0 for name in IDLE_GAUGES)


def start_server(model_dir: Path, log: Path, *extra: str) -> Server:
    """``python -m minisgl`` in a session of its own (as a shell runs a command: its process
    group is the terminal's foreground group, which Ctrl-C signals as a whole)."""
    server = Server(model_dir, device="cpu", args=extra, log_path=log, new_session=True,
                    startup_timeout_s=STARTUP_TIMEOUT_S)
    server.start()
    return server


def assert_all_gone(server: Server) -> None:
    """After ``server.stop()``: nothing of it still ran once the orderly stop was over."""
    assert not server.left_behind, f"left behind: {[p.pid for p in server.left_behind]}"


# The module's server: a KV pool of 768 pages x 4 = 3072 tokens (less than the model's 4096),
# a slow reader is one that lets 64 replies pile up or stays behind for 2 s, and requests in
# flight get 1 s to finish when it is stopped (the last of its tests does).
SERVER_OPTIONS = ("--page-size", "4", "--num-pages", "768", "--reply-buffer-size", "64",
                  "--slow-reader-timeout", "2", "--shutdown-timeout", "1")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest) -> Server:
    log = tmp_path_factory.mktemp("ch16") / "server.log"
    running = start_server(tiny_model_dir, log, *SERVER_OPTIONS)
    request.addfinalizer(running.stop)
    running.wait_ready()
    return running


def post(server: Server, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.slow
def test_http_a_prompt_too_long_is_a_400_streamed_or_not(server: Server) -> None:
    for stream in (False, True):
        response = post(server, "/v1/completions", prompt=[5] * 3100, max_tokens=4,
                        stream=stream)
        assert response.status_code == 400, response.text
        assert response.json()["error"] == {
            "message": "the prompt is 3100 tokens long; this server serves prompts of at "
                       "most 3072 tokens, and prompt plus max_tokens of at most 3073 tokens",
            "type": "invalid_request_error", "param": "prompt",
            "code": "context_length_exceeded"}
    chat = post(server, "/v1/chat/completions", stream=True, max_tokens=4,
                messages=[{"role": "user", "content": "hello " * 3100}])
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    vocab = post(server, "/v1/completions", prompt=[5, 10**9], max_tokens=4)
    assert vocab.status_code == 400 and "outside the vocabulary" in vocab.text
    assert idle(server.wait_idle())


@pytest.mark.slow
def test_http_a_max_tokens_that_does_not_fit_is_a_400_a_default_one_is_lowered(
        server: Server) -> None:
    for stream in (False, True):
        response = post(server, "/v1/completions", prompt=[5] * 3000, max_tokens=100,
                        stream=stream)
        assert response.status_code == 400, response.text
        assert response.json()["error"] == {
            "message": "max_tokens is 100, but a prompt of 3000 tokens leaves room for at most "
                       "73: this server serves prompt plus max_tokens of at most 3073 tokens",
            "type": "invalid_request_error", "param": "max_tokens",
            "code": "context_length_exceeded"}
    chat = post(server, "/v1/chat/completions", max_completion_tokens=4000,
                messages=[{"role": "user", "content": "hello"}])
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"
    # Without max_tokens the default (1024 for chat) is only a ceiling: lowered to fit.
    long_chat = post(server, "/v1/chat/completions", ignore_eos=True,
                     messages=[{"role": "user", "content": "hello " * 1400}])
    assert long_chat.status_code == 200, long_chat.text
    usage = long_chat.json()["usage"]
    assert 3072 - 1024 < usage["prompt_tokens"] < 3072, usage  # less room than the default
    assert long_chat.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 3072 + 1  # to the last slot
    assert idle(server.wait_idle())


@pytest.mark.slow
def test_http_a_client_that_leaves_a_whole_answer_gets_it_aborted(server: Server) -> None:
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting, and hangs up
        httpx.post(f"{server.url}/v1/completions", timeout=httpx.Timeout(10, read=0.5),
                   json={"prompt": "Tell me everything.", "max_tokens": 2000,
                         "ignore_eos": True})
    after = server.wait_idle()
    assert idle(after), f"the request still runs: {after}"
    assert after["minisgl_frontend_aborted_total"] == before["minisgl_frontend_aborted_total"] + 1
    spent = after["minisgl_generation_tokens_total"] - before["minisgl_generation_tokens_total"]
    assert spent < 1000, f"{spent} tokens generated for a client that left after 0.5 s"


@pytest.mark.slow
def test_http_the_detokenizer_state_lives_and_dies_with_the_request(server: Server) -> None:
    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 10:
                during = server.metrics()
                break
    assert during["minisgl_detokenizer_live_states"] == 1
    assert during["minisgl_running_requests"] == 1 and during["minisgl_kv_pages_in_use"] > 0
    after = server.wait_idle()
    assert idle(after), f"state left after the client left: {after}"
    assert after["minisgl_frontend_aborted_total"] == before["minisgl_frontend_aborted_total"] + 1


def stalled_stream(server: Server, max_tokens: int) -> socket.socket:
    """A streaming request from a client on a slow link that does not read: a small receive
    window and small segments, so that the server's buffers fill in a few seconds."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps({"prompt": "Tell me a very long story", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    return sock


def read_to_done(sock: socket.socket, timeout_s: float = 20) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout_s
    while b"data: [DONE]" not in data and time.monotonic() < deadline:
        if select.select([sock], [], [], 0.5)[0]:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    return data


@pytest.mark.slow
def test_http_a_slow_reader_is_cut_off_with_an_error_event(server: Server) -> None:
    before = server.metrics()
    sock = stalled_stream(server, max_tokens=3000)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = server.metrics()
            if now["minisgl_frontend_slow_readers_total"] > \
                    before["minisgl_frontend_slow_readers_total"]:
                break
            # Whatever the client does, the frontend never holds more than the bound.
            assert now["minisgl_frontend_buffered_replies"] <= 64
            time.sleep(0.1)
        else:
            pytest.fail("the slow reader was never cut off")
        data = read_to_done(sock)
    finally:
        sock.close()
    events = [line.strip() for line in data.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][len(b"data: "):])["error"]
    assert error["code"] == "slow_reader" and error["type"] == "timeout_error"
    after = server.wait_idle()
    assert idle(after)
    spent = after["minisgl_generation_tokens_total"] - before["minisgl_generation_tokens_total"]
    assert spent < 3000, "the scheduler must stop generating for a client cut off"


async def one_client(client: httpx.AsyncClient, url: str, i: int,
                     leave_after: int | None, rng: random.Random) -> dict[str, Any]:
    """One streaming request; leave after ``leave_after`` events (None: read it all; -1:
    before the response starts)."""
    chat = i % 2 == 0
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": 24, "ignore_eos": True, "temperature": 0,
                            "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Client {i} says hello"}]
    else:
        body["prompt"] = f"Client {i} starts a story"

    async def read() -> dict[str, Any]:
        events: list[str] = []
        async with client.stream("POST", f"{url}{path}", json=body) as response:
            status = response.status_code
            async for line in response.aiter_lines():
                if line:
                    events.append(line)
                if leave_after is not None and len(events) >= leave_after:
                    break  # leaving: the connection is closed
        return {"i": i, "chat": chat, "status": status, "events": events}

    if leave_after == -1:  # hang up while the request is still waiting for its first reply
        task = asyncio.ensure_future(read())
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return {"i": i, "chat": chat, "status": None, "events": []}
    return await read()


def check_complete_stream(result: dict[str, Any]) -> None:
    events = result["events"]
    assert result["status"] == 200, result
    assert events[-1] == "data: [DONE]", result
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1, "one id per response"
    kind = "chat.completion.chunk" if result["chat"] else "text_completion"
    assert {c["object"] for c in chunks} == {kind}
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_load_128_streams_a_third_leaving_leave_nothing_behind(server: Server) -> None:
    rng = random.Random(16)
    plans: list[int | None] = [None] * 128
    for i in rng.sample(range(128), 128 // 3):
        plans[i] = rng.choice([-1, 1, 2, 3, 5, 8, 13, 21])

    async def load() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one_client(client, server.url, i, plan, rng)
                                          for i, plan in enumerate(plans)))

    before = server.metrics()
    start = time.monotonic()
    results = asyncio.run(load())
    elapsed = time.monotonic() - start
    stayed = [r for r, plan in zip(results, plans) if plan is None]
    assert len(stayed) == 128 - 128 // 3
    for result in stayed:
        check_complete_stream(result)
    assert all(r["status"] in (None, 200) for r in results), "no request may fail"
    after = server.wait_idle()
    assert idle(after), f"state left after the load: {after}"
    assert after["minisgl_frontend_requests_total"] - before["minisgl_frontend_requests_total"] \
        <= 128
    aborted = after["minisgl_frontend_aborted_total"] - before["minisgl_frontend_aborted_total"]
    assert 0 < aborted <= 128 // 3, "the clients that left early had their requests aborted"
    assert elapsed < 60, f"the load took {elapsed:.0f} s"
    assert "Traceback" not in server.log_text()


# =========================================================================== servers that stop
def wait_running(server: Server, n: int) -> None:
    deadline = time.monotonic() + 30
    while server.metrics()["minisgl_running_requests"] < n:
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.05)


def stop_busy_server(server: Server, how: str) -> None:
    """Stop ``server`` while three long streams and a short request run; check that the
    streams end with an error event and ``[DONE]`` (not cut off) within the shutdown timeout,
    that the short request was answered, and that no process is left."""
    results: dict[int, list[str]] = {}
    # 3 x 800 tokens fit the module server's pool together (a request is admitted with the
    # pages of its whole lifetime).
    threads = [stream_in_thread(server.url, results, i, max_tokens=800) for i in range(3)]
    wait_running(server, 3)
    short = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "prompt": "A short one", "max_tokens": 4, "ignore_eos": True})
    assert short.status_code == 200
    signalled = time.monotonic()
    if how == "SIGTERM":
        server.proc.send_signal(signal.SIGTERM)
    else:  # what Ctrl-C in a terminal does: SIGINT to the whole foreground process group
        os.killpg(server.proc.pid, signal.SIGINT)
    for thread in threads:
        thread.join(30)
    ended = time.monotonic() - signalled
    code = server.stop(None, timeout_s=30)  # signalled above: wait, for it and every worker
    log = server.log_text()
    assert code == 128 + (signal.SIGTERM if how == "SIGTERM" else signal.SIGINT), log[-3000:]
    assert len(results) == 3
    for lines in results.values():
        assert lines[-1] == "data: [DONE]", f"a stream was cut off: {lines[-2:]}"
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert error["code"] == "shutting_down", error
    assert ended < 4, f"the streams ended {ended:.1f} s after the signal (timeout: 1 s)"
    assert_all_gone(server)
    assert "stopped 3 worker process(es)" in log and "Traceback" not in log


@pytest.mark.slow
def test_sigterm_stops_a_busy_server_in_order(server: Server) -> None:
    """Runs last of the module server's tests: it stops the server."""
    stop_busy_server(server, "SIGTERM")


def test_serve_http_raises_the_signal_that_stopped_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn raises the signal that stopped it again as it returns; when that second raise
    is lost (asyncio's SIGINT handler let it pass in rare runs), ``serve_http`` still ends
    the way the launcher turns into exit status 130 or 143, not as a normal return (0)."""
    from minisgl.server import launch

    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    for sig, raised in ((signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, launch._Terminated)):
        def stopped(server: launch.OrderlyServer, sockets: Any = None, sig: int = sig) -> None:
            server.handle_exit(sig, None)  # uvicorn's handler, as the signal arrives; then return

        monkeypatch.setattr(launch.OrderlyServer, "run", stopped)
        with socket.socket() as sock, pytest.raises(raised):
            launch.serve_http(app, sock)


@pytest.mark.slow
def test_ctrl_c_stops_a_busy_server_in_order(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_model_dir, tmp_path / "server.log", "--shutdown-timeout", "1")
    try:
        server.wait_ready()
        stop_busy_server(server, "Ctrl-C")
    finally:
        server.stop()


@pytest.mark.slow
def test_a_dead_worker_fails_the_waiting_requests_at_once(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    server = start_server(tiny_model_dir, tmp_path / "server.log")
    try:
        server.wait_ready()
        results: dict[int, list[str]] = {}
        threads = [stream_in_thread(server.url, results, i) for i in range(2)]
        whole: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: whole.append(post(
            server, "/v1/completions", prompt="Wait for it", max_tokens=3000,
            ignore_eos=True)), daemon=True)
        waiter.start()
        wait_running(server, 3)
        killed = time.monotonic()
        psutil.Process(server.worker_pid("scheduler")).kill()
        for thread in (*threads, waiter):
            thread.join(10)
        waited = time.monotonic() - killed
        assert waited < 3, f"the requests waited {waited:.1f} s for a dead scheduler"
        assert whole[0].status_code == 503, whole[0].text
        assert "scheduler process" in whole[0].json()["error"]["message"]
        for lines in results.values():
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "worker_died"
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and "scheduler" in health.json()["reason"]
        refused = post(server, "/v1/completions", prompt="anyone there?", max_tokens=2)
        assert refused.status_code == 503
        # then the server exits by itself, non-zero: whatever supervises it starts a new one
        server.proc.wait(15)
        assert time.monotonic() - killed < 15, "the server outlived its scheduler"
        assert server.stop(None) == 1
        assert_all_gone(server)
    finally:
        server.stop()


@pytest.mark.slow
def test_sigkill_of_a_busy_launcher_leaves_no_worker(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    server = start_server(tiny_model_dir, tmp_path / "server.log")
    try:
        server.wait_ready()
        results: dict[int, list[str]] = {}
        for i in range(2):
            stream_in_thread(server.url, results, i)
        wait_running(server, 2)
        server.proc.kill()  # no clean-up of any kind in the launcher
        server.proc.wait(10)
        # Busy workers notice too (they check once per step), not only idle ones.
        left = server.alive(wait_s=10)
        assert not left, f"left behind: {[(p.pid, p.cmdline()) for p in left]}"
    finally:
        server.stop()


@pytest.mark.slow
def test_ctrl_c_in_a_real_shell_stops_the_answer(tiny_model_dir: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl", "--model", str(tiny_model_dir), "--device", "cpu",
         "--shell", "--shell-max-tokens", "3000"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env, start_new_session=True)
    family: list[psutil.Process] = []  # its workers, once it runs
    out = bytearray()

    def pump() -> None:
        while chunk := os.read(proc.stdout.fileno(), 4096):
            out.extend(chunk)

    threading.Thread(target=pump, daemon=True).start()

    def wait_for(text: bytes, count: int, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while out.count(text) < count:
            assert time.monotonic() < deadline and proc.poll() is None, bytes(out)[-2000:]
            time.sleep(0.05)

    def ask_and_interrupt(question: bytes, n: int) -> None:
        proc.stdin.write(question + b"\n")
        proc.stdin.flush()
        start = len(out)
        deadline = time.monotonic() + 30
        while len(out) < start + 40:  # the answer is being written
            assert time.monotonic() < deadline and proc.poll() is None, bytes(out)[-2000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it: to the group
        wait_for(b"[interrupted]", n, timeout_s=10)
        wait_for(b">>> ", n + 1, timeout_s=10)

    try:
        wait_for(b">>> ", 1)
        family = psutil.Process(proc.pid).children(recursive=True)
        ask_and_interrupt(b"Tell me a very long story.", 1)
        # The workers did not get the Ctrl-C: the next question is answered.
        ask_and_interrupt(b"Another one, please.", 2)
        proc.stdin.write(b"/exit\n")
        proc.stdin.flush()
        code = proc.wait(60)
        assert code == 0, proc.stderr.read().decode()[-3000:]
        left = still_running(family, wait_s=15)
        assert not left, f"left behind: {[(p.pid, p.cmdline()) for p in left]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for worker in still_running(family):
            worker.kill()
