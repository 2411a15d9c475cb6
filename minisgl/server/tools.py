"""``tools`` and ``tool_choice``: function calling in Qwen3's format, parsed into OpenAI's.

The chat template shows the model the functions (``tools``); the model calls one by writing::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice``: ``"none"`` (text only), ``"auto"`` (the model chooses; calls it wrote are
parsed), ``"required"`` (at least one call) or ``{"type": "function", "function": {"name": N}}``
(a call of N). The last two are enforced by a grammar (:func:`~minisgl.grammar.compile.
tool_call_grammar`): the output is nothing but calls whose arguments validate against the
function's ``parameters``. ``parallel_tool_calls: false`` allows one call. The calls come back
as ``message.tool_calls`` with ids, ``finish_reason: "tool_calls"``, or streamed as
``delta.tool_calls`` (id, type and name first, then the arguments). Chapter 22 tells the story.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from minisgl.grammar.compile import GrammarError, bounded_schema, tool_call_grammar
from minisgl.message import TokenUsage, UserReply
from minisgl.server.protocol import APIError
from minisgl.server.responses import (SSE_DONE, ResponseMeta, chunk, sse_event, total_usage,
                                      usage_dict)

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN = "<tool_call>"


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any] | None
    strict: bool = False


@dataclass(frozen=True)
class ToolChoice:
    """A request's functions and what it asks of them.

    Attributes:
        functions: the functions of ``tools``, in order.
        choice: ``"none"``, ``"auto"``, ``"required"``, or the name of the one to call.
        parallel: whether several calls may come in one turn.
    """

    functions: tuple[Function, ...]
    choice: str
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for calls (every choice but ``"none"``)."""
        return self.choice != "none"

    def grammar(self) -> str | None:
        """The grammar that enforces ``required`` or a named function; None otherwise."""
        if self.choice in ("none", "auto"):
            return None
        chosen = [f for f in self.functions if self.choice in ("required", f.name)]
        # strict, as in response_format: every listed argument is given
        pairs = [(f.name, bounded_schema(f.parameters, require_all=True) if f.strict
                  else f.parameters) for f in chosen]
        try:
            return tool_call_grammar(pairs, parallel=self.parallel)
        except GrammarError as exc:
            raise APIError(400, f"tools: a function's parameters cannot be used: {exc}",
                           "tools") from None

    def template_tools(self) -> list[dict[str, Any]]:
        """``tools`` as the chat template renders them (OpenAI's form)."""
        return [{"type": "function", "function": {
            "name": f.name, **({"parameters": f.parameters} if f.parameters else {})}}
            for f in self.functions]


def parse_tool_choice(tools: list[Any] | None, tool_choice: Any,
                      parallel_tool_calls: bool | None) -> ToolChoice | None:
    """The request's :class:`ToolChoice`; None when it gives no tools (and asks for none).

    Raises:
        APIError: 400 naming ``tools`` or ``tool_choice``.
    """
    functions = tuple(_function(i, tool) for i, tool in enumerate(tools or []))
    choice = _choice(tool_choice, {f.name for f in functions})
    if not functions:
        if choice in ("none", "auto"):
            return None
        raise APIError(400, f"tool_choice {json.dumps(tool_choice)} needs tools", "tool_choice")
    return ToolChoice(functions, choice, parallel_tool_calls is not False)


def _function(index: int, tool: Any) -> Function:
    where = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise APIError(400, f'{where}: must be {{"type": "function", "function": {{...}}}}',
                       "tools")
    spec = tool["function"]
    name, parameters = spec.get("name"), spec.get("parameters")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise APIError(400, f"{where}.function.name must be 1 to 64 letters, digits, _ . or -, "
                            f"got {json.dumps(name)}", "tools")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(400, f"{where}.function.parameters must be a JSON Schema object", "tools")
    return Function(name, parameters, spec.get("strict") is True)


def _choice(tool_choice: Any, names: set[str]) -> str:
    if tool_choice is None:
        return "auto" if names else "none"
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
        and isinstance(tool_choice.get("function"), dict)
    name = tool_choice["function"].get("name") if named else None
    if not isinstance(name, str):
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": '
                            '"function", "function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools",
                       "tool_choice")
    return name


# =========================================================================== the output
def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The text outside any well-formed call (None when nothing is left) and the calls, as
    OpenAI's ``tool_calls``. A block that is not a call's JSON stays in the text."""
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        call = _call(match.group(1))
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    rest = CALL.sub(take, text).strip()
    return rest or None, calls


def _call(body: str) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": arguments if isinstance(
                arguments, str) else json.dumps(arguments, ensure_ascii=False)}}


def attach_tool_calls(body: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion with each choice's calls moved into ``message.tool_calls``."""
    for choice in body["choices"]:
        content, calls = split_tool_calls(choice["message"]["content"])
        if calls:
            choice["message"].update(content=content, tool_calls=calls)
            choice["finish_reason"] = "tool_calls"
    return body


def streamable(text: str) -> int:
    """How much of ``text`` can go out as content: all of it up to a call's opening tag, or
    up to an ending that may yet become one."""
    start = text.find(OPEN)
    if start >= 0:
        return start
    for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


async def stream_tool_calls(replies: AsyncIterator[tuple[int, UserReply]], meta: ResponseMeta,
                            num_choices: int, include_usage: bool, n: int = 1
                            ) -> AsyncIterator[bytes]:
    """A chat completion as SSE, its text as ``delta.content`` until a call may begin, and
    each call as ``delta.tool_calls`` chunks once the turn has ended (a call's arguments are
    only known to be a call when its closing tag comes)."""
    kind, extra = "chat.completion.chunk", ({"usage": None} if include_usage else {})
    texts, sent = [""] * num_choices, [0] * num_choices
    usages: dict[int, TokenUsage | None] = {}

    def delta(index: int, finish_reason: str | None = None, **fields: Any) -> bytes:
        return chunk(meta, kind, extra, index, finish_reason, delta=fields)

    async with aclosing(replies):
        yield chunk(meta, kind, extra, delta={"role": "assistant", "content": ""})
        async for index, reply in replies:
            if reply.error is not None:
                yield sse_event(APIError.of(reply.error, "messages").body())
                break
            texts[index] += reply.delta
            safe = streamable(texts[index]) if not reply.finished else len(texts[index])
            content, calls = split_tool_calls(texts[index]) if reply.finished else (None, [])
            if calls:  # what is left outside the calls, after what went out already
                rest = CALL.sub("", texts[index])[sent[index]:].strip()
                if rest:
                    yield delta(index, content=rest)
            elif safe > sent[index]:
                yield delta(index, content=texts[index][sent[index]:safe])
                sent[index] = safe
            for k, call in enumerate(calls):
                head = {**call, "function": {"name": call["function"]["name"], "arguments": ""}}
                yield delta(index, tool_calls=[{"index": k, **head}])
                yield delta(index, tool_calls=[{"index": k, "function": {
                    "arguments": call["function"]["arguments"]}}])
            if reply.finished:
                yield delta(index, "tool_calls" if calls else reply.finish_reason)
                usages[index] = reply.usage
                if include_usage and len(usages) == num_choices:
                    total = total_usage([usages[i] for i in range(num_choices)], n)
                    yield sse_event(meta.body(kind, [], usage=usage_dict(total)))
        yield SSE_DONE
