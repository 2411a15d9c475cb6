"""The Tour, run for real: one chat request through the server, and what each process shows of it.

The book's Tour page (docs/tour.md) follows a single request from the HTTP client through the
API server, a tokenizer worker, the scheduler and the detokenizer, and back. This script does
what that page describes and prints what comes back, so that the page can show real output:

1. start ``python -m minisgl`` on the book's small trained model, on the CPU, on a free
   loopback port, with ``MINISGL_LOG_LEVEL=DEBUG`` and its log in a file, and wait for
   ``GET /health``;
2. send one streamed chat completion (greedy, a few tokens) and print the ``curl`` command that
   sends the same bytes, then the raw Server-Sent Events that come back;
3. send the same request, not streamed, with the ``openai`` client, and print the JSON body;
4. print ``GET /v1/models`` and ``GET /metrics`` (before the requests and after them), and the
   server's log lines that name the requests' uids;
5. stop the server with SIGINT, as Ctrl+C does, and print how it shut down and whether any of
   its processes is left;
6. without the server: the tokenizer's step on the same messages, and the offline ``LLM`` on
   the same prompt ids, which must give the server's tokens.

What changes from run to run (process ids, the port, clock times, unix timestamps, durations,
the checkout's directory) is replaced by placeholders, so the output can be recorded and
compared::

    python tools/tour.py                          # print the tour
    python tools/tour.py --record [--out DIR]     # and save it for the book

``--record`` writes each named section of the output (``launch``, ``curl``, ...) to its own
file, ``docs/recorded/tour-cpu/<section>.txt`` (or under ``--out``), which the Tour page
includes whole; ``intro.txt`` starts with the machine the run was recorded on.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path
from server_process import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "models/tiny-shakespeare"  # what the page shows; its code snippets name it too
DEFAULT_OUT = Path("docs/recorded/tour-cpu")
STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0

MESSAGES = [{"role": "user", "content": "What is a KV cache?"}]
MAX_TOKENS = 32  # room for a whole reply: the model ends its turn itself


# =========================================================================== output
@dataclass
class Normalizer:
    """Replaces what differs between two runs by a placeholder.

    Only numbers in a known place are replaced (``(pid N)``, ``kill -INT N``, ``:PORT``): a
    process id or a port may well equal a token id printed elsewhere.

    Attributes:
        port: the server's port (-> ``<port>``).
    """

    port: int = 0

    TIME = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", re.MULTILINE)  # the log's clock time
    PID = re.compile(r"\(pid \d+\)|(?<=kill -INT )\d+")
    CREATED = re.compile(r'("created":\s*)\d+')
    SECONDS = re.compile(r"\b\d+(?:\.\d+)? ?s\b")
    RESPONSE_ID = re.compile(r"\b(chatcmpl|cmpl)-[0-9a-f]{32}\b")  # random, as OpenAI's

    def __call__(self, text: str) -> str:
        text = self.TIME.sub("[<time> ", text)
        text = self.PID.sub(lambda m: "(pid <pid>)" if m[0].startswith("(") else "<pid>",
                            text)
        text = self.CREATED.sub(r"\1<created>", text)
        text = self.RESPONSE_ID.sub(r"\1-<id>", text)
        text = self.SECONDS.sub("<s> s", text)
        text = text.replace(str(ROOT), "<repo>")
        if self.port:  # in URLs and in the command line; other numbers stay as they are
            text = re.sub(rf"(?<=:){self.port}\b|(?<=--port ){self.port}\b", "<port>", text)
        return text


class Recorder:
    """Prints the tour's lines and keeps them by section, one file each in the recording."""

    def __init__(self, normalize: Normalizer) -> None:
        self.normalize = normalize
        self.sections: dict[str, list[str]] = {}  # in the order they were said
        self._current: list[str] | None = None

    def say(self, text: str = "") -> None:
        if self._current is None:  # printed but not recorded, the page would miss it
            raise RuntimeError("the tour says a line outside any section")
        for line in self.normalize(text).split("\n"):
            print(line, flush=True)
            self._current.append(line.rstrip())

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Lines said inside form the named section, the file the Tour page includes."""
        if name in self.sections or self._current is not None:
            raise RuntimeError(f"section {name!r} repeats or opens inside another")
        self._current = self.sections[name] = []
        try:
            yield
        finally:
            self._current = None

    def write(self, directory: Path, header: str) -> None:
        """``<section>.txt`` for every section, in place of an earlier recording's files;
        `header` (the machine) starts the first."""
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("*.txt"):
            old.unlink()
        for i, (name, lines) in enumerate(self.sections.items()):
            text = "\n".join(([header] if i == 0 else []) + lines) + "\n"
            (directory / f"{name}.txt").write_text(text, encoding="utf-8")


# =========================================================================== the server
def server_command(model: str, port: int) -> list[str]:
    """The command the page shows (what runs spells out the default ``--host 127.0.0.1`` too)."""
    return ["python", "-m", "minisgl", "--model", model, "--port", str(port), "--device", "cpu"]


def server_process(model: str) -> ServerProcess:
    """The server, to be started in the checkout, on the CPU, with its most detailed log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINISGL_")}
    # DEBUG is the most the log says; OMP_NUM_THREADS=1 keeps the CPU's arithmetic, and with
    # it the greedy tokens, the same from run to run.
    env.update(MINISGL_LOG_LEVEL="DEBUG", OMP_NUM_THREADS="1")
    return ServerProcess(model, device="cpu", env=env, cwd=ROOT,
                         startup_timeout_s=STARTUP_TIMEOUT_S)


