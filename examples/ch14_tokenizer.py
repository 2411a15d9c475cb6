"""Chapter 14: the tokenizer and detokenizer workers, alone and then wired to the scheduler.

First the pure logic, in this process: a chat conversation rendered by the checkpoint's chat
template; a text whose CJK and emoji characters the model's byte-level BPE (trained on English
plays, it has no merge for them) splits into several tokens, decoded one token at a time (a
piece is held back while its character is incomplete); and a stop string that arrives split
across tokens. Then the real thing: a tokenizer, a scheduler and a
detokenizer, each a spawned process, fed and read by this script as the API server of chapter 15
will: three requests (a text prompt, a chat, one with a stop string) whose text must equal
``LLM.generate``'s, and one long request aborted after its third reply.

    python examples/ch14_tokenizer.py [--model models/tiny-shakespeare] [--device auto|cpu|cuda]

The default model is the book's small trained one, so the replies in part 4 are words.
"""

from __future__ import annotations

import argparse
import time

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortRequest,
    DetokenizeRequest,
    FrontendMessage,
    TokenizeRequest,
    TokenizerMessage,
    UserReply,
)
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.io import run_scheduler, scheduler_counters
from minisgl.tokenizer.detokenize import DecodeStream, DetokenizeManager
from minisgl.tokenizer.server import detokenizer_counters, run_detokenizer, run_tokenizer
from minisgl.tokenizer.tokenize import TokenizeManager, load_tokenizer
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.counters import SharedCounters
from minisgl.utils.processes import new_ready_queue, start_process, stop_processes, wait_ready
from minisgl.utils.queues import ZmqPullQueue, ZmqPushQueue, ipc_address

ENGINE_OPTIONS = {"page_size": 4, "num_pages": 256, "max_running_reqs": 8}
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi 👋"}]


def show_chat_template(tokenizer) -> None:
    print("\n1. the chat template")
    request = TokenizeRequest(uid=0, sampling_params=SamplingParams(), messages=CHAT)
    ids = TokenizeManager(tokenizer).tokenize(request).input_ids
    reference = tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    reference = list(reference["input_ids"] if hasattr(reference, "keys") else reference)
    print(f"  messages: {CHAT}")
    print(f"  rendered: {tokenizer.decode(ids)!r}")
    print(f"  {len(ids)} token ids; equal to transformers' apply_chat_template: {ids == reference}")


def show_incremental_text(tokenizer) -> None:
    text = "Hi 你好 👋!"
    ids = tokenizer.encode(text)
    print(f"\n2. incremental text: {text!r} is {len(ids)} tokens")
    print(f"  {'token':>5}  {'decoded alone':<15}piece sent")
    stream = DecodeStream(tokenizer.decode)
    pieces = []
    for token in ids:
        piece = stream.push(token)
        pieces.append(piece)
        note = "  held: its character is not complete" if not piece else ""
        print(f"  {token:>5}  {tokenizer.decode([token])!r:<15}{piece!r}{note}")
    pieces.append(stream.flush())
    print(f"  pieces joined == full decode: {''.join(pieces) == tokenizer.decode(ids)}")


def show_stop_string(tokenizer) -> None:
    text, stop = "The answer is 42.\n###\nThe end.", "\n###"
    ids = tokenizer.encode(text)
    manager = DetokenizeManager(tokenizer)
    messages = [DetokenizeRequest(9, ids[0], stop=(stop,), prompt_tokens=5)]
    messages += [DetokenizeRequest(9, token) for token in ids[1:]]
    replies, aborts = manager.process(messages)
    print(f"\n3. the stop string {stop!r} in {text!r} ({len(ids)} tokens)")
    print(f"  pieces: {[r.delta for r in replies]}")
    last = replies[-1]
    print(f"  finish_reason {last.finish_reason!r} after {len(replies)} tokens, usage "
          f"{last.usage.prompt_tokens}+{last.usage.completion_tokens}; to the scheduler: {aborts}")
    print(f"  the {len(ids) - len(replies)} later tokens are dropped; states kept: "
          f"{len(manager.states)} (a tombstone, until the scheduler's last word)")


def wait_idle(scheduler: SharedCounters, detokenizer: SharedCounters) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = scheduler.snapshot()
        if s["running"] == s["waiting"] == s["kv_pages_in_use"] == detokenizer["live_states"] == 0:
            return
        time.sleep(0.02)
    raise RuntimeError(f"still busy: {scheduler} {detokenizer}")


def collect(receive: ZmqPullQueue, uids: list[int]) -> dict[int, list[UserReply]]:
    replies: dict[int, list[UserReply]] = {uid: [] for uid in uids}
    pending = set(uids)
    while pending:
        reply = receive.get(timeout_s=120)
        replies[reply.uid].append(reply)
        if reply.finished:
            pending.discard(reply.uid)
    return replies


