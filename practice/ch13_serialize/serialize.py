"""The two msgpack hooks that carry every message across a process boundary.

Write the two functions. See README.md for the wire format and the rules;
`python practice/judge.py ch13_serialize` checks your work.
"""

from __future__ import annotations

import dataclasses  # noqa: F401  (everything imported here is what the solution uses)
from typing import Any

from minisgl.message.utils import (  # noqa: F401
    TUPLE_TAG,
    TYPE_KEY,
    SerializationError,
    registered_types,
)


def to_wire(obj: Any) -> dict[str, Any]:
    """msgpack's ``default`` hook: the tagged map that stands for ``obj``.

    msgpack calls it for every tuple and every object it cannot pack by itself.
    """
    raise NotImplementedError("to_wire: a tuple becomes {TYPE_KEY: TUPLE_TAG, 'items': [...]}; "
                              "a registered dataclass a map of its tag and its non-default fields")


def from_wire(wire: dict[Any, Any]) -> Any:
    """msgpack's ``object_hook``: the value a decoded map stands for.

    msgpack calls it for every map it decodes, innermost first.
    """
    raise NotImplementedError("from_wire: untagged maps are plain dicts; look the tag up in "
                              "registered_types() and call the class with the fields")
