"""Chapter 14: the tokenizer and detokenizer workers, and the scheduler as a process.

What these tests pin down:

- the incremental detokenizer's pieces add up to the full decode of every prefix that ends on a
  character boundary, and never hold a broken character: ASCII, CJK, emoji, random text and
  random token ids (hypothesis);
- the tokenizer's chat template gives exactly ``transformers``' ``apply_chat_template`` ids,
  and a text prompt exactly ``tokenizer.encode`` (what ``LLM`` feeds the model);
- stop strings: found when split across tokens, text that may start one is held back until it
  cannot, the request ends with ``"stop"`` and the right usage, the scheduler is told to stop,
  and the tokens still in flight are dropped until the scheduler's last word;
- the readiness protocol reports a worker's start-up error with its traceback, and a worker
  that dies without a word; shared counters are shared;
- the three processes wired together on the tiny model: the text of several greedy requests is
  ``LLM.generate``'s, an abort frees every piece of state, a stop string stops generation, and
  no process is left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortRequest,
    DetokenizeRequest,
    FrontendMessage,
    TokenizeRequest,
    TokenizerMessage,
    TokenUsage,
    UserReply,
    dumps,
)
from minisgl.tokenizer.detokenize import (
    REPLACEMENT_CHAR,
    DecodeStream,
    DetokenizeManager,
    StopMatcher,
)
from minisgl.tokenizer.tokenize import TokenizeManager, load_tokenizer
from minisgl.utils.counters import SharedCounters
from minisgl.utils.processes import new_ready_queue, start_process, stop_processes, wait_ready
from minisgl.utils.queues import ZmqPullQueue, ZmqPushQueue, ipc_address

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog, twice.",
    "cjk": "你好，世界！今天天气很好。",
    "emoji": "ok 👋🏽 then 🧑‍💻 and 🇫🇷 done",
    "mixed": "déjà vu: 東京 🗼 at 9:41\n\tnaïve café",
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def chat_ids(tokenizer: Any, chat: list[dict[str, str]]) -> list[int]:
    """transformers' own rendering (a BatchEncoding from transformers 5, ids before)."""
    ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def pieces_of(tokenizer: Any, ids: list[int]) -> list[str]:
    """What a DecodeStream returns for each token, then its flush."""
    stream = DecodeStream(tokenizer.decode)
    return [stream.push(t) for t in ids] + [stream.flush()]


def assert_adds_up(tokenizer: Any, ids: list[int]) -> None:
    """The incremental pieces against the full decode of every prefix."""
    stream = DecodeStream(tokenizer.decode)
    sent = ""
    for k, token in enumerate(ids, start=1):
        piece = stream.push(token)
        assert not piece.endswith(REPLACEMENT_CHAR), f"token {k} sent a broken character"
        sent += piece
        full = tokenizer.decode(ids[:k])
        assert full.startswith(sent), f"after {k} tokens the pieces {sent!r} left {full!r}"
        if not full.endswith(REPLACEMENT_CHAR):  # a character boundary: nothing held back
            assert sent == full, f"after {k} tokens: pieces {sent!r} != full decode {full!r}"
    assert sent + stream.flush() == tokenizer.decode(ids)


# ---------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("name", TEXTS)
def test_incremental_text_is_the_full_decode_of_every_prefix(tokenizer: Any, name: str) -> None:
    assert_adds_up(tokenizer, tokenizer.encode(TEXTS[name]))


@pytest.mark.parametrize("name", ["cjk", "emoji"])
def test_multibyte_characters_come_out_whole(tokenizer: Any, name: str) -> None:
    ids = tokenizer.encode(TEXTS[name])
    assert len(ids) > len(TEXTS[name]) / 2, "the tiny tokenizer should split these characters"
    pieces = pieces_of(tokenizer, ids)
    assert "".join(pieces) == TEXTS[name]
    assert "" in pieces[:-1], "some token should end inside a character and be held back"
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_a_character_split_across_tokens_is_held_until_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("a你")
    assert tokenizer.decode(ids[:-1]).endswith(REPLACEMENT_CHAR)  # "你" is cut
    pieces = pieces_of(tokenizer, ids)
    assert pieces[-2] == "你" and pieces[:-2] == ["a"] + [""] * (len(ids) - 2)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_random_text_adds_up(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text)
    assert_adds_up(tokenizer, ids)
    assert "".join(pieces_of(tokenizer, ids)) == text


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_ids_add_up(tokenizer: Any, data: st.DataObject) -> None:
    # What a model may generate: any ids, bytes that never make a character included.
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=30))
    assert_adds_up(tokenizer, ids)


