"""Chapter 13: typed messages between processes, over ZMQ.

First the messages themselves: what one looks like on the wire, and how many bytes each kind
takes with our msgpack serializer against pickle. Then a round trip through a second process:
a *fake scheduler*, started with spawn, pulls UserRequest and AbortRequest messages from a ZMQ
queue and answers with one DetokenizeRequest per generated token, exactly as the real scheduler
will. It needs no model: its "model" replays each prompt backwards. This script plays the two
workers on either side of it: the tokenizer (it sends the requests) and the detokenizer (it
collects the tokens).

    python examples/ch13_messages.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import pickle
from dataclasses import dataclass, field

import msgpack

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortRequest,
    BackendMessage,
    DetokenizeRequest,
    DetokenizerMessage,
    Message,
    TokenizeRequest,
    TokenUsage,
    UserReply,
    UserRequest,
    dumps,
    loads,
)
from minisgl.utils.processes import start_process, stop_process
from minisgl.utils.queues import ZmqPullQueue, ZmqPushQueue, ipc_address


# ---------------------------------------------------------------- the fake scheduler (child)
@dataclass
class FakeRequest:
    uid: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)

    def next_token(self) -> int:
        """The "model": the prompt read backwards, round and round."""
        return self.prompt[-1 - len(self.output) % len(self.prompt)]


def fake_scheduler(inbox: str, outbox: str, num_requests: int) -> None:
    """Serve ``num_requests`` requests, one token per running request per step, then exit."""
    running: dict[int, FakeRequest] = {}
    seen = 0
    with ZmqPullQueue(inbox, BackendMessage, bind=True) as receive, \
            ZmqPushQueue(outbox, DetokenizerMessage, bind=False) as send:
        while seen < num_requests or running:
            # Wait only when there is nothing to run; then take whatever else has arrived.
            messages = [] if running else [receive.get(timeout_s=60)]
            for message in messages + receive.drain():
                if isinstance(message, UserRequest):
                    seen += 1
                    running[message.uid] = FakeRequest(message.uid, message.input_ids,
                                                       message.sampling_params)
                elif isinstance(message, AbortRequest):
                    running.pop(message.uid, None)
            step: list[DetokenizeRequest] = []
            for req in list(running.values()):
                token = req.next_token()
                req.output.append(token)
                reason = ("stop" if token in req.params.stop_token_ids
                          else "length" if len(req.output) == req.params.max_tokens else None)
                usage = TokenUsage(len(req.prompt), len(req.output)) if reason else None
                step.append(DetokenizeRequest(req.uid, token, reason, usage))
                if reason:
                    del running[req.uid]
            send.put_many(step)  # one frame per step, like the real scheduler
        send.close(linger_s=5)  # let the last frame reach the detokenizer before exiting


# ---------------------------------------------------------------- the parent
def brief(reply: DetokenizeRequest) -> str:
    text = f"DetokenizeRequest(uid={reply.uid}, next_token={reply.next_token}"
    if reply.usage is not None:
        text += (f", finish_reason={reply.finish_reason!r}, usage={reply.usage.prompt_tokens}"
                 f"+{reply.usage.completion_tokens}")
    return text + ")"


def size_table() -> None:
    chat = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is a KV cache?"}]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=128)
    rows: list[tuple[str, Message]] = [
        ("TokenizeRequest (chat, 2 turns)", TokenizeRequest(0, params, messages=chat)),
        ("UserRequest (8 prompt tokens)", UserRequest(0, list(range(1000, 1008)), params)),
        ("UserRequest (4096 prompt tokens)", UserRequest(0, list(range(1000, 5096)), params)),
        ("AbortRequest", AbortRequest(0)),
        ("DetokenizeRequest (mid-stream)", DetokenizeRequest(0, 1234)),
        ("DetokenizeRequest (last token)",
         DetokenizeRequest(0, 1234, "length", TokenUsage(8, 128))),
        ("UserReply (mid-stream)", UserReply(0, " cache")),
    ]
    print(f"\n{'serialized size, bytes':<34}{'msgpack':>8}{'pickle':>8}")
    for label, message in rows:
        frame = dumps(message)
        assert loads(frame) == message
        print(f"  {label:<32}{len(frame):>8}{len(pickle.dumps(message, 5)):>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3",
                        help="unused here: the fake scheduler needs no model")
    parser.add_argument("--device", default="auto", help="unused here: no tensors are involved")
    args = parser.parse_args()
    print("Chapter 13: messages and processes")
    print(f"model: none loaded ({args.model} is not needed: a fake scheduler answers); "
          f"device: none")

    message = DetokenizeRequest(uid=0, next_token=14)
    print(f"\n{message}\n  on the wire: {msgpack.unpackb(dumps(message))}")
    size_table()

    inbox, outbox = ipc_address("scheduler"), ipc_address("detokenizer")
    requests = [
        UserRequest(0, [11, 12, 13, 14], SamplingParams(max_tokens=3)),
        UserRequest(1, [21, 22, 23], SamplingParams(max_tokens=8, stop_token_ids=(22,))),
        UserRequest(2, [31, 32], SamplingParams(max_tokens=8)),
    ]
    print("\nround trip: parent -> fake-scheduler -> parent")
    with ZmqPullQueue(outbox, DetokenizerMessage, bind=True) as detokenizer, \
            ZmqPushQueue(inbox, BackendMessage, bind=False) as tokenizer:
        worker = start_process(fake_scheduler, "fake-scheduler",
                               args=(inbox, outbox, len(requests)))
        print(f"  started {worker.name!r} as a {type(worker).__name__}")
        # One frame: three requests, then an abort that reaches the scheduler before uid 2 runs.
        tokenizer.put_many([*requests, AbortRequest(2)])
        outputs: dict[int, list[int]] = {}
        finished: dict[int, DetokenizeRequest] = {}
        while len(finished) < 2:  # uid 2 was aborted: no token, no last message
            reply = detokenizer.get(timeout_s=60)
            print(f"  <- {brief(reply)}")
            outputs.setdefault(reply.uid, []).append(reply.next_token)
            if reply.finished:
                finished[reply.uid] = reply
        exit_code = stop_process(worker)

    print("\nper request:")
    for request in requests:
        last = finished.get(request.uid)
        ending = (f"finish {last.finish_reason}, usage {last.usage.prompt_tokens}+"
                  f"{last.usage.completion_tokens}" if last and last.usage
                  else "aborted: no reply at all (the scheduler dropped it)")
        print(f"  uid {request.uid}: prompt {request.input_ids} -> "
              f"{outputs.get(request.uid, [])}  {ending}")
    print(f"{worker.name} exited with code {exit_code}")


if __name__ == "__main__":  # required with spawn: the child imports this file as a module
    main()
