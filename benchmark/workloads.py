"""The requests a benchmark sends: their prompts, their output lengths and when they arrive.

Four kinds, all seeded so that every system and every run sees the same requests:

- ``random``: prompt and output lengths uniform in their ranges, prompts of random token ids.
  Random ids carry no meaning, and that is the point: no prefix is shared by accident, and
  greedy decoding with end-of-sequence ignored makes every request produce exactly its drawn
  number of tokens, so the work is fixed by the lengths alone;
- ``shared-prefix``: a few long system prompts, each request one of them followed by a suffix of
  its own. What a prefix cache can save here is known in advance
  (:meth:`Workload.predicted_prefill_savings`);
- ``long-context``: random prompts of thousands of tokens: prefill, attention over long contexts
  and the KV budget dominate instead of decoding;
- ``sharegpt``: real conversations from a file in the common ShareGPT JSON format (none is
  bundled): the first human turn is the prompt, the length of the reply that followed it is
  the output length.

Arrivals are a Poisson process: exponential gaps, drawn once for the seed and divided by the
rate, so every rate sees the same pattern, compressed or stretched.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

KINDS = ("random", "shared-prefix", "long-context", "sharegpt")


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """When each request is sent, in seconds from the start: a Poisson process of ``rate``
    requests per second, the first at 0. ``rate=inf`` sends them all at 0.

    The gaps are one seeded draw of exponential gaps of mean 1, divided by ``rate``: every rate
    sees the same pattern of arrivals, compressed or stretched.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:  # also catches NaN
        raise ValueError(f"the request rate must be > 0 (or inf), got {rate!r}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(f"{seed}:arrivals")
    times, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += rng.expovariate(1.0) / rate
        times.append(now)
    return times


@dataclass(frozen=True)
class Workload:
    """The requests of every round (a request rate, an ablation arm).

    Attributes:
        input_lens, output_lens: per request, prompt tokens and tokens to generate.
        seed: seeds the prompts and the arrivals.
        kind: one of ``KINDS``.
        prefix_len: shared-prefix: the tokens of each system prompt.
        groups: shared-prefix: which system prompt each request starts with.
        dataset_prompts: sharegpt: the prompts themselves, the same in every round.
    """

    input_lens: list[int]
    output_lens: list[int]
    seed: int
    kind: str = "random"
    prefix_len: int = 0
    groups: tuple[int, ...] = ()
    dataset_prompts: tuple[tuple[int, ...], ...] = ()

    @property
    def num_requests(self) -> int:
        return len(self.input_lens)

    @property
    def num_prefixes(self) -> int:
        return len(set(self.groups))

    def arrivals(self, rate: float) -> list[float]:
        return poisson_arrivals(self.num_requests, rate, self.seed)

    def prompts(self, vocab_size: int, round_index: int) -> list[list[int]]:
        """The prompts of one round. Random ids are drawn afresh for every round, so that a
        prefix cache cannot serve one round's prompts from an earlier round's; a dataset's
        prompts are the same in every round."""
        if self.dataset_prompts:
            return [list(p) for p in self.dataset_prompts]
        rng = random.Random(f"{self.seed}:prompts:{round_index}")
        if self.kind != "shared-prefix":
            return [[rng.randrange(vocab_size) for _ in range(n)] for n in self.input_lens]
        return self._shared_prefix_prompts(rng, vocab_size)

    def _shared_prefix_prompts(self, rng: random.Random, vocab_size: int) -> list[list[int]]:
        """A system prompt per group, then each request's own suffix. The system prompts
        differ from their first token on, and the suffixes of one group from theirs, so that
        two requests share exactly their system prompt or nothing at all."""
        num_groups = max(self.groups) + 1
        members = [self.groups.count(g) for g in range(num_groups)]
        if max(num_groups, *members) > vocab_size:
            raise ValueError(f"a vocabulary of {vocab_size} cannot keep {num_groups} system "
                             f"prompts and {max(members)} suffixes apart")
        firsts = rng.sample(range(vocab_size), num_groups)
        prefixes = [[first] + [rng.randrange(vocab_size) for _ in range(self.prefix_len - 1)]
                    for first in firsts]
        suffix_firsts = [iter(rng.sample(range(vocab_size), n)) for n in members]
        prompts = []
        for group, length in zip(self.groups, self.input_lens):
            suffix = [next(suffix_firsts[group])]
            suffix += [rng.randrange(vocab_size) for _ in range(length - self.prefix_len - 1)]
            prompts.append(prefixes[group] + suffix)
        return prompts

    def predicted_prefill_savings(self, page_size: int = 1) -> int:
        """Prompt tokens a prefix cache spares when each system prompt is cached before the
        rest of its group is prefilled: every request but the first of its group reuses the
        whole pages of its system prompt. Zero for the other kinds."""
        if self.kind != "shared-prefix":
            return 0
        reused = self.prefix_len // page_size * page_size  # a cache keeps whole pages only
        return (self.num_requests - self.num_prefixes) * reused

    def first_of_each_group(self) -> list[int]:
        """Shared-prefix: the index of each group's first request (the one that seeds it)."""
        firsts: dict[int, int] = {}
        for i, group in enumerate(self.groups):
            firsts.setdefault(group, i)
        return sorted(firsts.values())


def _lengths(rng: random.Random, num: int, bounds: tuple[int, int], what: str) -> list[int]:
    low, high = bounds
    if not 1 <= low <= high:
        raise ValueError(f"{what} lengths need 1 <= min <= max, got [{low}, {high}]")
    return [rng.randint(low, high) for _ in range(num)]


def make_workload(num_requests: int, input_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int) -> Workload:
    """``random``: input lengths, then output lengths, uniform in their inclusive ranges."""
    rng = random.Random(f"{seed}:lengths")
    inputs = _lengths(rng, num_requests, input_range, "prompt")
    outputs = _lengths(rng, num_requests, output_range, "output")
    return Workload(inputs, outputs, seed)


def make_long_context(num_requests: int, context_len: int, output_range: tuple[int, int],
                      seed: int) -> Workload:
    """``long-context``: prompts uniform in [context_len / 2, context_len] tokens."""
    base = make_workload(num_requests, (max(1, context_len // 2), context_len), output_range,
                         seed)
    return Workload(base.input_lens, base.output_lens, seed, kind="long-context")


def make_shared_prefix(num_requests: int, num_prefixes: int, prefix_len: int,
                       suffix_range: tuple[int, int], output_range: tuple[int, int],
                       seed: int) -> Workload:
    """``shared-prefix``: ``num_prefixes`` system prompts of ``prefix_len`` tokens, taken in
    turn (request i starts with system prompt i mod ``num_prefixes``), each followed by a
    suffix of a length uniform in ``suffix_range``."""
    if not 1 <= num_prefixes <= num_requests:
        raise ValueError(f"need 1 <= prefixes <= requests, got {num_prefixes} prefixes for "
                         f"{num_requests} requests")
    if prefix_len < 1:
        raise ValueError(f"the system prompts need at least one token, got {prefix_len}")
    base = make_workload(num_requests, suffix_range, output_range, seed)
    return Workload([prefix_len + n for n in base.input_lens], base.output_lens, seed,
                    kind="shared-prefix", prefix_len=prefix_len,
                    groups=tuple(i % num_prefixes for i in range(num_requests)))


def load_sharegpt(path: str | Path, encode: Callable[[str], list[int]], num_requests: int,
                  seed: int, max_input: int | None = None) -> Workload:
    """``sharegpt``: conversations from a ShareGPT-format JSON file, a list of
    ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}``.

    The first human turn followed by a reply gives one request: its tokens are the prompt and
    the reply's token count the output length. Conversations are shuffled with ``seed``; those
    without such a pair, or with a prompt over ``max_input`` tokens, are passed over.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the dataset {path}: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations, got "
                         f"{type(data).__name__}")
    order = list(range(len(data)))
    random.Random(f"{seed}:dataset").shuffle(order)
    prompts: list[tuple[int, ...]] = []
    outputs: list[int] = []
    for index in order:
        pair = _first_exchange(data[index])
        if pair is None:
            continue
        prompt, reply = encode(pair[0]), encode(pair[1])
        if not prompt or not reply or (max_input is not None and len(prompt) > max_input):
            continue
        prompts.append(tuple(prompt))
        outputs.append(len(reply))
        if len(prompts) == num_requests:
            break
    if len(prompts) < num_requests:
        raise ValueError(f"{path} holds {len(prompts)} usable conversations (a human turn "
                         f"then a reply), fewer than the {num_requests} requests asked for")
    return Workload([len(p) for p in prompts], outputs, seed, kind="sharegpt",
                    dataset_prompts=tuple(prompts))


def _first_exchange(item: object) -> tuple[str, str] | None:
    turns = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(turns, list):
        return None
    for ask, answer in zip(turns, turns[1:]):
        if (isinstance(ask, dict) and isinstance(answer, dict) and ask.get("from") == "human"
                and answer.get("from") == "gpt" and isinstance(ask.get("value"), str)
                and isinstance(answer.get("value"), str)):
            return ask["value"], answer["value"]
    return None