# ---------------------------------------------------------------------------------- tokenizing
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is a KV cache?"}],
    [{"role": "user", "content": "你好 👋"},
     {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHi."},
     {"role": "user", "content": "Again?"}],
]


@pytest.mark.parametrize("chat", CHATS, ids=["one-turn", "system", "multi-turn"])
def test_chat_template_matches_transformers(tokenizer: Any, chat: list[dict[str, str]]) -> None:
    request = TokenizeRequest(uid=7, sampling_params=SamplingParams(max_tokens=3), messages=chat)
    user_request = TokenizeManager(tokenizer).tokenize(request)
    assert user_request.input_ids == chat_ids(tokenizer, chat)
    assert tokenizer.decode(user_request.input_ids).endswith("<|im_start|>assistant\n")
    assert (user_request.uid, user_request.sampling_params) == (7, request.sampling_params)


def test_text_is_encoded_as_llm_does_and_ids_pass_through(tokenizer: Any) -> None:
    manager = TokenizeManager(tokenizer)
    params = SamplingParams()
    text = manager.tokenize(TokenizeRequest(uid=1, sampling_params=params, text=TEXTS["mixed"]))
    assert text.input_ids == tokenizer.encode(TEXTS["mixed"])
    ids = manager.tokenize(TokenizeRequest(uid=2, sampling_params=params, input_ids=[5, 9, 5]))
    assert ids.input_ids == [5, 9, 5]


def test_bad_prompts_are_clear_errors(tokenizer: Any) -> None:
    manager = TokenizeManager(tokenizer)
    with pytest.raises(ValueError, match="request 3: the prompt has no tokens"):
        manager.tokenize(TokenizeRequest(uid=3, sampling_params=SamplingParams(), text=""))
    with pytest.raises(ValueError, match="chat template cannot render"):
        manager.tokenize(TokenizeRequest(uid=4, sampling_params=SamplingParams(),
                                         messages=[{"role": "wizard", "content": "hi"}]))


# ---------------------------------------------------------------------------------- stop strings
def test_sampling_params_validates_stop_strings() -> None:
    assert SamplingParams(stop="END").stop == ("END",)  # one string is one stop string
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    with pytest.raises(ValueError, match="stop must be a sequence of non-empty strings"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match=r"\(3 is not\)"):
        SamplingParams(stop=["ok", 3])
    with pytest.raises(TypeError, match="stop must be a string or a sequence of strings"):
        SamplingParams(stop=b"END")


def test_stop_matcher_finds_a_stop_string_split_across_pieces() -> None:
    matcher = StopMatcher(("###",))
    assert matcher.feed("Answer: 4") == ("Answer: 4", False)
    assert matcher.feed("2 #") == ("2 ", False)  # "#" may start "###": held
    assert matcher.feed("#") == ("", False)
    assert matcher.feed("# and more") == ("", True)  # everything before "###" was sent


def test_stop_matcher_releases_text_that_cannot_start_a_stop_string() -> None:
    matcher = StopMatcher(("</answer>", "STOP"))
    assert matcher.feed("x </ans") == ("x ", False)
    assert matcher.feed("wer") == ("", False)
    assert matcher.feed("!") == ("</answer!", False)  # no longer a prefix: released whole
    assert matcher.feed("ST") == ("", False)
    assert matcher.flush() == "ST"  # the stream ended: what was held is text after all


def test_stop_matcher_cuts_at_the_first_stop_string() -> None:
    matcher = StopMatcher(("cd", "b"))
    assert matcher.feed("abcd") == ("a", True)


def first_token_message(uid: int, token: int, stop: tuple[str, ...] = (),
                        prompt_tokens: int = 4) -> DetokenizeRequest:
    return DetokenizeRequest(uid, token, stop=stop, prompt_tokens=prompt_tokens)


