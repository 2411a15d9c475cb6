"""Chapter 13: typed messages, their serialization, ZMQ queues and spawned processes.

What these tests pin down:

- every message type round-trips through ``dumps``/``loads`` unchanged: hand-written examples
  of each, and random field values (hypothesis); so do nested tuples, dicts, bytes and None;
- a frame is compact: fields at their default are not sent, token ids are packed as plain ints;
- an unknown type tag, a frame with missing fields and bytes that are no frame at all are
  rejected with errors that say what was wrong;
- queues are typed: a message of the wrong family is refused at either end;
- push/pull across a spawned process delivers every message, in order, single or batched;
- the async queues work inside an asyncio event loop, and time out cleanly;
- workers are started with spawn, not fork (a child does not see a module variable the parent
  changed after import), and a child that exits is reaped, one that hangs is stopped.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
import time
from typing import Any

import msgpack
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortRequest,
    BackendMessage,
    DetokenizeRequest,
    FrontendMessage,
    Message,
    SerializationError,
    TokenizeRequest,
    TokenUsage,
    UserReply,
    UserRequest,
    dumps,
    loads,
    registered_types,
)
from minisgl.utils.processes import start_process, stop_process
from minisgl.utils.queues import (
    ZmqAsyncPullQueue,
    ZmqAsyncPushQueue,
    ZmqPullQueue,
    ZmqPushQueue,
    ipc_address,
)

# Chapter 17 adds the messages rank 0 sends its followers; in a tree that has them (any later
# chapter's) they are registered message types too, and must round-trip like the others.
try:
    from minisgl.scheduler.tp import RankInput, RankStep
except ImportError:  # chapter 13 to 16's trees
    RankInput = RankStep = None  # type: ignore[assignment,misc]

# ---------------------------------------------------------------------------------- examples
EXAMPLES: list[Message] = [
    TokenizeRequest(uid=0, sampling_params=SamplingParams(), text="Hello"),
    TokenizeRequest(uid=1, sampling_params=SamplingParams(temperature=0.8, top_p=0.9, seed=7),
                    input_ids=[1, 2, 3]),
    TokenizeRequest(uid=2, sampling_params=SamplingParams(max_tokens=64),
                    messages=[{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "你好 👋"}]),
    AbortRequest(uid=2),
    UserRequest(uid=1, input_ids=list(range(1000)),
                sampling_params=SamplingParams(stop_token_ids=[5, 6], ignore_eos=True,
                                               seed=2**64 - 1)),
    DetokenizeRequest(uid=1, next_token=42),
    DetokenizeRequest(uid=1, next_token=2, finish_reason="stop", usage=TokenUsage(3, 7)),
    UserReply(uid=1, delta="wor"),
    UserReply(uid=1, delta="", finish_reason="length", usage=TokenUsage(3, 16)),
]

MESSAGE_TYPES = sorted((cls for cls in registered_types().values() if issubclass(cls, Message)),
                       key=lambda cls: cls.__name__)

# Random but valid field values, one strategy per message type.
uids = st.integers(0, 2**63 - 1)
token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=64)
sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.0, 2.0),
    top_k=st.just(-1) | st.integers(1, 1000),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    min_p=st.floats(0.0, 1.0),
    ignore_eos=st.booleans(),
    max_tokens=st.integers(1, 1 << 20),
    stop_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=4).map(tuple),
    seed=st.none() | st.integers(0, 2**64 - 1),
)
finish_reasons = st.none() | st.sampled_from(["stop", "length"])
usages = st.none() | st.builds(TokenUsage, st.integers(0, 1 << 20), st.integers(0, 1 << 20))
chat = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                       "content": st.text()}), min_size=1, max_size=4)
STRATEGIES: dict[type, st.SearchStrategy[Message]] = {
    TokenizeRequest: st.one_of(
        st.builds(TokenizeRequest, uid=uids, sampling_params=sampling_params, text=st.text()),
        st.builds(TokenizeRequest, uid=uids, sampling_params=sampling_params,
                  input_ids=token_ids),
        st.builds(TokenizeRequest, uid=uids, sampling_params=sampling_params, messages=chat),
    ),
    AbortRequest: st.builds(AbortRequest, uid=uids),
    UserRequest: st.builds(UserRequest, uid=uids, input_ids=token_ids,
                           sampling_params=sampling_params),
    DetokenizeRequest: st.builds(DetokenizeRequest, uid=uids, next_token=st.integers(0, 2**31),
                                 finish_reason=finish_reasons, usage=usages),
    UserReply: st.builds(UserReply, uid=uids, delta=st.text(), finish_reason=finish_reasons,
                         usage=usages),
}

if RankInput is not None:  # chapter 17's messages, in the trees that have them
    EXAMPLES += [RankInput(AbortRequest(uid=3)), RankStep(step=12),
                 RankInput(UserRequest(uid=4, input_ids=[7, 8], sampling_params=SamplingParams()))]
    STRATEGIES[RankInput] = st.builds(RankInput, message=st.one_of(STRATEGIES[AbortRequest],
                                                                   STRATEGIES[UserRequest]))
    STRATEGIES[RankStep] = st.builds(RankStep, step=st.integers(0, 2**63 - 1))


def strictly_equal(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (``True == 1`` and ``(1,) != [1]`` here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(strictly_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(strictly_equal(a[k], b[k]) for k in a)
    return a == b


# ---------------------------------------------------------------------------------- serializer
def test_every_message_type_has_an_example_and_a_strategy() -> None:
    example_types = {type(message) for message in EXAMPLES}
    for cls in MESSAGE_TYPES:
        assert cls in example_types, f"add an example of {cls.__name__} to EXAMPLES"
        assert cls in STRATEGIES, f"add a hypothesis strategy for {cls.__name__} to STRATEGIES"


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_example_message_round_trips(message: Message) -> None:
    frame = dumps(message)
    assert isinstance(frame, bytes)
    back = loads(frame)
    assert type(back) is type(message)
    assert back == message


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_messages_round_trip(cls: type, data: st.DataObject) -> None:
    message = data.draw(STRATEGIES[cls])
    assert loads(dumps(message)) == message


int64s = st.integers(-2**63, 2**64 - 1)  # what msgpack packs: int64 and uint64
wire_values = st.recursive(
    st.none() | st.booleans() | int64s | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: (st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
                   | st.dictionaries(st.text().filter(lambda key: key != "__type__") | int64s,
                                     inner, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None)
@given(value=wire_values)
def test_plain_values_keep_their_types(value: Any) -> None:
    assert strictly_equal(loads(dumps(value)), value)


def test_nested_tuples_and_messages_inside_containers_round_trip() -> None:
    value = {"pair": (1, (2, "three")), "reply": UserReply(uid=4, delta="x"), 7: [None, b"\x00"]}
    assert strictly_equal(loads(dumps(value)), value)


def test_a_list_of_messages_is_one_frame_and_comes_back_as_a_list() -> None:
    assert loads(dumps(EXAMPLES)) == EXAMPLES


def test_fields_at_their_default_are_not_sent() -> None:
    wire = msgpack.unpackb(dumps(DetokenizeRequest(uid=3, next_token=9)))
    assert wire == {"__type__": "DetokenizeRequest", "uid": 3, "next_token": 9}
    wire = msgpack.unpackb(dumps(SamplingParams()))
    assert wire == {"__type__": "SamplingParams"}, "a default SamplingParams is its tag alone"


def test_a_frame_is_smaller_than_pickle() -> None:
    for message in EXAMPLES:
        assert len(dumps(message)) < len(pickle.dumps(message, pickle.HIGHEST_PROTOCOL)), message


def test_token_ids_are_packed_as_plain_msgpack_ints() -> None:
    ids = list(range(100, 10_100))
    frame = dumps(UserRequest(uid=0, input_ids=ids, sampling_params=SamplingParams()))
    # 3 bytes per id below 65536 (uint16 marker + 2 bytes), plus a few dozen of framing
    assert len(frame) < 3 * len(ids) + 100
    assert len(frame) < len(msgpack.packb(ids)) + 100


def test_an_unknown_type_tag_is_a_clear_error() -> None:
    frame = msgpack.packb({"__type__": "LaunchRocket", "uid": 1})
    with pytest.raises(SerializationError, match="unknown type tag 'LaunchRocket'.*UserRequest"):
        loads(frame)


def test_a_frame_with_missing_fields_names_the_type_and_the_fields() -> None:
    frame = msgpack.packb({"__type__": "UserRequest", "uid": 1})
    with pytest.raises(SerializationError, match=r"UserRequest from the fields \['uid'\]"):
        loads(frame)


def test_field_values_are_validated_on_the_way_in() -> None:
    frame = msgpack.packb({"__type__": "SamplingParams", "top_p": 2.0})
    with pytest.raises(SerializationError, match="top_p"):
        loads(frame)


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"not msgpack at all", dumps(EXAMPLES)[:-3]],
                         ids=["empty", "reserved-byte", "text", "truncated"])
def test_garbage_bytes_are_a_clear_error(garbage: bytes) -> None:
    with pytest.raises(SerializationError, match="not a message frame"):
        loads(garbage)


def test_unregistered_objects_cannot_be_sent() -> None:
    with pytest.raises(SerializationError, match="cannot serialize a builtins.object"):
        dumps(UserReply(uid=1, delta=object()))  # type: ignore[arg-type]
    with pytest.raises(SerializationError, match="does not fit in 64 bits"):
        dumps([2**64])


def test_a_tokenize_request_needs_exactly_one_prompt() -> None:
    with pytest.raises(ValueError, match="exactly one of text, input_ids and messages"):
        TokenizeRequest(uid=1, sampling_params=SamplingParams())
    with pytest.raises(ValueError, match="exactly one"):
        TokenizeRequest(uid=1, sampling_params=SamplingParams(), text="a", input_ids=[1])


def test_abort_travels_to_both_the_tokenizer_and_the_scheduler() -> None:
    from minisgl.message import TokenizerMessage

    assert isinstance(AbortRequest(uid=1), TokenizerMessage)
    assert isinstance(AbortRequest(uid=1), BackendMessage)


# ---------------------------------------------------------------------------------- queues
def test_queues_refuse_a_message_of_the_wrong_family() -> None:
    address = ipc_address("family")
    with ZmqPullQueue(address, BackendMessage, bind=True) as pull, \
            ZmqPushQueue(address, BackendMessage, bind=False) as push, \
            ZmqPushQueue(address, Message, bind=False) as loose:
        with pytest.raises(TypeError, match="carries BackendMessage; got a UserReply"):
            push.put(UserReply(uid=1, delta="hi"))
        loose.put(UserReply(uid=1, delta="hi"))  # a sender that does not check...
        with pytest.raises(TypeError, match="carries BackendMessage; got a UserReply"):
            pull.get(timeout_s=5)  # ...is caught by the receiver


def test_pull_times_out_and_drains() -> None:
    address = ipc_address("drain")
    with ZmqPullQueue(address, BackendMessage, bind=True) as pull, \
            ZmqPushQueue(address, BackendMessage, bind=False) as push:
        with pytest.raises(TimeoutError, match="no message"):
            pull.get(timeout_s=0.05)
        assert pull.drain() == []
        push.put_many([AbortRequest(uid=i) for i in range(3)])
        assert pull.get(timeout_s=5) == AbortRequest(uid=0)  # the rest of the frame waits
        push.put(AbortRequest(uid=3))
        deadline = time.monotonic() + 5
        got: list[BackendMessage] = []
        while len(got) < 3 and time.monotonic() < deadline:
            got += pull.drain()
        assert got == [AbortRequest(uid=i) for i in (1, 2, 3)]


def test_a_queue_cannot_be_pickled_into_a_child() -> None:
    with ZmqPullQueue(ipc_address("pickle"), BackendMessage, bind=True) as pull, \
            pytest.raises(TypeError, match="pass its address"):
        pickle.dumps(pull)


def test_ipc_addresses_are_unique_and_checked(tmp_path: Any) -> None:
    first, second = ipc_address("scheduler"), ipc_address("scheduler")
    assert first != second and first.startswith("ipc://")
    assert ipc_address("x", directory=tmp_path).startswith(f"ipc://{tmp_path}/x-")
    with pytest.raises(ValueError, match="at most"):
        ipc_address("x", directory="/" + "d" * 200)
    with pytest.raises(ValueError, match="name must be"):
        ipc_address("no/slashes")
    with pytest.raises(ValueError, match="must start with"):
        ZmqPullQueue("/tmp/sock", BackendMessage, bind=True)


def test_async_queues_work_in_an_event_loop() -> None:
    address = ipc_address("async")

    async def main() -> list[FrontendMessage]:
        with ZmqAsyncPullQueue(address, FrontendMessage, bind=True) as pull, \
                ZmqAsyncPushQueue(address, FrontendMessage, bind=False) as push:
            with pytest.raises(TimeoutError, match="no message"):
                await pull.get(timeout_s=0.05)

            async def produce() -> None:
                for i in range(10):
                    await push.put(UserReply(uid=i, delta=str(i)))

            producer = asyncio.create_task(produce())
            received = [await pull.get(timeout_s=5) for _ in range(10)]
            await producer
            return received

    assert asyncio.run(main()) == [UserReply(uid=i, delta=str(i)) for i in range(10)]


def test_a_sync_sender_feeds_an_async_receiver() -> None:
    address = ipc_address("mixed")

    async def main() -> list[UserReply]:
        with ZmqAsyncPullQueue(address, FrontendMessage, bind=True) as pull, \
                ZmqPushQueue(address, FrontendMessage, bind=False) as push:
            push.put(UserReply(uid=7, delta="ok", finish_reason="stop"))
            push.put_many([UserReply(uid=8), UserReply(uid=9)])  # one frame, handed out one by one
            return [await pull.get(timeout_s=5) for _ in range(3)]

    assert asyncio.run(main()) == [UserReply(uid=7, delta="ok", finish_reason="stop"),
                                   UserReply(uid=8), UserReply(uid=9)]


# ---------------------------------------------------------------------------------- processes
# Targets of spawned children must be importable by name: module-level functions.
MARKER = "as imported"


def _echo_worker(inbox: str, outbox: str, count: int) -> None:
    """Answer each UserRequest with its token ids reversed, as text."""
    with ZmqPullQueue(inbox, BackendMessage, bind=True) as pull, \
            ZmqPushQueue(outbox, FrontendMessage, bind=False) as push:
        for _ in range(count):
            request = pull.get(timeout_s=30)
            assert isinstance(request, UserRequest)
            push.put(UserReply(uid=request.uid, delta=" ".join(map(str, request.input_ids[::-1]))))
        push.close(linger_s=5)  # flush the last replies before the process exits


def _report_marker(outbox: str) -> None:
    with ZmqPushQueue(outbox, FrontendMessage, bind=False) as push:
        push.put(UserReply(uid=os.getpid(), delta=MARKER))
        push.close(linger_s=5)


def _put_close_with_linger_and_return(outbox: str, done_file: str) -> None:
    """Put one frame for a receiver that does not exist yet, close with a linger, return."""
    push = ZmqPushQueue(outbox, FrontendMessage, bind=False)
    push.put(UserReply(uid=7, delta="sent before the receiver existed"))
    push.close(linger_s=20)
    with open(done_file, "w"):
        pass


def _exit_with(code: int) -> None:
    sys.exit(code)


def _sleep_forever() -> None:
    while True:
        time.sleep(1)


def test_push_pull_across_a_spawned_process_keeps_every_message_in_order() -> None:
    inbox, outbox = ipc_address("echo-in"), ipc_address("echo-out")
    requests = [UserRequest(uid=i, input_ids=[i, i + 1, i + 2], sampling_params=SamplingParams())
                for i in range(60)]
    with ZmqPullQueue(outbox, FrontendMessage, bind=True) as replies, \
            ZmqPushQueue(inbox, BackendMessage, bind=False) as send:
        worker = start_process(_echo_worker, "ch13-echo", args=(inbox, outbox, len(requests)))
        try:
            for request in requests[:20]:  # one by one, then in frames of ten
                send.put(request)
            for start in range(20, len(requests), 10):
                send.put_many(requests[start:start + 10])
            received = [replies.get(timeout_s=30) for _ in requests]
        finally:
            exit_code = stop_process(worker, timeout_s=10)
    assert [reply.uid for reply in received] == list(range(len(requests)))
    assert received[5] == UserReply(uid=5, delta="7 6 5")
    assert exit_code == 0


def test_a_sender_that_closes_with_a_linger_delivers_after_returning(tmp_path: Any) -> None:
    """The child's code is over before the receiver binds: only its exit, waiting out the
    linger, can still deliver the frame."""
    outbox, done = ipc_address("linger"), tmp_path / "closed"
    worker = start_process(_put_close_with_linger_and_return, "ch13-linger",
                           args=(outbox, str(done)))
    try:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done.exists(), "the child never closed its queue"
        time.sleep(2)  # ample time for a child that does not wait to be gone
        assert worker.is_alive(), "the child exited with its frame undelivered"
        with ZmqPullQueue(outbox, FrontendMessage, bind=True) as replies:
            reply = replies.get(timeout_s=15)
    finally:
        exit_code = stop_process(worker, timeout_s=25)
    assert reply == UserReply(uid=7, delta="sent before the receiver existed")
    assert exit_code == 0


def test_workers_are_spawned_not_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    # A forked child would inherit the parent's memory, this change included; a spawned child
    # imports the module afresh and sees the value the source gives.
    monkeypatch.setattr(sys.modules[__name__], "MARKER", "changed after import")
    outbox = ipc_address("marker")
    with ZmqPullQueue(outbox, FrontendMessage, bind=True) as replies:
        worker = start_process(_report_marker, "ch13-marker", args=(outbox,))
        try:
            reply = replies.get(timeout_s=30)
        finally:
            stop_process(worker, timeout_s=10)
    assert type(worker).__name__ == "SpawnProcess"
    assert reply.uid == worker.pid and reply.uid != os.getpid()
    assert reply.delta == "as imported", "the child saw the parent's memory: it was forked"


def test_a_child_that_exits_is_reaped() -> None:
    worker = start_process(_exit_with, "ch13-exit", args=(3,))
    assert stop_process(worker, timeout_s=30) == 3
    with pytest.raises(ChildProcessError):  # nothing left to wait for: no zombie
        os.waitpid(worker.pid, os.WNOHANG)
    assert not psutil.pid_exists(worker.pid) or \
        psutil.Process(worker.pid).status() != psutil.STATUS_ZOMBIE


def test_a_child_that_hangs_is_terminated_and_reaped() -> None:
    worker = start_process(_sleep_forever, "ch13-hang")
    assert stop_process(worker, timeout_s=0.5) == -15  # SIGTERM
    assert not worker.is_alive()
    with pytest.raises(ChildProcessError):
        os.waitpid(worker.pid, os.WNOHANG)
