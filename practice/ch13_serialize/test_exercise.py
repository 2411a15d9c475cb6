"""Tests for the serialization exercise: they are its specification."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from serialize import from_wire, to_wire

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortRequest,
    DetokenizeRequest,
    Message,
    SerializationError,
    TokenizeRequest,
    TokenUsage,
    UserReply,
    UserRequest,
    dumps,
    loads,
    register_wire_type,
    registered_types,
)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=to_wire, strict_types=True, use_bin_type=True)


def unpack(frame: bytes) -> Any:
    return msgpack.unpackb(frame, object_hook=from_wire, raw=False, strict_map_key=False)


@register_wire_type
@dataclass(frozen=True)
class Probe:
    """A registered dataclass with every kind of default, for the rules on defaults."""

    count: int = 0
    label: str = "x"
    tags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Unregistered:
    uid: int


EXAMPLES: list[Message] = [
    TokenizeRequest(uid=0, sampling_params=SamplingParams(), text="Hello"),
    TokenizeRequest(uid=1, sampling_params=SamplingParams(temperature=0.5, seed=2**64 - 1),
                    input_ids=[5, 6]),
    TokenizeRequest(uid=2, sampling_params=SamplingParams(max_tokens=3),
                    messages=[{"role": "user", "content": "你好 👋"}]),
    AbortRequest(uid=2),
    UserRequest(uid=1, input_ids=list(range(300)),
                sampling_params=SamplingParams(stop_token_ids=(7, 8), ignore_eos=True)),
    DetokenizeRequest(uid=1, next_token=42),
    DetokenizeRequest(uid=1, next_token=2, finish_reason="stop", usage=TokenUsage(3, 7)),
    UserReply(uid=1, delta="wor"),
    UserReply(uid=1, delta="", finish_reason="length", usage=TokenUsage(3, 16)),
]


def test_the_examples_cover_every_message_type() -> None:
    covered = {type(message) for message in EXAMPLES}
    missing = [name for name, cls in registered_types().items()
               if issubclass(cls, Message) and cls not in covered]
    assert not missing, f"the test lacks examples of {missing}"


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: Message) -> None:
    back = unpack(pack(message))
    assert type(back) is type(message), f"came back as a {type(back).__name__}"
    assert back == message


def test_a_message_becomes_its_tag_and_its_fields() -> None:
    assert to_wire(AbortRequest(uid=3)) == {"__type__": "AbortRequest", "uid": 3}
    wire = to_wire(TokenUsage(2, 5))
    assert wire == {"__type__": "TokenUsage", "prompt_tokens": 2, "completion_tokens": 5}
    assert list(wire) == ["__type__", "prompt_tokens", "completion_tokens"], \
        "the tag first, then the fields in declaration order"


def test_nested_values_are_left_for_msgpack() -> None:
    params = SamplingParams(top_k=5)
    wire = to_wire(UserRequest(uid=1, input_ids=[1, 2], sampling_params=params))
    assert wire["sampling_params"] is params, "leave field values as they are: msgpack packs " \
        "them and calls to_wire again for a nested dataclass"
    assert wire["input_ids"] == [1, 2]


def test_fields_at_their_default_are_left_out() -> None:
    assert to_wire(DetokenizeRequest(uid=3, next_token=9)) == \
        {"__type__": "DetokenizeRequest", "uid": 3, "next_token": 9}
    assert to_wire(SamplingParams()) == {"__type__": "SamplingParams"}
    assert to_wire(SamplingParams(top_p=0.5)) == {"__type__": "SamplingParams", "top_p": 0.5}


def test_a_value_of_another_type_than_its_default_travels() -> None:
    probe = Probe(count=False)  # type: ignore[arg-type]  # False == 0, but it is a bool
    assert to_wire(probe) == {"__type__": "Probe", "count": False, "tags": []}, \
        "False equals the default 0 but is a bool: it must travel; a default_factory field " \
        "always travels"
    back = unpack(pack(probe))
    assert back.count is False


def test_tuples_come_back_as_tuples() -> None:
    assert to_wire((1, 2)) == {"__type__": "tuple", "items": [1, 2]}
    value = (1, (2, "three"), [4, (5,)])
    back = unpack(pack(value))
    assert back == value and type(back) is tuple and type(back[1]) is tuple \
        and type(back[2]) is list and type(back[2][1]) is tuple


def test_plain_dicts_pass_through() -> None:
    plain = {"role": "user", "content": "hi"}
    assert from_wire(plain) is plain
    value = {"a": [1, None, b"\x00"], 7: {"nested": True}}
    assert unpack(pack(value)) == value


def test_frames_are_interchangeable_with_the_engine() -> None:
    for message in EXAMPLES:
        assert loads(pack(message)) == message, f"the engine cannot read your {message}"
        assert unpack(dumps(message)) == message, f"you cannot read the engine's {message}"


def test_an_unregistered_type_cannot_be_sent() -> None:
    with pytest.raises(SerializationError, match="object"):
        pack(object())
    with pytest.raises(SerializationError, match="Unregistered"):
        pack(Unregistered(uid=1))


def test_an_unknown_tag_is_an_error_naming_it() -> None:
    with pytest.raises(SerializationError, match="LaunchRocket"):
        from_wire({"__type__": "LaunchRocket", "uid": 1})
    with pytest.raises(SerializationError, match="LaunchRocket"):
        unpack(msgpack.packb([{"__type__": "LaunchRocket"}]))


def test_fields_the_class_does_not_accept_are_an_error() -> None:
    with pytest.raises(SerializationError, match="UserRequest"):
        from_wire({"__type__": "UserRequest", "uid": 1})  # missing fields
    with pytest.raises(SerializationError, match="SamplingParams"):
        from_wire({"__type__": "SamplingParams", "top_p": 2.0})  # rejected by validation


def test_fields_of_a_newer_sender_are_dropped() -> None:
    got = from_wire({"__type__": "AbortRequest", "uid": 1, "reason": "bored"})
    assert got == AbortRequest(uid=1), "a field the class does not declare is dropped"
    newer = {"__type__": "DetokenizeRequest", "uid": 4, "next_token": 9, "priority": 3}
    assert unpack(msgpack.packb(newer)) == DetokenizeRequest(uid=4, next_token=9)
    with pytest.raises(SerializationError, match="DetokenizeRequest"):
        from_wire({"__type__": "DetokenizeRequest", "uid": 4, "priority": 3})  # still missing


def test_sets_come_back_as_the_same_kind_of_set() -> None:
    for value in ({3, 1, 2}, frozenset({"b", "a"}), set(), [frozenset({1}), {2}]):
        back = unpack(pack(value))
        assert back == value and type(back) is type(value), f"{value!r} came back as {back!r}"
    inner = unpack(pack(Probe(tags=[frozenset({5, 4})])))
    assert inner.tags == [frozenset({4, 5})] and type(inner.tags[0]) is frozenset


def test_a_set_travels_as_its_sorted_items() -> None:
    assert to_wire({3, 1, 2}) == {"__type__": "set", "items": [1, 2, 3]}
    assert to_wire(frozenset({"b", "a"})) == {"__type__": "frozenset", "items": ["a", "b"]}
    assert pack({10, 2, 7}) == pack({7, 10, 2}), "equal sets give the same bytes"