def offline_reference(model: str, device: str, tokenizer) -> tuple[list[dict], str]:
    """LLM.generate's answers to the three requests, and a stop string for the third: four
    characters of its answer across two tokens' text."""
    from minisgl.llm import LLM  # the offline engine of chapter 9

    llm = LLM(model, device=device, **ENGINE_OPTIONS)
    chat_ids = TokenizeManager(tokenizer).apply_chat_template(CHAT)  # what the worker sends
    answers = llm.generate(["Hello, my name is", chat_ids, "A list of fruits:"],
                           [SamplingParams(max_tokens=12), SamplingParams(max_tokens=10),
                            SamplingParams(max_tokens=16, ignore_eos=True)])
    cut = len(tokenizer.decode(answers[2]["token_ids"][:8]))
    stop = answers[2]["text"][cut - 2:cut + 2]
    answers[2]["text"] = answers[2]["text"][:answers[2]["text"].find(stop)]
    return answers, stop


def run_pipeline(model: str, device: str, tokenizer) -> None:
    offline, stop = offline_reference(model, device, tokenizer)
    print("\n4. the pipeline: tokenizer, scheduler and detokenizer processes")
    tokenizer_in, scheduler_in, detokenizer_in, frontend_in = (
        ipc_address(name) for name in ("tokenizer", "scheduler", "detokenizer", "frontend"))
    config = SchedulerConfig(model, device=device, **ENGINE_OPTIONS)
    ready = new_ready_queue()
    scheduler_stats, detokenizer_stats = scheduler_counters(), detokenizer_counters()
    with ZmqPullQueue(frontend_in, FrontendMessage, bind=True) as receive, \
            ZmqPushQueue(tokenizer_in, TokenizerMessage, bind=False) as send:
        processes = [
            start_process(run_scheduler, "scheduler",
                          args=(config, scheduler_in, detokenizer_in, ready, scheduler_stats)),
            start_process(run_detokenizer, "detokenizer",
                          args=(model, detokenizer_in, frontend_in, scheduler_in, ready,
                                detokenizer_stats)),
            start_process(run_tokenizer, "tokenizer-0",
                          args=(model, tokenizer_in, scheduler_in, ready)),
        ]
        try:
            wait_ready(ready, processes)
            print(f"  ready: {', '.join(p.name for p in processes)}")
            requests = [
                TokenizeRequest(1, SamplingParams(max_tokens=12), text="Hello, my name is"),
                TokenizeRequest(2, SamplingParams(max_tokens=10), messages=CHAT),
                TokenizeRequest(3, SamplingParams(max_tokens=300, ignore_eos=True, stop=(stop,)),
                                text="A list of fruits:"),
            ]
            send.put_many(requests)
            answers = collect(receive, [r.uid for r in requests])
            for request, want in zip(requests, offline):
                replies = answers[request.uid]
                text = "".join(r.delta for r in replies)
                last = replies[-1]
                kind = "chat" if request.messages else "text"
                extra = f", stop {stop!r}" if request.sampling_params.stop else ""
                print(f"  request {request.uid} ({kind}{extra}): {len(replies)} replies, finish "
                      f"{last.finish_reason}, usage {last.usage.prompt_tokens}+"
                      f"{last.usage.completion_tokens}")
                print(f"    {text!r}  equal to LLM.generate: {text == want['text']}")

            send.put(TokenizeRequest(4, SamplingParams(max_tokens=900, ignore_eos=True),
                                     text="Tell me a long story."))
            for _ in range(3):
                receive.get(timeout_s=120)
            send.put(AbortRequest(4))
            wait_idle(scheduler_stats, detokenizer_stats)
            print("  request 4 (900 tokens) aborted after its 3rd reply")
            counters = {**scheduler_stats.snapshot(), **detokenizer_stats.snapshot()}
            del counters["generation_tokens"]  # varies: tokens made before an abort lands
            print(f"  counters once idle: {counters}")
        finally:
            stop_processes(processes)
    print(f"  stopped: exit codes {[p.exitcode for p in processes]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-shakespeare",
                        help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (the scheduler's)")
    args = parser.parse_args()
    example_checkpoint(args.model)
    from minisgl.utils.torch_utils import resolve_device

    print("Chapter 14: tokenizer and detokenizer workers")
    print(f"model: {args.model}, device: {resolve_device(args.device).type} (the scheduler's)")
    tokenizer = load_tokenizer(args.model)
    show_chat_template(tokenizer)
    show_incremental_text(tokenizer)
    show_stop_string(tokenizer)
    run_pipeline(args.model, args.device, tokenizer)


if __name__ == "__main__":  # required with spawn: the children import this file as a module
    main()