# =========================================================================== the requests
def sse_events(raw: str) -> list[str]:
    """The ``data:`` payloads of an SSE stream, in order."""
    return [event[len("data: "):] for event in raw.split("\n\n") if event.startswith("data: ")]


def streamed_text(raw: str) -> str:
    """The text of a streamed chat completion: its deltas' contents joined."""
    pieces = []
    for payload in sse_events(raw):
        if payload != "[DONE]":
            pieces.append(json.loads(payload)["choices"][0]["delta"].get("content") or "")
    return "".join(pieces)


def stream_with_curl_equivalent(out: Recorder, server: ServerProcess, model: str) -> str:
    """Hop 1 and hop 6: the streamed request, as curl sends it, and the raw bytes back."""
    body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "stream": True})
    url = f"{server.url}/v1/chat/completions"
    out.say(f"$ curl -N {url} \\\n"
            f"    -H 'Content-Type: application/json' \\\n"
            f"    -d {shlex.quote(body)}")
    raw = b""
    with httpx.stream("POST", url, content=body.encode(), timeout=60,
                      headers={"Content-Type": "application/json"}) as response:
        response.raise_for_status()
        for chunk in response.iter_raw():
            raw += chunk
    text = raw.decode("utf-8")
    out.say(text.rstrip("\n"))
    out.say()
    out.say(f"({len(sse_events(text))} events, {len(raw)} bytes; each event is a line "
            "'data: ...' and a blank line)")
    return text


def ask_openai(url: str) -> tuple[Any, dict[str, Any]]:
    """Hop 1 to 6 again, through the ``openai`` package, not streamed."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model="models/tiny-shakespeare", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    reply = raw.parse()  # what the openai package makes of it: a ChatCompletion
    body = raw.http_response.json()  # the JSON the server sent
    return reply, body


# =========================================================================== offline
def tokenizer_step(model: str) -> tuple[str, list[int], Any]:
    """Hop 3: what the tokenizer worker does with the messages, run in this process."""
    from minisgl.tokenizer.tokenize import TokenizeManager, load_tokenizer

    tokenizer = load_tokenizer(ROOT / model)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = TokenizeManager(tokenizer).apply_chat_template(MESSAGES)
    return prompt, ids, tokenizer


def generate_offline() -> Any:
    """The page's "Without the server" code; returns the ``LLM`` it made."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    llm = LLM("models/tiny-shakespeare")
    print(llm.generate(["The capital of France is"], SamplingParams(max_tokens=16)))
    return llm


