"""Chapter 22: structured output, on the book's small trained model.

First the idea by hand: the small automaton of ``{"age": N}``, walked over the model's own
vocabulary, and how many of its tokens each state allows. Then offline, with ``LLM``: the model
asked for JSON writes Shakespeare; with a schema's grammar every token is drawn from those the
grammar allows, and the answer parses and validates. Then the server through the ``openai``
client: ``response_format`` with a strict JSON Schema, ``json_object``, and a tool the model
must call (``tool_choice="required"``), whose result goes back as a ``tool`` message.

    python examples/ch22_structured.py [--model models/tiny-shakespeare] [--device auto|cpu|cuda]

Everything is greedy, so the output is the same on every run on one machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
from openai import OpenAI

from minisgl.core import SamplingParams
from minisgl.grammar.automaton import allowed_tokens, integer_field_dfa
from minisgl.grammar.compile import json_schema_grammar
from minisgl.llm import LLM
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import resolve_device

# The server harness is a tool of this repository, not part of the engine.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from server_process import ServerError, ServerProcess  # noqa: E402

PROMPT = "Describe ROMEO as JSON, with his name, his age and his house:\n"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "house": {"enum": ["Montague", "Capulet"]}},
          "required": ["name", "age", "house"]}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"], "additionalProperties": False}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-shakespeare")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args()
    model_dir = example_checkpoint(args.model)
    device = resolve_device(args.device).type
    print("Chapter 22: structured output")
    print(f"model: {args.model}; device: {device}")
    llm = LLM(model_dir, device=device)
    by_hand(llm)
    offline(llm)
    try:
        with ServerProcess(model_dir, device=device) as server:
            served(OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0))
    except ServerError as exc:
        sys.exit(str(exc))


def by_hand(llm: LLM) -> None:
    """The automaton of {"age": N} over the model's vocabulary, one state at a time."""
    tok = llm.tokenizer
    vocab = [tok.decode([i]) for i in range(llm.engine.model_config.vocab_size)]
    eos = llm.engine.eos_token_ids
    dfa = integer_field_dfa("age")
    print(f'\n1. the automaton of {{"age": N}} over the model\'s {len(vocab):,} tokens')
    state, text = dfa.start, ""
    for piece in ['{"', "age", '": ', "4", "2", "}"]:
        mask = allowed_tokens(dfa, state, vocab, eos)
        shown = [repr(vocab[i]) for i, ok in enumerate(mask) if ok][:6]
        print(f"  after {text!r:<16} state {state:>2}: {sum(mask):>3} tokens allowed, "
              f"e.g. {', '.join(shown)}")
        state, text = dfa.walk(state, piece), text + piece
    mask = allowed_tokens(dfa, state, vocab, eos)
    ends = [repr(vocab[i]) for i, ok in enumerate(mask) if ok]
    print(f"  after {text!r:<16} state {state:>2}: {sum(mask):>3} tokens allowed, "
          f"{', '.join(ends)}: only the ends of sequence, as the state accepts")


def offline(llm: LLM) -> None:
    """The same prompt, free and under a schema's grammar."""
    print(f"\n2. offline, greedy, after {PROMPT!r}")
    free, = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0))
    print(f"  free:        {free['text']!r}")
    print(f"    parses as JSON: {parses(free['text'])}")
    grammar = json_schema_grammar(PERSON, strict=True)
    held, = llm.generate([PROMPT], SamplingParams(max_tokens=64, temperature=0,
                                                  grammar=grammar))
    print(f"  with schema: {held['text']!r} ({len(held['token_ids'])} tokens, "
          f"finish {held['finish_reason']})")
    jsonschema.validate(json.loads(held["text"]), PERSON)
    print("    parses and validates against the schema")


def served(client: OpenAI) -> None:
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": PROMPT}]
    print("\n3. the server, through the openai client")
    schema_format = {"type": "json_schema",
                     "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=64,
                                           temperature=0, response_format=schema_format)
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    print(f"  json_schema (strict): {text!r}, validates")
    # json_object bounds strings (64 characters), members (8) and depth (3): an answer ends
    # within a few hundred tokens even when the model fills every bound
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1024,
                                           temperature=0, response_format={"type": "json_object"})
    text = reply.choices[0].message.content
    print(f"  json_object ({reply.usage.completion_tokens} tokens, finish "
          f"{reply.choices[0].finish_reason!r}): {text!r}, parses: {parses(text)}")

    ask = [{"role": "user", "content": "What is the weather in Verona?"}]
    reply = client.chat.completions.create(model=model, messages=ask, max_tokens=64,
                                           temperature=0, tools=[WEATHER_TOOL],
                                           tool_choice="required")
    choice = reply.choices[0]
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    print(f"  tools, tool_choice='required': finish_reason {choice.finish_reason!r}, "
          f"{call.function.name}({call.function.arguments}), id {call.id[:5]}...")
    history = [*ask, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    answer = client.chat.completions.create(model=model, messages=history, max_tokens=16,
                                            temperature=0, tools=[WEATHER_TOOL])
    print(f"  after the tool's result: {answer.choices[0].message.content!r} "
          f"(finish_reason {answer.choices[0].finish_reason!r})")


def parses(text: Any) -> bool:
    try:
        json.loads(text)
    except (TypeError, ValueError):
        return False
    return True


if __name__ == "__main__":
    main()
