"""Chapter 15: start the whole service and talk to it with the OpenAI client.

The script starts ``python -m minisgl`` as a separate process, on a free port, waits until it
answers ``/health``, and then uses it like any OpenAI-compatible endpoint: a chat completion,
the same streamed, a plain completion, 8 requests at once, a client that walks away in the
middle of a stream. Last it stops the server with SIGTERM and checks that no process is left.

    python examples/ch15_server.py [--model models/tiny-shakespeare] [--device auto|cpu|cuda]

The default model is the book's small trained one, so the replies are words (in the manner of
Shakespeare's plays, the only text it has read); any checkpoint directory works.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from openai import OpenAI

from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import resolve_device

# The server harness is a tool of this repository, not part of the engine.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from server_process import ServerError, ServerProcess  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-shakespeare")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args()
    example_checkpoint(args.model)
    device = resolve_device(args.device).type
    print("Chapter 15: the API server and the launcher")
    print(f"model: {args.model}; device: {device}")

    # python -m minisgl on a free port, its log in a temporary file; `with` waits until
    # /health answers 200, and stops the server (and every worker) however the block ends.
    try:
        with ServerProcess(args.model, device=device) as server:
            workers = server.workers()
            print(f"\nserver up: the API server and {len(workers)} worker processes "
                  "(scheduler, detokenizer, tokenizer-0)")
            ready = next(line for line in server.log_text().splitlines()
                         if "minisgl serving" in line)
            print("  its log says: " + ready.split(": ", 1)[1].replace(str(server.port), "<port>"))
            client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            talk(client, server)
            code = server.stop(signal.SIGTERM, timeout_s=60)
            print(f"\nSIGTERM: the server exited with code {code}; processes left behind: "
                  f"{len(server.left_behind)}")
    except ServerError as exc:
        sys.exit(str(exc))


def talk(client: OpenAI, server: ServerProcess) -> None:
    model = client.models.list().data[0].id  # the name the server answers to
    question = [{"role": "user", "content": "What is a KV cache?"}]
    reply = client.chat.completions.create(model=model, messages=question, max_tokens=16,
                                           temperature=0)
    usage = reply.usage
    print(f"\nchat, not streamed: {reply.choices[0].message.content!r}")
    print(f"  id {reply.id}, finish_reason {reply.choices[0].finish_reason!r}, usage "
          f"{usage.prompt_tokens} + {usage.completion_tokens} = {usage.total_tokens} tokens")

    stream = client.chat.completions.create(model=model, messages=question, max_tokens=16,
                                            temperature=0, stream=True)
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    print(f"chat, streamed: {len(chunks)} chunks: a role, {len(pieces)} pieces of text, "
          f"a finish reason ({chunks[-1].choices[0].finish_reason!r})")
    print(f"  the first pieces: {pieces[:6]}")
    print(f"  joined they are the same text: {''.join(pieces) == reply.choices[0].message.content}")

    completion = client.completions.create(model=model, prompt="The capital of France is",
                                           max_tokens=12, temperature=0)
    print(f"completion: {completion.choices[0].text!r}")

    prompts = [f"Request number {i}: tell me about {word}" for i, word in
               enumerate(["cats", "rain", "tea", "maps", "jazz", "salt", "ice", "owls"])]

    def ask(prompt: str) -> str:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                        temperature=0, extra_body={"ignore_eos": True})
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts))
    alone = [ask(p) for p in prompts]
    print(f"\n8 requests at once: {len(set(together))} different answers; each equals the "
          f"answer its prompt gets alone: {together == alone}")
    for prompt, answer in list(zip(prompts, together))[:3]:
        print(f"  {prompt!r} -> {answer[:32]!r}...")

    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 6:
                break  # walk away: the connection closes here
    for _ in range(100):
        after = server.metrics()
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


if __name__ == "__main__":
    main()
