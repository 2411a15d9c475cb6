"""One serializer for every message: dataclasses to msgpack bytes and back.

A registered dataclass travels as a map ``{"__type__": "ClassName", field: value, ...}``; the
receiver looks the tag up and calls the class with the fields. Fields at their default are left
out (the constructor fills them back in), so a per-token message stays a few dozen bytes. A
tuple travels tagged (msgpack would bring it back as a list); everything else is msgpack's own
type, so a list of token ids is packed by msgpack's C code without entering Python. The key
``"__type__"`` is reserved: a plain dict inside a message must not use it. Chapter 13 tells the
story.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import msgpack

from minisgl.core import SamplingParams, TokenLogprobs

TYPE_KEY = "__type__"  # the reserved map key that holds a type tag
TUPLE_TAG = "tuple"  # the tag of a tuple; no class may be registered under this name

C = TypeVar("C", bound=type)


class SerializationError(ValueError):
    """A value cannot be turned into a frame, or a frame cannot be turned back into messages."""


# The registry: tag -> class. It only grows at import time (a class statement or a module's
# register_wire_type call), so every process that imports ``minisgl.message`` holds the same map.
_WIRE_TYPES: dict[str, type] = {}


def register_wire_type(cls: C) -> C:
    """Let instances of the dataclass ``cls`` travel in messages, tagged with its class name.

    Returns ``cls``, so it also works as a class decorator. Registering a class again (or a new
    version of it, from the same module) replaces it; two classes of one name from different
    places are an error, since the name is the tag.
    """
    name = cls.__name__
    if name == TUPLE_TAG:
        raise ValueError(f"the tag {TUPLE_TAG!r} is reserved for tuples; rename the class")
    known = _WIRE_TYPES.get(name, cls)
    # The same class statement run again (a notebook) replaces the class it made before.
    if (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"two wire types are named {name!r}: {known.__module__}.{name} and "
                         f"{cls.__module__}.{name}; the tag must name exactly one class")
    _WIRE_TYPES[name] = cls
    return cls


def registered_types() -> Mapping[str, type]:
    """Every registered tag and its class (a read-only view)."""
    return MappingProxyType(_WIRE_TYPES)


@functools.cache  # once per class
def _wire_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """The (name, default) pairs of ``cls``'s fields, in order; ``MISSING`` where none."""
    if not dataclasses.is_dataclass(cls):
        raise SerializationError(f"{cls.__module__}.{cls.__qualname__} is registered as a "
                                 f"wire type but is not a dataclass")
    # A default_factory default is a fresh object each time: always send the field. A derived
    # (init=False) field is computed again by the receiver's constructor.
    return tuple((f.name, f.default) for f in dataclasses.fields(cls) if f.init)


def to_wire(obj: Any) -> dict[str, Any]:
    """msgpack's ``default`` hook: a tagged map for a value msgpack cannot pack by itself.

    msgpack calls it for tuples and for any object that is not one of its own types; msgpack
    then packs the returned map, calling this again for whatever the map holds.
    """
    if type(obj) is tuple:
        return {TYPE_KEY: TUPLE_TAG, "items": list(obj)}
    cls = type(obj)
    if cls is int:  # msgpack hands over the ints it cannot pack
        raise SerializationError(f"the integer {obj} does not fit in 64 bits")
    if _WIRE_TYPES.get(cls.__name__) is not cls:
        raise SerializationError(
            f"cannot serialize a {cls.__module__}.{cls.__qualname__}: messages may hold None, "
            f"bool, int, float, str, bytes, list, tuple, dict and registered dataclasses "
            f"(subclass Message, or call register_wire_type)")
    wire: dict[str, Any] = {TYPE_KEY: cls.__name__}
    for name, default in _wire_fields(cls):
        value = getattr(obj, name)
        # Same type as well as equal: False == 0, but a bool must not come back as an int.
        if default is not dataclasses.MISSING and type(value) is type(default) and value == default:
            continue  # the receiver's constructor puts the default back
        wire[name] = value
    return wire


def from_wire(wire: dict[Any, Any]) -> Any:
    """msgpack's ``object_hook``: rebuild the value a tagged map stands for.

    msgpack calls it for every map it decodes, innermost first, so the fields of ``wire`` are
    already rebuilt values. A map without a tag is an ordinary dict and is returned unchanged.
    """
    tag = wire.get(TYPE_KEY)
    if tag is None:
        return wire
    if tag == TUPLE_TAG:
        return tuple(wire["items"])
    cls = _WIRE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise SerializationError(f"unknown type tag {tag!r}: known tags are "
                                 f"{sorted(_WIRE_TYPES) + [TUPLE_TAG]}")
    fields = {key: value for key, value in wire.items() if key != TYPE_KEY}
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:  # a missing or unexpected field, a bad value
        raise SerializationError(f"cannot rebuild a {tag} from the fields {sorted(fields)}: "
                                 f"{exc}") from exc


def dumps(obj: Any) -> bytes:
    """``obj`` (a message, or a list of messages, or any wire value) as one msgpack frame."""
    try:
        return msgpack.packb(obj, default=to_wire, strict_types=True, use_bin_type=True)
    except SerializationError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. nesting deeper than msgpack allows
        raise SerializationError(f"cannot serialize {type(obj).__name__}: {exc}") from exc


def loads(frame: bytes) -> Any:
    """The value a frame made by :func:`dumps` holds.

    Raises :class:`SerializationError` for bytes that are not such a frame (truncated, garbage,
    trailing data) and for a tag that names no registered class.
    """
    try:
        return msgpack.unpackb(frame, object_hook=from_wire, raw=False,
                               strict_map_key=False)  # int keys are fine in our dicts
    except SerializationError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types for bad input; report one
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise SerializationError(f"not a message frame ({len(frame)} bytes, starting "
                                 f"{bytes(frame[:16])!r}): {reason}") from exc


class Message:
    """The base of every message exchanged between the processes.

    A message is a frozen dataclass that subclasses one *family*: the base class of everything
    one kind of process receives (``TokenizerMessage``, ``DetokenizerMessage``,
    ``BackendMessage``, ``FrontendMessage``). A queue is typed with a family, so a message sent
    to the wrong process is caught at once. A message that a worker forwards unchanged
    subclasses both families.

    Subclasses register themselves under their class name; a family base says
    ``class BackendMessage(Message, family=True)`` and is not registered (it is never sent).
    """

    def __init_subclass__(cls, family: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not family:
            register_wire_type(cls)

    # The codec comes with the family: a queue (``minisgl.utils.queues``, in a lower package
    # that knows nothing of messages) writes and reads its frames with the class it is typed
    # with.
    dumps = staticmethod(dumps)
    loads = staticmethod(loads)


register_wire_type(SamplingParams)
register_wire_type(TokenLogprobs)  # chapter 21