def test_a_stop_string_ends_the_text_and_stops_the_scheduler(tokenizer: Any) -> None:
    text = "Step one.\nEND\nStep two."
    ids = tokenizer.encode(text)
    assert len(ids) > 6
    manager = DetokenizeManager(tokenizer)
    messages = [first_token_message(5, ids[0], stop=("\nEND",))]
    messages += [DetokenizeRequest(5, t) for t in ids[1:]]
    replies, aborts = manager.process(messages)
    assert "".join(r.delta for r in replies) == "Step one."
    last = replies[-1]
    assert last.finish_reason == "stop", "the stop string must finish the request"
    stopped_at = len(replies)  # the token that completed "\nEND"
    assert tokenizer.decode(ids[:stopped_at]).endswith("\nEND")
    assert last.usage == TokenUsage(prompt_tokens=4, completion_tokens=stopped_at)
    assert aborts == [AbortRequest(5)], "the scheduler must be told to stop generating"
    assert len(manager.states) == 1, "a tombstone drops the tokens still in flight"


def test_the_tombstone_goes_with_the_schedulers_last_word(tokenizer: Any) -> None:
    ids = tokenizer.encode("one STOP two three four")
    for last_word in ("finished", "aborted"):
        manager = DetokenizeManager(tokenizer)
        replies, _ = manager.process([first_token_message(1, ids[0], stop=("STOP",))]
                                     + [DetokenizeRequest(1, t) for t in ids[1:-1]])
        assert replies[-1].finished
        end = (DetokenizeRequest(1, ids[-1], "length", TokenUsage(4, len(ids)))
               if last_word == "finished" else AbortRequest(1))
        late, aborts = manager.process([end])
        assert late == [] and aborts == [], "nothing is sent after the stop string"
        assert len(manager.states) == 0, f"the tombstone must go once the request is {last_word}"


def test_eos_is_not_text_and_length_decodes_every_token(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hi 你好")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for reason, tokens, expected in (("stop", [*ids, eos], "Hi 你好"),
                                     ("length", [*ids, eos], "Hi 你好<|im_end|>")):
        manager = DetokenizeManager(tokenizer)
        usage = TokenUsage(4, len(tokens))
        messages = [first_token_message(2, tokens[0])]
        messages += [DetokenizeRequest(2, t) for t in tokens[1:-1]]
        messages.append(DetokenizeRequest(2, tokens[-1], reason, usage))
        replies, aborts = manager.process(messages)
        assert len(replies) == len(tokens), "one reply per token"
        assert "".join(r.delta for r in replies) == expected
        assert (replies[-1].finish_reason, replies[-1].usage) == (reason, usage)
        assert aborts == [] and len(manager.states) == 0


def test_an_abort_frees_the_request_state(tokenizer: Any) -> None:
    manager = DetokenizeManager(tokenizer)
    manager.process([first_token_message(uid, 100 + uid) for uid in range(3)])
    assert len(manager.states) == 3
    manager.process([AbortRequest(1), AbortRequest(99)])  # 99: never seen, nothing to do
    assert sorted(manager.states) == [0, 2]


def test_first_token_fields_cost_nothing_on_later_tokens() -> None:
    first = msgpack.unpackb(dumps(DetokenizeRequest(3, 9, stop=("x",), prompt_tokens=12)))
    assert first["prompt_tokens"] == 12 and "stop" in first
    later = msgpack.unpackb(dumps(DetokenizeRequest(3, 10)))
    assert later == {"__type__": "DetokenizeRequest", "uid": 3, "next_token": 10}