def offline(prompt_ids: list[int]) -> tuple[str, dict[str, Any]]:
    """What ``generate_offline`` prints, and the chat prompt through the same ``LLM``."""
    import torch

    from minisgl.core import SamplingParams
    from minisgl.utils.logger import configure_logging

    configure_logging("WARNING")  # this script's output is the tour; the engine keeps quiet
    torch.set_num_threads(1)  # the server's workers compute on one thread too
    os.chdir(ROOT)  # the snippet names the model relative to the checkout
    printed = StringIO()
    with redirect_stdout(printed):
        llm = generate_offline()
    chat = llm.generate([prompt_ids], SamplingParams(max_tokens=MAX_TOKENS))[0]
    return printed.getvalue().rstrip("\n"), chat


# =========================================================================== the tour
def tour(out: Recorder, pids_file: Path | None) -> None:
    """Start the server, run the requests, stop it, then the offline part; say it all."""
    model = MODEL
    server = server_process(model)
    out.normalize.port = server.port
    with server:  # started, and /health answered; stopped however the block ends
        if pids_file is not None:
            pids_file.write_text(json.dumps([p.pid for p in server.family]))
        text = run_requests(out, server, model)
        with out.section("stop"):
            offset = server.log_path.stat().st_size
            out.say(f"$ kill -INT {server.proc.pid}      # what Ctrl+C in its terminal does")
            start = time.monotonic()
            code = server.stop(signal.SIGINT, timeout_s=STOP_TIMEOUT_S, grace_s=5.0)
            seconds = time.monotonic() - start
            how = {128 + signal.SIGINT: " (128 + SIGINT: interrupted)", 0: ""}.get(code, "")
            out.say(f"the server exited with code {code}{how} after {seconds:.1f} s; "
                    "what it logged meanwhile:")
            out.say(server.log_text(offset).rstrip("\n"))
            # Helpers such as the resource tracker exit a moment after the launcher: stop()
            # gave them 5 s, and killed (and counted here) whatever was still there.
            out.say(f"processes left: {len(server.left_behind)} of {len(server.family)}")
    prompt, ids, tokenizer = tokenizer_step(model)
    with out.section("tokenizer"):
        out.say("The tokenizer worker's step, run here in this process "
                "(minisgl/tokenizer/tokenize.py):")
        out.say(f"  the chat template makes the prompt {prompt!r}")
        out.say(f"  {len(ids)} token ids: {ids}")
    printed, chat = offline(ids)
    with out.section("offline"):
        out.say(printed)
    with out.section("offline_chat"):
        out.say(f"llm.generate([the {len(ids)} prompt ids of the chat request], "
                f"SamplingParams(max_tokens={MAX_TOKENS}))")
        out.say(f"  token ids: {chat['token_ids']}, finish_reason {chat['finish_reason']!r}")
        pieces = [tokenizer.decode([token]) for token in chat["token_ids"]]
        out.say(f"  each token decoded alone: {pieces}")
        out.say(f"  text: {chat['text']!r}")
        out.say(f"  the same as the server's text: {chat['text'] == text}")


