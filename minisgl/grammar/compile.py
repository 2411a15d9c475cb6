"""Schemas to grammars: what ``response_format`` and ``tools`` ask for, as llguidance grammars.

Why llguidance (https://github.com/guidance-ai/llguidance) rather than XGrammar, the library
upstream's open pull request uses: both give the same thing, a bitmask of the tokens a grammar
allows next, from JSON Schema or a context-free grammar, and both are used by vLLM and SGLang.
llguidance's wheel is one compiled extension that needs no torch (its torch helpers are
optional), where XGrammar's package depends on torch, transformers and, on x86 Linux, triton.
llguidance compiles nothing ahead: an Earley parser and a lazy lexer walk a trie of the
vocabulary at each step, about 50 microseconds of one CPU core per mask for a 128k vocabulary by
its authors' measurements (https://pypi.org/project/llguidance/), with negligible start-up,
where XGrammar compiles each grammar against the vocabulary first (and caches it). llguidance
reads JSON Schema and Lark, with JSON Schema inline (the tool calls below use that), and names
the keywords it does not support instead of ignoring them.

A grammar here is llguidance's serialized form (a string). It travels in
:class:`~minisgl.core.SamplingParams` to the scheduler's process, which builds a matcher from it
(:mod:`~minisgl.grammar.states`). Compiling is cached by the schema's canonical JSON, so a
client that sends the same schema with every request pays for it once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance

# How generated JSON is spaced: one space after ":" and ",", as Python's json.dumps and
# Qwen3's chat template write it, and no other whitespace. Flexible whitespace would let a
# small model pad its output with newlines up to max_tokens instead of closing the object.
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
CACHE_SIZE = 256  # distinct schemas kept compiled
MAX_EXACT_INT = 2**53 - 1  # the largest integer a JSON number (a double) holds exactly
NUMBER_STEP = 1e-6  # the finest decimal a number without multipleOf is written to
# JSON Schema's keywords that hold schemas: by name, in a list, or one.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled; the message names the problem."""


def json_schema_grammar(schema: Any, strict: bool = False) -> str:
    """The grammar of JSON documents that validate against ``schema``.

    An object schema that does not say whether it takes other properties takes none here
    (:func:`bounded_schema`): JSON Schema's default, any other property with any value, would
    invite a model to invent keys and write on without end. XGrammar, which vLLM and SGLang
    use, closes objects by default in the same way (its ``strict_mode``). ``strict`` is OpenAI's
    structured-outputs switch: there, a strict schema's every property is required, so here
    a strict schema's output has every property it lists.

    Raises:
        GrammarError: ``schema`` is not a JSON Schema llguidance can compile, naming why.
    """
    if not isinstance(schema, (Mapping, bool)):
        raise GrammarError(f"a JSON Schema must be an object or a boolean, "
                           f"not {type(schema).__name__}")
    # The key keeps the properties' order: it is the order they are written in.
    return _compiled_schema(json.dumps(schema, separators=(",", ":")), strict)


# json_object's bounds. "Any JSON object" is a language in which a model can write forever: a
# string it never closes, members or nesting without end (the book's tiny model does exactly
# that). These bounds make every sentence of the grammar end within a known length, and are far
# above what an answer needs; a schema (json_schema) states its own.
MAX_STRING_CHARS = 64
MAX_MEMBERS = 8  # per object or array
MAX_DEPTH = 3  # objects and arrays nested in the outermost object