# ---------------------------------------------------------------------------------- scheduler io
def test_scheduler_io_sends_one_message_per_token(tiny_model_dir: Path) -> None:
    from minisgl.message import UserRequest
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.io import SchedulerIO, scheduler_counters
    from minisgl.scheduler.scheduler import Scheduler

    stats = scheduler_counters()
    io = SchedulerIO(Scheduler(SchedulerConfig(tiny_model_dir, device="cpu",
                                                      **ENGINE_OPTIONS)), stats)
    stop = SamplingParams(max_tokens=5, stop=("xyz",))
    long = SamplingParams(max_tokens=50, ignore_eos=True)
    assert io.receive([UserRequest(1, [5, 6, 7], stop), UserRequest(2, [8, 9], long)]) == []
    sent: dict[int, list[DetokenizeRequest]] = {1: [], 2: []}
    while not sent[1] or not sent[1][-1].finished:
        for message in io.step():
            sent[message.uid].append(message)
    first, *rest, last = sent[1]
    assert (first.stop, first.prompt_tokens) == (("xyz",), 3), "the first token says it all"
    assert all(m.stop == () and m.prompt_tokens == 0 for m in [*rest, last])
    assert [m.finish_reason for m in sent[1]] == [None] * 4 + ["length"]
    assert last.usage == TokenUsage(3, 5) and all(m.usage is None for m in [first, *rest])
    assert stats["generation_tokens"] == len(sent[1]) + len(sent[2])
    assert stats["prompt_tokens"] == 5 and stats["running"] == 1 and stats["kv_pages_in_use"] > 0
    # An abort is passed on only when it dropped a request: 1 has finished, 2 runs.
    assert io.receive([AbortRequest(1), AbortRequest(2)]) == [AbortRequest(2)]
    io.step()  # an abort frees the pages at once; this step only publishes it
    assert not io.live and stats["running"] == stats["kv_pages_in_use"] == 0


# ---------------------------------------------------------------------------------- processes
def test_shared_counters_are_named_and_checked() -> None:
    counters = SharedCounters(["running", "generation_tokens"])
    counters.update(running=3)
    counters.update(generation_tokens=7)
    assert counters.snapshot() == {"running": 3, "generation_tokens": 7}
    assert counters["generation_tokens"] == 7
    with pytest.raises(KeyError, match="no counter named 'waiting'; the counters are running"):
        counters.update(waiting=1)
    with pytest.raises(ValueError, match="distinct names"):
        SharedCounters(["a", "a"])


def test_a_worker_that_fails_to_start_reports_its_traceback(tmp_path: Path) -> None:
    from minisgl.tokenizer.server import run_tokenizer

    ready = new_ready_queue()
    missing = tmp_path / "no-such-model"
    worker = start_process(run_tokenizer, "ch14-bad-tokenizer",
                           args=(str(missing), ipc_address("t"), ipc_address("s"), ready))
    try:
        with pytest.raises(RuntimeError) as failure:
            wait_ready(ready, [worker], timeout_s=60)
    finally:
        stop_processes([worker])
    message = str(failure.value)
    assert "worker ch14-bad-tokenizer" in message and "failed to start" in message
    assert "Traceback" in message and "no-such-model" in message


def test_a_worker_that_dies_silently_is_reported() -> None:
    ready = new_ready_queue()
    worker = start_process(os._exit, "ch14-silent", args=(3,))
    try:
        # "... did not get ready: it exited with code 3", or as of chapter 14 "... exited with
        # code 3 before it was ready"
        said = r"worker ch14-silent \(pid \d+\) .*exited with code 3( before it was ready)?$"
        with pytest.raises(RuntimeError, match=said):
            wait_ready(ready, [worker], timeout_s=60)
    finally:
        stop_processes([worker])


ORPHAN_PARENT = """
import os, sys
from minisgl.tokenizer.server import run_tokenizer
from minisgl.utils.processes import new_ready_queue, start_process, wait_ready
from minisgl.utils.queues import ipc_address

if __name__ == "__main__":
    ready = new_ready_queue()
    worker = start_process(run_tokenizer, "orphan-tokenizer",
                           args=(sys.argv[1], ipc_address("t"), ipc_address("s"), ready))
    wait_ready(ready, [worker], timeout_s=120)
    print(worker.pid, flush=True)
    os._exit(0)  # dies without stopping its worker, as a SIGKILL would
"""


