"""Chapter 16: requests that do not go well, and what the server holds before and after each.

The script starts ``python -m minisgl`` on a free port with the chapter's limits set low (a
slow reader is one that leaves 64 replies unread, or stays 2 s behind), then misbehaves as a
client would: it leaves in the middle of a stream, gives up on a whole answer, sends a prompt
longer than the context, reads a stream too slowly, and last stops the server with SIGTERM
while three streams are running. After each, ``/metrics`` shows the state every process holds
for requests: it must be back to zero.

    python examples/ch16_lifecycle.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import resolve_device

# The server harness is a tool of this repository, not part of the engine.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from server_process import ServerError, ServerProcess  # noqa: E402

# The state gauges /metrics shows, and a short name for each.
GAUGES = {"minisgl_frontend_live_requests": "frontend", "minisgl_frontend_buffered_replies":
          "buffered", "minisgl_detokenizer_live_states": "detokenizer",
          "minisgl_running_requests": "running", "minisgl_waiting_requests": "waiting",
          "minisgl_kv_pages_in_use": "KV pages"}


def state(server: ServerProcess) -> str:
    """The state gauges, once they have settled at zero (an abort takes a step to land)."""
    for _ in range(200):
        m = server.metrics()
        if not any(m[name] for name in GAUGES):
            break
        time.sleep(0.05)
    return ", ".join(f"{short} {m[name]}" for name, short in GAUGES.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args()
    example_checkpoint(args.model)
    device = resolve_device(args.device).type
    print("Chapter 16: when things go wrong: the request lifecycle")
    print(f"model: {args.model}; device: {device}")

    # The chapter's limits set low, and a session of its own (as a shell starts a command).
    # `with` waits until /health answers 200, and stops the server however the block ends.
    limits = ("--reply-buffer-size", "64", "--slow-reader-timeout", "2",
              "--shutdown-timeout", "1")
    try:
        with ServerProcess(args.model, device=device, args=limits, new_session=True) as server:
            print(f"\nidle:                 {state(server)}")
            leave_a_stream(server)
            give_up_on_a_whole_answer(server)
            too_long(server)
            slow_reader(server)
            stop_while_busy(server)
    except ServerError as exc:
        sys.exit(str(exc))


def leave_a_stream(server: ServerProcess) -> None:
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 10:
                m = server.metrics()  # a request holds state in every process while it runs
                held = [short for name, short in GAUGES.items()
                        if m[name] and name != "minisgl_frontend_buffered_replies"]
                print("\n1. a client leaves in the middle of a 2000-token stream")
                print(f"   while it streams, held by: {', '.join(held)}")
                break
    print(f"   after it left:      {state(server)}")


def give_up_on_a_whole_answer(server: ServerProcess) -> None:
    print("\n2. a client gives up after 0.5 s on a whole (not streamed) answer")
    try:
        httpx.post(f"{server.url}/v1/completions", timeout=httpx.Timeout(10, read=0.5), json={
            "prompt": "Tell me everything.", "max_tokens": 2000, "ignore_eos": True})
    except httpx.ReadTimeout:
        pass
    m = server.metrics()
    print(f"   after it left:      {state(server)}")
    print(f"   requests aborted so far: {m['minisgl_frontend_aborted_total']}")


def too_long(server: ServerProcess) -> None:
    print("\n3. a prompt of 5000 tokens, for a model with a context of 4096")
    for stream in (False, True):
        response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": [5] * 5000, "max_tokens": 16, "stream": stream})
        print(f"   stream={stream!s:<5}  HTTP {response.status_code}")
    error = response.json()["error"]
    print(f"   message: {error['message']}")
    print(f"   type {error['type']}, param {error['param']}, code {error['code']}")
    print(f"   after:              {state(server)}")


def slow_reader(server: ServerProcess) -> None:
    print("\n4. a client on a slow link that stops reading a 3000-token stream")
    sock = socket.socket()
    # A small receive window and small segments: the server's buffers fill in seconds.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps({"prompt": "Tell me a very long story", "max_tokens": 3000,
                       "ignore_eos": True, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    most = 0
    while not server.metrics()["minisgl_frontend_slow_readers_total"]:
        most = max(most, server.metrics()["minisgl_frontend_buffered_replies"])
        time.sleep(0.1)
    data = b""
    while b"data: [DONE]" not in data and select.select([sock], [], [], 10)[0]:
        data += sock.recv(1 << 16)
    sock.close()
    events = [line.strip() for line in data.split(b"\n") if line.startswith(b"data: ")]
    error = json.loads(events[-2][len(b"data: "):])["error"]
    m = server.metrics()
    print(f"   never more than 64 replies held for it: {most <= 64}")
    print(f"   its stream ends with an error event ({error['type']}, code {error['code']}) "
          f"and {events[-1].decode()}")
    print(f"   after:              {state(server)}")
    print(f"   slow readers cut off so far: {m['minisgl_frontend_slow_readers_total']}")


def stop_while_busy(server: ServerProcess) -> None:
    print("\n5. SIGTERM while three 3000-token streams run (--shutdown-timeout 1)")
    ends: dict[int, str] = {}
    ended_at: list[float] = []

    def read(i: int) -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
                "prompt": f"Story {i}", "max_tokens": 3000, "ignore_eos": True,
                "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line]
        ended_at.append(time.monotonic())
        ends[i] = json.loads(lines[-2][len("data: "):]).get("error", {}).get("code", "-")
        ends[i] += " then " + lines[-1]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    while server.metrics()["minisgl_running_requests"] < 3:
        time.sleep(0.05)
    start = time.monotonic()
    # Sends SIGTERM, waits for the launcher and then for every process it had.
    code = server.stop(signal.SIGTERM, timeout_s=60)
    for thread in threads:
        thread.join()
    ended = max(ended_at) - start
    print(f"   each stream ended with: {sorted(set(ends.values()))}")
    print(f"   within the shutdown timeout and a second: {ended < 2.0}")
    print(f"   the server exited with code {code}; processes left behind: "
          f"{len(server.left_behind)}")


if __name__ == "__main__":
    main()
