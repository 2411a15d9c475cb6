"""Structured output (chapter 22): grammars decide which tokens may come next.

- the teaching automaton's mask equals a brute-force answer on a toy vocabulary;
- through the ``openai`` client against ``python -m minisgl --device cpu`` serving the trained
  tiny model (which never writes JSON unconstrained): every output of the schemas below, held
  back from the chapter's page, parses and validates with ``jsonschema``, streamed and not;
  ``json_object`` always parses; tools with ``required`` and a named ``tool_choice`` give calls
  whose arguments validate, streamed calls reassemble to the same call; bad schemas are 400;
- LangChain's ``with_structured_output`` in its three methods, ``bind_tools`` with a tool
  message round trip, and litellm's ``json_object``;
- offline: requests without a grammar get the same tokens beside constrained ones, and overlap
  scheduling gives the same constrained outputs as none.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from minisgl.core import SamplingParams
from minisgl.grammar import json_object_grammar, json_schema_grammar
from minisgl.grammar.automaton import allowed_tokens, integer_field_dfa

from conftest import SHAKESPEARE_DIR as MODEL_DIR

jsonschema = pytest.importorskip("jsonschema")

MAX_TOKENS = 1000  # every grammar below ends well before: the test fails if one does not

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"address": {
        "type": "object", "properties": {"street": {"type": "string", "maxLength": 30},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "zip"], "additionalProperties": False}},
     "required": ["address"], "additionalProperties": False},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer"},
                                                 "minItems": 2, "maxItems": 4}},
     "required": ["scores"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0,
                                                "maximum": 1}},
     "required": ["ratio"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "nothing": {"type": "null"}},
     "required": ["ok", "nothing"]},
    {"type": "object", "properties": {"id": {"type": "integer"},
                                      "note": {"type": "string", "maxLength": 10}},
     "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"people": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"first": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "minimum": 1,
                                                 "maximum": 99}},
        "required": ["first", "age"], "additionalProperties": False}}},
     "required": ["people"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string",
                                               "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
     "required": ["day"]},
    {"type": "object", "properties": {"version": {"const": 2}, "kind": {"const": "report"}},
     "required": ["version", "kind"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "string", "maxLength": 8},
                                                          {"type": "integer"}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": -9,
                                                  "maximum": 9}}}},
     "required": ["matrix"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                         "y": {"type": "integer"}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"},
                                      "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 3,
                                               "maxLength": 6}},
     "required": ["word"]},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20}, "year": {"type": "integer",
                                                               "minimum": 1500,
                                                               "maximum": 2100},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"enum": ["drama", "comedy"]}, "maxItems": 2},
        "seen": {"type": "boolean"}},
     "required": ["title", "year", "rating", "tags", "seen"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 3},
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 5}},
     "required": ["maybe"]},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed", 3, None]},
                                      "count": {"type": "integer", "minimum": 10,
                                                "maximum": 20}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"radius": {"type": "number", "minimum": 0}},
         "required": ["radius"], "additionalProperties": False},
        {"type": "object", "properties": {"side": {"type": "integer", "minimum": 1}},
         "required": ["side"], "additionalProperties": False}]}},
     "required": ["shape"]},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email",
                                                "maxLength": 30}},
     "required": ["email"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
]
PROMPT = [{"role": "user", "content": "Answer in JSON."}]


# =========================================================================== the automaton
def test_the_automatons_mask_equals_brute_force_on_a_toy_vocabulary() -> None:
    """A token is allowed exactly when the text so far plus the token is a prefix of some
    sentence of the language; the end of sequence exactly when the text is a sentence."""
    dfa = integer_field_dfa("n")
    vocab = ["{", '"', "n", '": ', "0", "1", "12", "}", "0}", '{"n": ', "x", "", '"n', "9}",
             " ", "01", "<eos>"]
    eos = [len(vocab) - 1]
    sentences = {'{"n": ' + str(value) + "}" for value in range(100_000)}
    prefixes = {s[:i] for s in sentences for i in range(len(s) + 1)}
    for text in ["", "{", '{"', '{"n": ', '{"n": 0', '{"n": 1', '{"n": 12', '{"n": 0}']:
        state = dfa.walk(dfa.start, text)
        assert state is not None, text
        expected = [bool(tok) and text + tok in prefixes for tok in vocab[:-1]]
        expected.append(text in sentences)
        assert allowed_tokens(dfa, state, vocab, eos) == expected, text
    assert dfa.walk(dfa.start, '{"n": 01') is None


# =========================================================================== the server
@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def server(shakespeare_server: Any) -> Any:
    """The trained tiny model, served by ``python -m minisgl --device cpu`` as model "m"."""
    return shakespeare_server


def schema_format(schema: dict[str, Any], strict: bool = False) -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def chat_text(client: Any, stream: bool, **body: Any) -> tuple[str, str]:
    """The text and finish reason of a greedy chat turn, whole or streamed."""
    body = {"model": "m", "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            **body}
    if not stream:
        answer = client.chat.completions.create(**body)
        return answer.choices[0].message.content, answer.choices[0].finish_reason
    chunks = list(client.chat.completions.create(stream=True, **body))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_held_back_schema_gives_valid_json(client: Any, stream: bool) -> None:
    failures = []
    for i, schema in enumerate(SCHEMAS):
        text, finish = chat_text(client, stream, response_format=schema_format(schema, i % 2 == 1))
        try:
            jsonschema.validate(json.loads(text), schema)
            assert finish == "stop", finish
        except Exception as exc:  # collect every failure: the message shows them all
            failures.append(f"schema {i}: {text[:200]!r}: {exc}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_object_always_parses(client: Any, stream: bool) -> None:
    for content in ["Answer in JSON.", "Hello", "ROMEO.", "List three fruits"]:
        text, finish = chat_text(client, stream, messages=[{"role": "user", "content": content}],
                                 response_format={"type": "json_object"})
        assert isinstance(json.loads(text), dict) and finish == "stop", text


def test_completions_take_a_response_format(client: Any) -> None:
    schema = SCHEMAS[3]
    answer = client.completions.create(model="m", prompt="The color:", max_tokens=MAX_TOKENS,
                                       temperature=0,
                                       extra_body={"response_format": schema_format(schema)})
    jsonschema.validate(json.loads(answer.choices[0].text), schema)


def test_objects_are_closed_and_strict_gives_every_property(client: Any) -> None:
    """An object schema that does not say takes no other property; a strict one (OpenAI's
    strict mode) has every property it lists."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9},
                                               "ok": {"type": "boolean"}}, "required": ["n"]}
    closed = {**schema, "additionalProperties": False}
    for stream in (False, True):
        text, _ = chat_text(client, stream, response_format=schema_format(schema))
        jsonschema.validate(json.loads(text), closed)
        text, _ = chat_text(client, stream, response_format=schema_format(schema, strict=True))
        jsonschema.validate(json.loads(text), {**closed, "required": ["n", "ok"]})