@pytest.mark.slow
def test_a_worker_whose_parent_died_shuts_down(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(ORPHAN_PARENT)
    parent = psutil.Popen([sys.executable, str(script), str(tiny_model_dir)],
                          stdout=subprocess.PIPE, text=True)
    out, _ = parent.communicate(timeout=120)
    worker_pid = int(out.strip())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(worker_pid).status() == psutil.STATUS_ZOMBIE:
                break  # exited; waiting for whoever adopted it to reap it
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        psutil.Process(worker_pid).kill()
        raise AssertionError("the orphaned worker kept running after its parent died")


# ---------------------------------------------------------------------------------- the pipeline
ENGINE_OPTIONS: dict[str, Any] = {"page_size": 4, "num_pages": 256, "max_running_reqs": 8}


@dataclass
class Answer:
    text: str = ""
    replies: list[UserReply] = field(default_factory=list)

    @property
    def last(self) -> UserReply:
        return self.replies[-1]


@dataclass
class Pipeline:
    """Tokenizer, scheduler and detokenizer processes; this test plays the API server."""

    send: ZmqPushQueue
    receive: ZmqPullQueue
    processes: list[Any]
    scheduler_stats: SharedCounters
    detokenizer_stats: SharedCounters
    next_uid: int = 0

    def new_uid(self) -> int:
        self.next_uid += 1
        return self.next_uid

    def run(self, requests: list[TokenizeRequest], timeout_s: float = 60) -> dict[int, Answer]:
        """Send the requests; collect every reply until each request has finished."""
        self.send.put_many(requests)
        answers = {r.uid: Answer() for r in requests}
        pending = set(answers)
        while pending:
            reply = self.receive.get(timeout_s=timeout_s)
            if reply.uid not in answers:  # a straggler of an earlier test's aborted request
                continue
            answer = answers[reply.uid]
            assert not answer.replies or not answer.last.finished, "a reply after the last one"
            answer.replies.append(reply)
            answer.text += reply.delta
            if reply.finished:
                pending.discard(reply.uid)
        return answers

    def wait_for(self, condition: Any, what: str, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: scheduler {self.scheduler_stats.snapshot()}, "
                                     f"detokenizer {self.detokenizer_stats.snapshot()}")
            time.sleep(0.02)

    def idle(self) -> bool:
        s = self.scheduler_stats.snapshot()
        return (s["running"] == s["waiting"] == s["kv_pages_in_use"] == 0
                and self.detokenizer_stats["live_states"] == 0)


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir: Path) -> Iterator[Pipeline]:
    """The three workers, started once for the module's pipeline tests."""
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.io import run_scheduler, scheduler_counters
    from minisgl.tokenizer.server import detokenizer_counters, run_detokenizer, run_tokenizer

    model = str(tiny_model_dir)
    tokenizer_in, scheduler_in, detokenizer_in, frontend_in = (
        ipc_address(name) for name in ("tokenizer", "scheduler", "detokenizer", "frontend"))
    config = SchedulerConfig(model, device="cpu", **ENGINE_OPTIONS)
    ready = new_ready_queue()
    scheduler_stats, detokenizer_stats = scheduler_counters(), detokenizer_counters()
    with ZmqPullQueue(frontend_in, FrontendMessage, bind=True) as receive, \
            ZmqPushQueue(tokenizer_in, TokenizerMessage, bind=False) as send:
        processes = [
            start_process(run_scheduler, "ch14-scheduler",
                          args=(config, scheduler_in, detokenizer_in, ready, scheduler_stats)),
            start_process(run_detokenizer, "ch14-detokenizer",
                          args=(model, detokenizer_in, frontend_in, scheduler_in, ready,
                                detokenizer_stats)),
            start_process(run_tokenizer, "ch14-tokenizer",
                          args=(model, tokenizer_in, scheduler_in, ready)),
        ]
        try:
            wait_ready(ready, processes, timeout_s=120)
            yield Pipeline(send, receive, processes, scheduler_stats, detokenizer_stats)
        finally:
            stop_processes(processes, timeout_s=10)
    for process in processes:
        assert process.exitcode == 0, f"{process.name} exited with {process.exitcode}"
        assert not psutil.pid_exists(process.pid), f"{process.name} is still there"


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Any:
    from minisgl.llm import LLM

    return LLM(tiny_model_dir, device="cpu", **ENGINE_OPTIONS)


