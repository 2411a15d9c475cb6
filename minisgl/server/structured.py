"""``response_format``: OpenAI's structured output, as a grammar the engine decodes under.

``{"type": "text"}`` (or nothing) asks for nothing; ``{"type": "json_object"}`` for a JSON
object; ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``
for JSON that validates against the schema. The grammar travels in
:attr:`~minisgl.core.SamplingParams.grammar`; a schema that cannot be compiled is HTTP 400
naming ``response_format`` and the problem. Chapter 22 tells the story.
"""

from __future__ import annotations

from typing import Any

from minisgl.grammar.compile import GrammarError, json_object_grammar, json_schema_grammar
from minisgl.server.protocol import APIError

FIELD = "response_format"


def response_format_grammar(response_format: Any) -> str | None:
    """The grammar ``response_format`` asks for; None for plain text.

    Raises:
        APIError: 400 naming ``response_format``: an unknown type, a missing or bad schema.
    """
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind != "json_schema":
        raise _refused(f'type must be "text", "json_object" or "json_schema", got '
                       f"{kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise _refused('json_schema must be an object with a "schema" (and a "name")')
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _refused(f"json_schema.strict must be a boolean, got {strict!r}")
    try:
        return json_schema_grammar(spec["schema"], strict=bool(strict))
    except GrammarError as exc:
        raise _refused(f"json_schema.schema cannot be used: {exc}") from None


def _refused(problem: str) -> APIError:
    return APIError(400, f"{FIELD}: {problem}", FIELD)