def run_requests(out: Recorder, server: ServerProcess, model: str) -> str:
    """Everything that needs the server up: sections launch, curl, openai, models, metrics
    and log. Returns the streamed text."""
    command = " ".join(server_command(model, out.normalize.port))
    with out.section("launch"):
        out.say(f"$ MINISGL_LOG_LEVEL=DEBUG {command} 2> server.log &")
        out.say(f"$ curl -s {server.url}/health      # asked until it answers")
        out.say(httpx.get(f"{server.url}/health", timeout=10).text)
        # Without the access lines of the health polls: as many as the start-up took.
        out.say("$ grep -v 'GET /health' server.log      # lines of different processes "
                "interleave differently on every run")
        out.say("\n".join(line for line in server.log_text().splitlines()
                          if "GET /health " not in line))
        workers = server.workers()
        helpers = len(server.family) - 1 - len(workers)
        out.say(f"processes: the launcher (pid {server.proc.pid}), {len(workers)} workers, "
                f"{helpers} helper process(es) (multiprocessing's resource tracker)")
    before = server.metrics()
    with out.section("curl"):
        raw = stream_with_curl_equivalent(out, server, model)
    text = streamed_text(raw)
    reply, body = ask_openai(server.url)
    with out.section("openai"):
        out.say("the body the server sent:")
        out.say(json.dumps(body, indent=2, ensure_ascii=False))
        content = reply.choices[0].message.content
        out.say(f"reply.choices[0].message.content: {content!r}")
        out.say(f"the same text as the stream's deltas joined: {content == text}")
    with out.section("models"):
        out.say(f"$ curl -s {server.url}/v1/models | python -m json.tool")
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
        out.say(json.dumps(models, indent=4))
    after = server.metrics()
    with out.section("metrics"):
        out.say(f"$ curl -s {server.url}/metrics | head -3")
        out.say("\n".join(httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()[:3]))
        out.say("every metric before the two requests, and after them:")
        width = max(map(len, after))
        for name, value in after.items():
            out.say(f"  {name:<{width}}  {before.get(name, 0):>3}  {value:>3}")
    log = server.log_text()
    # The access log line of each response pairs its (random) id with the request's uid.
    uids = [int(re.search(rf"uid=(\d+) .* id={re.escape(response_id)} ", log)[1])
            for response_id in (body["id"], json.loads(sse_events(raw)[0])["id"])]
    with out.section("log"):
        pattern = "|".join(str(uid) for uid in sorted(uids))
        out.say(f"$ grep -E 'request ({pattern})\\b|uid=({pattern}) ' server.log")
        found = re.compile(rf"\brequest ({pattern})\b|uid=({pattern}) ")
        out.say("\n".join(line for line in log.splitlines() if found.search(line)))
    return text


@functools.cache
def steps_module() -> ModuleType:
    """``tools/steps.py``, whose recording header the Tour shares."""
    spec = importlib.util.spec_from_file_location("_tour_steps", ROOT / "tools" / "steps.py")
    assert spec is not None and spec.loader is not None
    steps = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = steps  # its dataclasses look the module up while it loads
    spec.loader.exec_module(steps)
    return steps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tools/tour.py",
        description="Run the Tour: one chat request through the server on the book's small "
                    f"trained model ({MODEL}), on the CPU, and what each process shows "
                    "of it.")
    parser.add_argument("--record", action="store_true",
                        help=f"also write the output, one file per section, under --out "
                             f"(default {DEFAULT_OUT}/)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help=f"the directory --record writes (default: {DEFAULT_OUT}/)")
    parser.add_argument("--pids-file", type=Path, default=None,
                        help="write the process ids of the server's processes there (JSON), "
                             "so a test can check that none is left")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started in the background by a shell, which ignores SIGINT for such jobs: the server
        # would inherit that and ignore it too. A handler is not inherited across exec (the
        # server starts with the default), an ignored signal is.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.out is not None and not args.record:
        build_parser().error("--out is where --record writes; add --record")
    out = Recorder(Normalizer())
    with out.section("intro"):
        out.say("$ python tools/tour.py")
        out.say(f"The Tour, for real: one chat request to the server on {MODEL}, on the CPU.")
        out.say("What changes from run to run reads as a placeholder: process ids <pid>, the "
                "port <port>,\nclock times <time>, unix timestamps <created>, durations <s>, "
                "the checkout's directory <repo>.")
    tour(out, args.pids_file)
    if args.record:
        target = args.out or ROOT / DEFAULT_OUT
        out.write(target, f"# recorded on {steps_module().device_description()}")
        print(f"recorded in {target}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