@pytest.mark.slow
def test_served_text_equals_llm_generate(pipeline: Pipeline, llm: Any) -> None:
    prompts = ["Hello, my name is", "你好，世界", "The capital of France is", "def main():"]
    params = [SamplingParams(max_tokens=n) for n in (12, 20, 7, 16)]
    expected = llm.generate(prompts, params)
    # A stop token met early: the request ends with "stop" and that token is not text.
    stop_token = expected[0]["token_ids"][3]
    prompts.append(prompts[0])
    params.append(SamplingParams(max_tokens=12, stop_token_ids=(stop_token,)))
    expected += llm.generate(prompts[-1:], params[-1:])
    chat = [{"role": "user", "content": "Name a color."}]
    expected += llm.generate([chat_ids(llm.tokenizer, chat)], SamplingParams(max_tokens=10))

    uids = [pipeline.new_uid() for _ in range(len(prompts) + 1)]
    requests = [TokenizeRequest(uid, p, text=text) for uid, text, p in zip(uids, prompts, params)]
    requests.append(TokenizeRequest(uids[-1], SamplingParams(max_tokens=10), messages=chat))
    answers = pipeline.run(requests)
    for uid, want in zip(uids, expected):
        answer = answers[uid]
        assert answer.text == want["text"], f"request {uid}"
        assert answer.last.finish_reason == want["finish_reason"], f"request {uid}"
        assert len(answer.replies) == len(want["token_ids"]), "one reply per generated token"
        assert answer.last.usage.completion_tokens == len(want["token_ids"])
    assert answers[uids[-2]].last.finish_reason == "stop"
    assert answers[uids[0]].last.usage.prompt_tokens == len(llm.tokenizer.encode(prompts[0]))
    pipeline.wait_for(pipeline.idle, "state left after every request finished")


@pytest.mark.slow
def test_an_abort_frees_every_piece_of_state(pipeline: Pipeline) -> None:
    uid = pipeline.new_uid()
    pipeline.send.put(TokenizeRequest(uid, SamplingParams(max_tokens=900, ignore_eos=True),
                                      text="Tell me a long story."))
    for _ in range(3):  # it is running: a few tokens came back
        assert pipeline.receive.get(timeout_s=60).uid == uid
    assert pipeline.scheduler_stats["running"] == 1
    pipeline.send.put(AbortRequest(uid))  # as the API server does, through the tokenizer
    pipeline.wait_for(pipeline.idle, "state left after an abort")
    for reply in pipeline.receive.drain():  # tokens that were on their way when it was aborted
        assert reply.uid == uid and not reply.finished
    generated = pipeline.scheduler_stats["generation_tokens"]
    time.sleep(0.2)
    assert pipeline.scheduler_stats["generation_tokens"] == generated, "it still generates"


@pytest.mark.slow
def test_a_stop_string_stops_generation(pipeline: Pipeline, llm: Any) -> None:
    prompt, max_tokens = "Once upon a time", 400
    want = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    cut = len(llm.tokenizer.decode(want["token_ids"][:6]))
    stop = want["text"][cut - 2:cut + 2]  # across the text of tokens 6 and 7
    assert len(stop) == 4
    expected = want["text"][:want["text"].find(stop)]
    before = pipeline.scheduler_stats["generation_tokens"]
    uid = pipeline.new_uid()
    answer = pipeline.run([TokenizeRequest(uid, SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, stop=(stop,)), text=prompt)])[uid]
    assert answer.text == expected
    assert answer.last.finish_reason == "stop"
    assert answer.last.usage.completion_tokens == len(answer.replies)
    pipeline.wait_for(pipeline.idle, "state left after a stop string")
    spent = pipeline.scheduler_stats["generation_tokens"] - before
    assert spent < max_tokens // 2, f"the scheduler ran on for {spent} tokens after the stop"


def test_offline_llm_refuses_stop_strings_it_cannot_apply(tiny_model_dir) -> None:
    # Stop strings live in the detokenizer; LLM.generate must say so instead of ignoring them.
    from minisgl.llm import LLM

    llm = LLM(tiny_model_dir, device="cpu", num_pages=64, max_running_reqs=2)
    with pytest.raises(ValueError, match="stop strings are applied by the server"):
        llm.generate(["hello"], SamplingParams(max_tokens=2, stop=("###",)))
    assert llm.generate(["hello"], SamplingParams(max_tokens=2))[0]["finish_reason"] == "length"