@functools.lru_cache(maxsize=1)
def json_object_grammar() -> str:
    """The grammar of a JSON object (``response_format: {"type": "json_object"}``), within the
    bounds above, spaced as :data:`JSON_OPTIONS` says, in Lark."""
    more = f"~0..{MAX_MEMBERS - 1}"
    rules = ["start: obj0",
             r'STR: /"([^"\\\x00-\x1f]|\\["\\\/bfnrt]){0,%d}"/' % MAX_STRING_CHARS,
             r"NUM: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,3})?/"]
    for depth in range(MAX_DEPTH + 1):
        inner = [f"obj{depth + 1}", f"arr{depth + 1}"] if depth < MAX_DEPTH else []
        rules += [
            f'obj{depth}: "{{" (STR ": " val{depth} (", " STR ": " val{depth}){more})? "}}"',
            f'arr{depth}: "[" (val{depth} (", " val{depth}){more})? "]"',
            f"val{depth}: " + " | ".join([*inner, "STR", "NUM", '"true"', '"false"', '"null"']),
        ]
    return _checked(llguidance.LLMatcher.grammar_from_lark("\n".join(rules)))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compiled_schema(canonical: str, strict: bool) -> str:
    schema = bounded_schema(json.loads(canonical), require_all=strict)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    return _checked(grammar)


def bounded_schema(schema: Any, require_all: bool = False) -> Any:
    """``schema`` narrowed so that every output ends, wherever a subschema does not say:

    - an object (one with ``properties``, or ``type: "object"``) takes no other property
      (``additionalProperties: false``);
    - a number lies in JSON's exact-integer range, +-(2**53 - 1), and has at most six
      decimals (``multipleOf: 1e-6``): otherwise its digits never have to end, and a small
      model writes ``2101010101...`` up to max_tokens.

    Every output still validates against the original schema. With ``require_all``, every
    listed property is also required (OpenAI's strict mode).
    """
    if not isinstance(schema, dict):
        return schema
    bounded = dict(schema)
    for key, value in schema.items():  # the keywords whose values are schemas, and no other
        if key in SCHEMA_MAPS and isinstance(value, dict):
            bounded[key] = {name: bounded_schema(sub, require_all) for name, sub in value.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list):
            bounded[key] = [bounded_schema(sub, require_all) for sub in value]
        elif key in SCHEMA_VALUES:
            bounded[key] = bounded_schema(value, require_all)
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if ("properties" in schema or "object" in types) and "additionalProperties" not in schema:
        bounded["additionalProperties"] = False
    if require_all and isinstance(schema.get("properties"), dict):
        bounded["required"] = list(schema["properties"])
    if "integer" in types or "number" in types:
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            bounded["minimum"] = -MAX_EXACT_INT
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            bounded["maximum"] = MAX_EXACT_INT
        if "number" in types and "multipleOf" not in schema:
            bounded["multipleOf"] = NUMBER_STEP
    return bounded


def tool_call_grammar(functions: Sequence[tuple[str, Any]], parallel: bool = True) -> str:
    """The grammar of one or more tool calls in Qwen3's format::

        <tool_call>
        {"name": "NAME", "arguments": {...}}
        </tool_call>

    where NAME is one of ``functions`` (``(name, parameters schema)`` pairs) and the arguments
    validate against that function's parameters (absent or empty: an object without
    properties; objects closed as in :func:`json_schema_grammar`). ``parallel``: several
    calls, one after another. The tags are tokens of Qwen3's vocabulary (and of the book's
    tiny models): a model without them cannot start the grammar (the scheduler says so).
    """
    if not functions:
        raise GrammarError("no function to call")
    return _compiled_tools(json.dumps([list(f) for f in functions], separators=(",", ":")),
                           parallel)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compiled_tools(canonical: str, parallel: bool) -> str:
    calls = [{"type": "object",
              "properties": {"name": {"const": name},
                             "arguments": bounded_schema(params or {"type": "object"})},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, params in json.loads(canonical)]
    call_schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
    call_schema["x-guidance"] = JSON_OPTIONS
    lark = "\n".join([
        'start: call ("\\n" call)*' if parallel else "start: call",
        # the tags are tokens of Qwen3's vocabulary: named as tokens, not spelled as text
        'call: <tool_call> "\\n" body "\\n" </tool_call>',
        f"body: %json {json.dumps(call_schema)}",
    ])
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark))


def _checked(grammar: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)
    return grammar
