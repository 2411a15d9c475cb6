"""Chapter 15: start the whole service and talk to it with the OpenAI client.

The script starts ``python -m minisgl`` as a separate process, on a free port, waits until it
answers ``/health``, and then uses it like any OpenAI-compatible endpoint: a chat completion,
the same streamed, a plain completion, 8 requests at once, a client that walks away in the
middle of a stream. Last it stops the server with SIGTERM and checks that no process is left.

    python examples/ch15_server.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from openai import OpenAI

from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import resolve_device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with code {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    sys.exit(f"the server did not come up within {timeout_s:.0f} s; see {log}")


def metrics(url: str) -> dict[str, int]:
    text = httpx.get(f"{url}/metrics").text
    return {line.split()[0]: int(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def workers_of(pid: int) -> list[psutil.Process]:
    """The server's worker processes (spawned children; not multiprocessing's helper)."""
    return [p for p in psutil.Process(pid).children(recursive=True)
            if "multiprocessing.spawn" in " ".join(p.cmdline())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args()
    example_checkpoint(args.model)
    device = resolve_device(args.device).type
    print("Chapter 15: the API server and the launcher")
    print(f"model: {args.model}; device: {device}")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="minisgl-ch15-")) / "server.log"
    command = [sys.executable, "-m", "minisgl", "--model", args.model, "--port", str(port),
               "--device", device]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with log.open("w") as log_file:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_file, env=env)
    try:
        wait_until_up(server, url, log)
        workers = workers_of(server.pid)
        print(f"\nserver up: the API server and {len(workers)} worker processes "
              "(scheduler, detokenizer, tokenizer-0)")
        ready = next(line for line in log.read_text().splitlines() if "minisgl serving" in line)
        print("  its log says: " + ready.split(": ", 1)[1].replace(str(port), "<port>"))
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        talk(client, url)
    finally:
        stop(server, url)


def talk(client: OpenAI, url: str) -> None:
    question = [{"role": "user", "content": "What is a KV cache?"}]
    reply = client.chat.completions.create(model="tiny", messages=question, max_tokens=16,
                                           temperature=0)
    usage = reply.usage
    print(f"\nchat, not streamed: {reply.choices[0].message.content!r}")
    print(f"  id {reply.id}, finish_reason {reply.choices[0].finish_reason!r}, usage "
          f"{usage.prompt_tokens} + {usage.completion_tokens} = {usage.total_tokens} tokens")

    stream = client.chat.completions.create(model="tiny", messages=question, max_tokens=16,
                                            temperature=0, stream=True)
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    print(f"chat, streamed: {len(chunks)} chunks: a role, {len(pieces)} pieces of text, "
          f"a finish reason ({chunks[-1].choices[0].finish_reason!r})")
    print(f"  the first pieces: {pieces[:6]}")
    print(f"  joined they are the same text: {''.join(pieces) == reply.choices[0].message.content}")

    completion = client.completions.create(model="tiny", prompt="The capital of France is",
                                           max_tokens=12, temperature=0)
    print(f"completion: {completion.choices[0].text!r}")

    prompts = [f"Request number {i}: tell me about {word}" for i, word in
               enumerate(["cats", "rain", "tea", "maps", "jazz", "salt", "ice", "owls"])]

    def ask(prompt: str) -> str:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                        temperature=0, extra_body={"ignore_eos": True})
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts))
    alone = [ask(p) for p in prompts]
    print(f"\n8 requests at once: {len(set(together))} different answers; each equals the "
          f"answer its prompt gets alone: {together == alone}")
    for prompt, answer in list(zip(prompts, together))[:3]:
        print(f"  {prompt!r} -> {answer[:32]!r}...")

    before = metrics(url)
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 6:
                break  # walk away: the connection closes here
    for _ in range(100):
        after = metrics(url)
        if after["minisgl_running_requests"] == 0 and after["minisgl_frontend_aborted_total"]:
            break
        time.sleep(0.05)
    generated = after["minisgl_generation_tokens_total"] - before["minisgl_generation_tokens_total"]
    print("\na client asked for 2000 tokens and left after a few chunks:")
    print(f"  aborted requests {before['minisgl_frontend_aborted_total']} -> "
          f"{after['minisgl_frontend_aborted_total']}; running now "
          f"{after['minisgl_running_requests']}; KV pages in use "
          f"{after['minisgl_kv_pages_in_use']}; fewer than 2000 tokens generated: "
          f"{generated < 2000}")


def stop(server: subprocess.Popen, url: str) -> None:
    if server.poll() is not None:
        return
    family = psutil.Process(server.pid).children(recursive=True)
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        code = server.wait()
    _, alive = psutil.wait_procs(family, timeout=15)
    print(f"\nSIGTERM: the server exited with code {code}; processes left behind: {len(alive)}")


if __name__ == "__main__":
    main()
