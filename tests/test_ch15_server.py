"""Chapter 15: the OpenAI-compatible API server, the launcher and the shell.

What these tests pin down:

- the command line: defaults, engine options passed through, bad values refused before any
  process starts (``--tp`` > 1 included, until chapter 17);
- the frontend: replies that all arrive through one queue reach the request they belong to,
  in order, whenever they arrive; a reply for a request nobody waits for is dropped; request
  ``uid`` and its abort go to tokenizer ``uid % N``; a stream that stops early aborts its
  request;
- the HTTP layer, over fake workers: OpenAI-shaped bodies and SSE chunks, ``[DONE]`` last,
  usage on request; malformed bodies answered with 400 and an OpenAI error body; ``/metrics``
  and ``/health``;
- the shell: a conversation with history, ``/reset`` and ``/exit``;
- a real server (``python -m minisgl`` on the tiny model, on CPU, one process for the module):
  the ``openai`` client gets exactly ``LLM.generate``'s greedy text for chat and completions,
  streamed or not, with true token counts; 8 concurrent requests each get their own answer; a
  client that disconnects mid-stream gets its request aborted, and the server serves on;
  SIGINT during start-up and SIGTERM on a running server leave no process behind.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from minisgl.core import SamplingParams
from minisgl.message import AbortRequest, TokenizeRequest, TokenUsage, UserReply
from minisgl.server.api_server import create_app
from minisgl.server.args import ServerArgs, parse_args
from minisgl.server.frontend import RequestRouter
from minisgl.server.responses import SSE_DONE, ResponseMeta, sse_event
from minisgl.shell import Shell, sampling_params_for
from server_process import ServerProcess, parse_metrics, still_running  # tools/, see conftest.py

STARTUP_TIMEOUT_S = 180.0


# =========================================================================== the command line
def test_parse_args_defaults_and_engine_options() -> None:
    args = parse_args(["--model", "models/tiny-qwen3", "--page-size", "4", "--no-overlap",
                       "--prefix-cache", "radix", "--cpu-kv-memory", "64MiB"])
    assert (args.host, args.port, args.num_tokenizers, args.tp) == ("127.0.0.1", 1919, 1, 1)
    assert args.shell is False
    # --no-overlap is one more engine option: SchedulerConfig.overlap, as offline (chapter 12).
    assert args.scheduler_config(args.model).overlap is False
    # Only the options given travel; the engine keeps its own defaults for the rest.
    assert args.engine_options == {"page_size": 4, "prefix_cache": "radix",
                                   "cpu_kv_memory": 64 * 1024**2, "overlap": False}
    config = args.scheduler_config("models/tiny-qwen3")
    assert (config.page_size, config.prefix_cache, config.max_running_reqs) == (4, "radix", 256)
    assert args.model_name == "models/tiny-qwen3" and args.url == "http://127.0.0.1:1919"


def test_the_shell_keeps_one_request_slot_unless_told_otherwise() -> None:
    assert ServerArgs("m", shell=True).scheduler_config("m").max_running_reqs == 1
    shell = ServerArgs("m", shell=True, engine_options={"max_running_reqs": 4})
    assert shell.scheduler_config("m").max_running_reqs == 4


@pytest.mark.parametrize("argv, message", [
    (["--tp", "0"], "--tp must be an integer >= 1, got 0"),
    (["--port", "0"], "--port must be an integer in [1, 65535], got 0"),
    (["--num-tokenizers", "0"], "--num-tokenizers must be an integer >= 1, got 0"),
    (["--page-size", "0"], "page_size must be an integer >= 1, got 0"),
    (["--prefix-cache", "lru"], "prefix_cache must be one of naive, radix; got 'lru'"),
    (["--device", "tpu"], "device must be one of auto, cpu, cuda"),
])
def test_bad_command_lines_are_refused_with_the_reason(argv: list[str], message: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model", "m", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# =========================================================================== fake workers
class FakeWorkers:
    """Stands in for a tokenizer, the scheduler and the detokenizer at once.

    The frontend sends it requests (``put``); it answers each at once, on the shared
    ``replies`` queue the frontend reads, with the prompt's words echoed back, one reply per
    word, the last one finishing with ``"length"`` and a usage. With ``endless=True``
    requests never finish.
    """

    def __init__(self, replies: asyncio.Queue[UserReply], endless: bool = False) -> None:
        self.replies = replies
        self.received: list[Any] = []
        self.endless = endless

    async def put(self, message: Any) -> None:
        self.received.append(message)
        if not isinstance(message, TokenizeRequest):
            return
        if message.messages is not None:
            prompt = message.messages[-1]["content"]
        else:
            prompt = message.text if message.text is not None else " ".join(
                map(str, message.input_ids))
        words = [w + " " for w in prompt.split()] or ["."]
        for i, word in enumerate(words):
            last = i == len(words) - 1 and not self.endless
            await self.replies.put(UserReply(
                message.uid, word, "length" if last else None,
                TokenUsage(len(words), len(words)) if last else None))


class FakeInbox:
    def __init__(self, replies: asyncio.Queue[UserReply]) -> None:
        self.replies = replies

    async def get(self) -> UserReply:
        return await self.replies.get()


def fake_frontend(num_tokenizers: int = 1, endless: bool = False
                  ) -> tuple[RequestRouter, list[FakeWorkers]]:
    """A frontend over fake workers; call it inside the event loop."""
    replies: asyncio.Queue[UserReply] = asyncio.Queue()
    fakes = [FakeWorkers(replies, endless) for _ in range(num_tokenizers)]
    return RequestRouter(fakes, FakeInbox(replies)), fakes


# =========================================================================== the frontend
def test_replies_reach_their_own_request_in_order() -> None:
    async def scenario() -> dict[int, str]:
        frontend, _ = fake_frontend()
        greedy = SamplingParams()
        uids = [await frontend.submit(greedy, text=f"request {i} says {'hi ' * i}")
                for i in range(4)]
        assert frontend.num_live == 4
        # All replies are in the queue before anyone reads: each is kept for its request.
        texts = await asyncio.gather(*(frontend.collect(uid) for uid in uids))
        assert frontend.num_live == 0 and frontend.stats.finished == 4
        await frontend.close()
        return {uid: text for uid, (text, *_) in zip(uids, texts)}

    texts = asyncio.run(scenario())
    assert texts == {i: f"request {i} says {'hi ' * i}" for i in range(4)}


def test_request_and_abort_go_to_tokenizer_uid_mod_n() -> None:
    async def scenario() -> list[list[Any]]:
        frontend, fakes = fake_frontend(num_tokenizers=3)
        uids = [await frontend.submit(SamplingParams(), text="x") for _ in range(5)]
        frontend.abort(uids[4])
        await asyncio.sleep(0)  # the abort's send runs as a task
        await frontend.close()
        return [f.received for f in fakes]

    received = asyncio.run(scenario())
    assert [[m.uid for m in r if isinstance(m, TokenizeRequest)] for r in received] == \
        [[0, 3], [1, 4], [2]]
    assert received[1][-1] == AbortRequest(4)  # behind uid 4's request, on the same queue


def test_a_reply_nobody_waits_for_is_dropped() -> None:
    async def scenario() -> int:
        frontend, fakes = fake_frontend()
        uid = await frontend.submit(SamplingParams(), text="one two three")
        frontend.abort(uid)  # forgotten before its replies are read
        await fakes[0].replies.put(UserReply(99, "stray"))  # never submitted
        await asyncio.sleep(0.01)  # let the listener read everything
        live = frontend.num_live
        await frontend.close()
        return live

    assert asyncio.run(scenario()) == 0


def test_a_stream_that_stops_early_aborts_its_request() -> None:
    async def scenario() -> tuple[list[bytes], list[Any], RequestRouter]:
        frontend, fakes = fake_frontend(endless=True)
        app = create_app(lambda: frontend, "m")
        app.state.frontend = frontend  # what the lifespan does
        body = json.dumps({"messages": [{"role": "user", "content": "never ending story"}],
                           "stream": True}).encode()
        incoming = [{"type": "http.request", "body": body, "more_body": False}]
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            if incoming:
                return incoming.pop()
            while len(chunks) < 3:
                await asyncio.sleep(0.001)
            return {"type": "http.disconnect"}  # the client leaves after three chunks

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])

        await app({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                   "headers": [(b"content-type", b"application/json")], "query_string": b"",
                   "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                   "server": ("test", 80), "client": ("test", 1), "root_path": ""},
                  receive, send)
        await asyncio.sleep(0)
        await frontend.close()
        return chunks, fakes[0].received, frontend

    chunks, received, frontend = asyncio.run(scenario())
    assert len(chunks) >= 3 and received[-1] == AbortRequest(0)
    assert frontend.num_live == 0 and frontend.stats.aborted == 1


# =========================================================================== SSE and HTTP
def test_an_sse_event_is_one_data_line_and_a_blank_line() -> None:
    event = sse_event({"text": "two\nlines", "emoji": "👋"})
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert event.count(b"\n") == 2  # the newline inside the text is escaped by JSON
    assert json.loads(event[len(b"data: "):]) == {"text": "two\nlines", "emoji": "👋"}
    assert SSE_DONE == b"data: [DONE]\n\n"


@pytest.fixture()
def fake_client() -> Iterator[TestClient]:
    app = create_app(lambda: fake_frontend()[0], "fake-model",
                     metrics=lambda: {"running": 3, "kv_pages_in_use": 7},
                     health=lambda: None)
    with TestClient(app) as client:
        yield client


def sse_payloads(response: httpx.Response) -> list[Any]:
    events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def test_chat_completion_body_is_openai_shaped(fake_client: TestClient) -> None:
    body = fake_client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "length",
                                "message": {"role": "assistant", "content": "hello there "}}]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_chat_stream_is_role_then_deltas_then_finish_then_usage(fake_client: TestClient) -> None:
    with fake_client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a b"}]}],
            "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = sse_payloads(response)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": "a "}, {"content": "b "}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 3 + ["length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 4


def test_completion_of_text_and_of_token_ids(fake_client: TestClient) -> None:
    body = fake_client.post("/v1/completions", json={"prompt": [5, 6, 7]}).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "5 6 7 "
    with fake_client.stream("POST", "/v1/completions",
                            json={"prompt": "x y", "stream": True}) as response:
        chunks = sse_payloads(response)
    assert [c["choices"][0]["text"] for c in chunks] == ["x ", "y ", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-1]  # not asked for


@pytest.mark.parametrize("path, body, message", [
    ("/v1/chat/completions", {"messages": []}, "messages: List should have at least 1 item"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]},
     "'system', 'user'"),  # the roles allowed, in either chapter's words
    ("/v1/completions", {"prompt": "x", "max_token": 5}, "max_token: Extra inputs are not"),
    ("/v1/completions", {"prompt": "x", "temperature": -1},
     "temperature must be a finite number >= 0"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p must be a number in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n must be"),
    ("/v1/completions", {"prompt": ""}, "prompt is empty"),
    ("/v1/completions", {"prompt": [1, -2]}, ".1: Input should be greater than or equal to 0"),
    ("/v1/completions", {}, "prompt: Field required"),
])
def test_bad_bodies_get_400_and_an_openai_error(fake_client: TestClient, path: str,
                                                body: dict[str, Any], message: str) -> None:
    response = fake_client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_models_health_and_metrics(fake_client: TestClient) -> None:
    models = fake_client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake-model"]
    assert fake_client.get("/health").json() == {"status": "ok"}
    fake_client.post("/v1/completions", json={"prompt": "x"})
    text = fake_client.get("/metrics").text
    for line in ("# TYPE minisgl_running_requests gauge", "minisgl_running_requests 3",
                 "minisgl_kv_pages_in_use 7", "minisgl_frontend_live_requests 0",
                 "minisgl_frontend_requests_total 1", "minisgl_frontend_finished_total 1"):
        assert line in text.splitlines(), text


def test_metrics_text_is_read_back_as_counts(fake_client: TestClient) -> None:
    metrics = parse_metrics(fake_client.get("/metrics").text)
    assert metrics["minisgl_running_requests"] == 3 and metrics["minisgl_kv_pages_in_use"] == 7
    assert not any(name.startswith("#") for name in metrics)  # HELP and TYPE lines skipped
    assert parse_metrics("# TYPE x counter\nx 3.0\ny NaN\nz\n") == {"x": 3}


def test_health_is_503_when_a_worker_is_gone() -> None:
    app = create_app(lambda: fake_frontend()[0], "m",
                     health=lambda: "the scheduler process (pid 1) exited with code -9")
    with TestClient(app) as client:
        response = client.get("/health")
    assert response.status_code == 503 and "scheduler" in response.json()["reason"]


# =========================================================================== the shell
def test_shell_keeps_the_conversation_and_obeys_commands() -> None:
    lines = iter(["first question", "", "second one", "/help", "/bogus", "/reset", "again",
                  "/exit", "never read"])

    async def read_line(prompt: str) -> str:
        return next(lines)

    async def scenario() -> tuple[str, list[Any]]:
        frontend, fakes = fake_frontend()
        out = io.StringIO()
        await Shell(frontend, SamplingParams(), out).run(read_line)
        await frontend.close()
        return out.getvalue(), fakes[0].received

    output, received = asyncio.run(scenario())
    conversations = [[m["content"] for m in r.messages] for r in received]
    assert conversations == [["first question"],
                             ["first question", "first question ", "second one"],
                             ["again"]]  # /reset forgot the first two turns
    assert "first question \n" in output and "unknown command '/bogus'" in output
    assert next(lines) == "never read"


def test_shell_samples_as_the_generation_config_says(tmp_path: Path) -> None:
    assert sampling_params_for(tmp_path, 64).is_greedy  # no generation_config.json: greedy
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    params = sampling_params_for(tmp_path, 64)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == \
        (0.6, 0.95, 20, 64)


# =========================================================================== a real server
def cpu_server(model_dir: Path, log: Path) -> ServerProcess:
    # The clients below ask for model "tiny": the name it is served under.
    return ServerProcess(model_dir, device="cpu", log_path=log,
                         args=("--served-model-name", "tiny"),
                         startup_timeout_s=STARTUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def server_process(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                   request: pytest.FixtureRequest) -> ServerProcess:
    """One server for the module, started first so that it loads while ``llm`` does."""
    server = cpu_server(tiny_model_dir, tmp_path_factory.mktemp("ch15") / "server.log")
    request.addfinalizer(server.stop)
    server.start()
    return server


@pytest.fixture(scope="module")
def llm(server_process: ServerProcess, tiny_model_dir: Path):
    from minisgl.llm import LLM

    return LLM(tiny_model_dir, device="cpu")


@pytest.fixture(scope="module")
def server(server_process: ServerProcess, llm) -> ServerProcess:
    server_process.wait_ready()
    return server_process


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def greedy(llm, prompts: list[Any], max_tokens: int) -> list[dict[str, Any]]:
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def chat_ids(llm, content: str) -> list[int]:
    """The prompt ids of a one-turn chat: the chat template, as the tokenizer worker applies
    it (``add_generation_prompt=True``)."""
    encoded = llm.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=True)
    return list(encoded["input_ids"])


CHAT_PROMPTS = ["What is a KV cache?", "Write a haiku about GPUs.", "你好，请介绍一下你自己。"]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def test_chat_equals_llm_generate_streamed_or_not(client, llm) -> None:
    expected = greedy(llm, [chat_ids(llm, p) for p in CHAT_PROMPTS], max_tokens=24)
    for prompt, want in zip(CHAT_PROMPTS, expected):
        messages = [{"role": "user", "content": prompt}]
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                               temperature=0)
        assert whole.choices[0].message.content == want["text"], prompt
        assert whole.choices[0].finish_reason == want["finish_reason"]
        assert whole.usage.prompt_tokens == len(chat_ids(llm, prompt))
        assert whole.usage.completion_tokens == len(want["token_ids"])
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                                temperature=0, stream=True)
        pieces = [(c.choices[0].delta.content or "", c.choices[0].finish_reason)
                  for c in stream]
        assert "".join(text for text, _ in pieces) == want["text"], prompt
        assert [reason for _, reason in pieces if reason] == [want["finish_reason"]]


def test_completions_equal_llm_generate_with_true_usage(client, llm) -> None:
    expected = greedy(llm, TEXT_PROMPTS, max_tokens=20)
    for prompt, want in zip(TEXT_PROMPTS, expected):
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                          temperature=0)
        assert whole.choices[0].text == want["text"], prompt
        prompt_len = len(llm.tokenizer.encode(prompt))
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == \
            (prompt_len, len(want["token_ids"]))
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want["text"]
        assert chunks[-1].usage.total_tokens == prompt_len + len(want["token_ids"])
    ids = llm.tokenizer.encode(TEXT_PROMPTS[0])  # a prompt given as token ids
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == expected[0]["text"]


def test_eight_concurrent_requests_each_get_their_own_answer(client, llm) -> None:
    prompts = [f"Request number {i}: tell me about {w}" for i, w in
               enumerate(["cats", "rain", "tea", "maps", "jazz", "salt", "ice", "owls"])]
    expected = [out["text"] for out in greedy(llm, prompts, max_tokens=16)]

    def ask(prompt: str) -> str:
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                          temperature=0, extra_body={"ignore_eos": True})
        return reply.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == expected
    assert len(set(answers)) == 8


def test_stop_strings_cut_the_text(client, llm) -> None:
    full = greedy(llm, [TEXT_PROMPTS[2]], max_tokens=20)[0]["text"]
    stop = full[5:8]
    reply = client.completions.create(model="tiny", prompt=TEXT_PROMPTS[2], max_tokens=20,
                                      temperature=0, stop=[stop])
    assert reply.choices[0].text == full[:full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_client_disconnect_aborts_the_request(server: ServerProcess, client) -> None:
    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 6:
                break  # leave after a few chunks: the connection closes
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = server.metrics()
        if (after["minisgl_frontend_aborted_total"] == before["minisgl_frontend_aborted_total"]
                + 1 and after["minisgl_running_requests"] == 0
                and after["minisgl_detokenizer_live_states"] == 0):
            break
        time.sleep(0.05)
    assert after["minisgl_frontend_aborted_total"] == before["minisgl_frontend_aborted_total"] + 1
    assert after["minisgl_running_requests"] == 0, "the scheduler still runs the request"
    assert after["minisgl_kv_pages_in_use"] == 0 and after["minisgl_frontend_live_requests"] == 0
    assert after["minisgl_detokenizer_live_states"] == 0
    # Far fewer than 2000 tokens were generated for it.
    assert after["minisgl_generation_tokens_total"] - before["minisgl_generation_tokens_total"] \
        < 1000
    assert "aborting request" in server.log_text()
    later = client.completions.create(model="tiny", prompt="1 + 1 =", max_tokens=4,
                                      temperature=0)
    assert later.choices[0].finish_reason in ("stop", "length")


def assert_all_gone(server: ServerProcess) -> None:
    """After ``server.stop()``: nothing was still running when the orderly stop was over."""
    assert not server.left_behind, f"left behind: {[p.pid for p in server.left_behind]}"


@pytest.mark.slow
def test_the_shell_chats_on_the_same_workers(tiny_model_dir: Path, llm) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl", "--model", str(tiny_model_dir), "--device", "cpu",
         "--shell", "--shell-max-tokens", "12"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env)
    try:
        stdout, stderr = proc.communicate("What is a KV cache?\n/exit\n", STARTUP_TIMEOUT_S)
    finally:
        if proc.poll() is None:  # it did not finish: it and its workers may not outlive the test
            family = psutil.Process(proc.pid).children(recursive=True)
            proc.kill()
            proc.wait(10)
            for worker in still_running(family):
                worker.kill()
    assert proc.returncode == 0, stderr[-3000:]
    # stdout: the greeting, the prompt, the answer and a newline, the prompt for /exit.
    answer = stdout.split(">>> ")[1].removesuffix("\n")
    expected = greedy(llm, [chat_ids(llm, "What is a KV cache?")], max_tokens=12)[0]["text"]
    assert answer == expected
    assert "INFO" not in stderr  # the workers keep quiet in the shell


def test_sigint_while_starting_leaves_no_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = cpu_server(tiny_model_dir, tmp_path / "server.log")
    server.start()
    try:
        deadline = time.monotonic() + 60
        while len(server.workers()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the three workers are spawned (still loading, likely)
        assert len(server.workers()) == 3, server.log_text()
        assert server.stop(signal.SIGINT, timeout_s=30) == 128 + signal.SIGINT, \
            server.log_tail()
        assert_all_gone(server)
    finally:
        server.stop()


def test_sigterm_leaves_no_process(server: ServerProcess) -> None:
    """Runs last: it stops the module's server."""
    assert len(server.workers()) == 3
    assert server.stop(signal.SIGTERM, timeout_s=30) == 128 + signal.SIGTERM, server.log_tail()
    assert_all_gone(server)
    assert "stopped 3 worker process(es)" in server.log_text()
