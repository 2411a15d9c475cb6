"""The two msgpack hooks that carry every message across a process boundary (solution)."""

from __future__ import annotations

import dataclasses
from typing import Any

from minisgl.message.utils import TUPLE_TAG, TYPE_KEY, SerializationError, registered_types

SET_TYPES = (set, frozenset)
SET_TAGS = {"set": set, "frozenset": frozenset}


def to_wire(obj: Any) -> dict[str, Any]:
    """msgpack's ``default`` hook: the tagged map that stands for ``obj``.

    msgpack calls it for every tuple and every object it cannot pack by itself.
    """
    if type(obj) is tuple:
        return {TYPE_KEY: TUPLE_TAG, "items": list(obj)}
    if type(obj) in SET_TYPES:
        return {TYPE_KEY: type(obj).__name__, "items": sorted(obj)}  # equal sets, equal bytes
    cls = type(obj)
    if registered_types().get(cls.__name__) is not cls:
        raise SerializationError(f"cannot serialize a {cls.__qualname__}: it is not a "
                                 f"registered wire type")
    wire: dict[str, Any] = {TYPE_KEY: cls.__name__}
    for field in dataclasses.fields(cls):
        value = getattr(obj, field.name)
        default = field.default
        # A field whose value is its plain default stays home; the receiver's constructor puts
        # it back. Same type too: False == 0, but a bool must not come back as an int.
        if (default is not dataclasses.MISSING and type(value) is type(default)
                and value == default):
            continue
        wire[field.name] = value  # msgpack packs it, calling to_wire again if it must
    return wire


def from_wire(wire: dict[Any, Any]) -> Any:
    """msgpack's ``object_hook``: the value a decoded map stands for.

    msgpack calls it for every map it decodes, innermost first.
    """
    tag = wire.get(TYPE_KEY)
    if tag is None:
        return wire  # an ordinary dict
    if tag == TUPLE_TAG:
        return tuple(wire["items"])
    if tag in SET_TAGS:
        return SET_TAGS[tag](wire["items"])
    cls = registered_types().get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise SerializationError(f"unknown type tag {tag!r}")
    # A newer sender may know fields this class does not have: they are dropped.
    known = {field.name for field in dataclasses.fields(cls)}
    fields = {key: value for key, value in wire.items() if key != TYPE_KEY and key in known}
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        raise SerializationError(f"cannot rebuild a {tag} from {sorted(fields)}: {exc}") from exc