@pytest.mark.parametrize("response_format, problem", [
    (schema_format({"type": "objectx"}), "objectx"),
    (schema_format({"type": "string", "format": "no-such-format"}), "no-such-format"),
    (schema_format({"type": "array", "uniqueItems": True}), "uniqueItems"),  # unsupported
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "yaml"}, "yaml"),
])
def test_a_bad_schema_is_a_400_naming_the_problem(server: Any, response_format: dict[str, Any],
                                                   problem: str) -> None:
    import httpx

    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": PROMPT, "response_format": response_format})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and problem in error["message"]


# =========================================================================== tools
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]


def check_call(call: Any, names: set[str]) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in names
    schema = next(t["function"]["parameters"] for t in TOOLS
                  if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_choice_required_returns_a_valid_call(client: Any) -> None:
    answer = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice="required", max_tokens=MAX_TOKENS, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call, {"get_weather", "get_time"})


def test_a_named_tool_choice_calls_that_function_once(client: Any) -> None:
    answer = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What time is it?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0)
    calls = answer.choices[0].message.tool_calls
    assert len(calls) == 1
    check_call(calls[0], {"get_time"})


def test_streamed_tool_calls_reassemble_to_the_same_call(client: Any) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}],
            "tools": TOOLS, "tool_choice": "required", "max_tokens": MAX_TOKENS,
            "temperature": 0}
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for piece in client.chat.completions.create(stream=True, **body):
        if not piece.choices:
            continue
        finish = piece.choices[0].finish_reason or finish
        for delta in piece.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            if delta.id:  # id, type and name come first, alone
                assert delta.function.name and not delta.function.arguments
                call.update(id=delta.id, name=delta.function.name)
            call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_tool_history_is_rendered_and_answered(client: Any) -> None:
    """An assistant turn with tool_calls (content null) and a tool turn are accepted."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    answer = client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                            tool_choice="none", max_tokens=8, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_auto_parses_calls_the_model_writes() -> None:
    from minisgl.server.tools import split_tool_calls

    text = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n'
            '</tool_call>\n<tool_call>\nnot json\n</tool_call>')
    content, calls = split_tool_calls(text)
    assert content == "Let me check.\n\n<tool_call>\nnot json\n</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_time", {"zone": 2})]
    assert split_tool_calls("no calls") == ("no calls", [])


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_are_a_400_naming_the_field(server: Any, body: dict[str, Any],
                                              param: str) -> None:
    import httpx

    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"messages": PROMPT, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# =========================================================================== other clients
def test_langchain_structured_output_in_every_method(server: Any) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, ConfigDict, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        population: int = Field(ge=0, le=10_000_000)

    class Anything(BaseModel):
        # json_mode sends no schema: any JSON object must be a valid answer
        model_config = ConfigDict(extra="allow")

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model="m", temperature=0,
                     max_tokens=MAX_TOKENS, max_retries=0)
    for method, model in [("json_schema", City), ("function_calling", City),
                          ("json_mode", Anything)]:
        result = llm.with_structured_output(model, method=method).invoke("A city, in JSON.")
        assert isinstance(result, model), (method, result)


def test_langchain_bind_tools_and_a_tool_message_round_trip(server: Any) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model="m", temperature=0,
                     max_tokens=200, max_retries=0)
    asked = [HumanMessage("Weather in Paris?")]
    called = llm.bind_tools([get_weather], tool_choice="required").invoke(asked)
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"
    call = called.tool_calls[0]
    answered = llm.bind_tools([get_weather]).invoke(
        [*asked, called, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])])
    assert answered.content or answered.tool_calls


def test_litellm_json_object(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price list fetched
    litellm = pytest.importorskip("litellm")
    answer = litellm.completion(model="openai/m", api_base=f"{server.url}/v1", api_key="none",
                                messages=PROMPT, response_format={"type": "json_object"},
                                max_tokens=MAX_TOKENS, temperature=0)
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


# =========================================================================== offline
def generate(prompts: list[str], params: list[SamplingParams], overlap: bool) -> list[dict]:
    from minisgl.llm import LLM

    with LLM(MODEL_DIR, device="cpu", dtype="float32", overlap=overlap) as llm:
        outputs = llm.generate(prompts, params)
        # A run without a grammar never allocates the bitmask: it pays nothing for it.
        constrained = any(p.grammar is not None for p in params)
        assert ("grammar_bitmask" in vars(llm.engine)) == constrained
        return outputs


def test_requests_without_a_grammar_are_untouched_beside_constrained_ones() -> None:
    plain = SamplingParams(max_tokens=24)
    prompts = ["ROMEO.", "Once upon", "JULIET."]
    alone = generate(prompts, [plain] * 3, overlap=True)
    constrained = SamplingParams(max_tokens=MAX_TOKENS, grammar=json_schema_grammar(SCHEMAS[0]))
    mixed = generate(["A", prompts[0], "B", prompts[1], prompts[2], "C"],
                     [constrained, plain, constrained, plain, plain, constrained], overlap=True)
    assert [m["token_ids"] for m in mixed[1:2] + mixed[3:5]] == \
        [a["token_ids"] for a in alone]
    for m in mixed[0], mixed[2], mixed[5]:
        jsonschema.validate(json.loads(m["text"]), SCHEMAS[0])


def test_overlap_gives_the_same_constrained_outputs_as_none() -> None:
    grammars = [json_schema_grammar(SCHEMAS[7]), json_object_grammar(),
                json_schema_grammar(SCHEMAS[15], strict=True)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, grammar=g) for g in grammars]
    prompts = ["People:", "Anything:", "A film:"]
    with_overlap = generate(prompts, params, overlap=True)
    without = generate(prompts, params, overlap=False)
    assert [o["token_ids"] for o in with_overlap] == [o["token_ids"] for o in without]
    assert all(o["finish_reason"] == "stop" for o in with_overlap)


def test_a_finished_grammar_stops_even_under_ignore_eos() -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                            grammar=json_schema_grammar(SCHEMAS[3]))
    out = generate(["Color:"], [params], overlap=True)[0]
    assert out["finish_reason"] == "stop" and len(out["token_ids"]) < 20
    jsonschema.validate(json.loads(out["text"]), SCHEMAS[3])


def test_the_cost_benchmark_runs_every_share(tiny_model_dir: Any) -> None:
    from conftest import load_repo_script

    bench = load_repo_script("benchmark/structured_cost.py")
    rows = bench.main(["--model", str(tiny_model_dir), "--device", "cpu", "--num-requests",
                       "4", "--min-len", "4", "--max-len", "8"])
    assert [(r["constrained"], r["overlap"]) for r in rows] == \
        [(share, overlap) for overlap in (True, False) for share in bench.SHARES]
    assert all(r["tokens"] > 0 and r["tok_per_s"] > 0 and r["free_tok_per_s"] > 0 for r in rows)
