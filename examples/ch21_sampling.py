"""Chapter 21: the sampling API real clients use, on the book's small trained model.

First offline, with ``LLM``: one greedy continuation that repeats itself, then the same with a
repetition, frequency or presence penalty, with a token banned by ``logit_bias``, and a short
answer held open by ``min_tokens``. Then ``n`` choices of one prompt on the scheduler itself:
the tokens each prefill computed and the KV pages held, against one choice. Then the server
(``--prefix-cache radix``) through the ``openai`` client: each token's logprob and its best
alternatives; a token forced by ``logit_bias`` keeps its raw logprob, the one ``transformers``
computes; an lm-eval style loglikelihood with ``echo``; and ``n=3`` seeded choices.

    python examples/ch21_sampling.py [--model models/tiny-shakespeare] [--device auto|cpu|cuda]

Everything is greedy or seeded, so the output is the same on every run on one machine.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from minisgl.core import Req, SamplingParams
from minisgl.llm import LLM
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import resolve_device

# The server harness is a tool of this repository, not part of the engine.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from server_process import ServerError, ServerProcess  # noqa: E402

REPEATS = "VIOLA.\nWhat money, sir?\n"  # its greedy answer says " sir" and "LEONATO" twice
SHORT = "JULIET:\nWhat light"  # its greedy answer ends after three words
# n=1, then n=3: two prompts of one length that differ from their first token, so the second
# finds nothing of the first in the radix cache
CHOICES = {1: "DUKE.\nWhat news from Padua? Speak, and tell me all that thou hast seen.\n",
           3: "KING.\nWhat news from Mantua? Speak, and tell me all that thou hast seen.\n"}
CONTEXT = "JULIET.\nO Romeo, Romeo, wherefore art thou"
ENDINGS = [" Romeo?", " Juliet?"]  # a multiple-choice question, scored as lm-eval scores it
SEED = 7


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-shakespeare")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args()
    model_dir = example_checkpoint(args.model)
    device = resolve_device(args.device).type
    print("Chapter 21: the sampling API real clients use")
    print(f"model: {args.model}; device: {device}")

    llm = LLM(model_dir, device=device, prefix_cache="radix")
    adjustments(llm)
    offline_choices = choices(llm)
    try:
        with ServerProcess(model_dir, device=device,
                           args=("--prefix-cache", "radix")) as server:
            client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            served(client, llm.tokenizer, model_dir, offline_choices)
    except ServerError as exc:
        sys.exit(str(exc))


def adjustments(llm: LLM) -> None:
    """One greedy continuation, then the same with each adjustment of the logits."""
    sir = llm.tokenizer.encode(" sir")[0]
    print(f"\n1. greedy, 24 tokens after {REPEATS!r}; 'repeated' lists the tokens used twice "
          "or more")
    cases = {
        "plain": {},
        "repetition_penalty=1.5": {"repetition_penalty": 1.5},
        "frequency_penalty=1.0": {"frequency_penalty": 1.0},
        "presence_penalty=1.0": {"presence_penalty": 1.0},
        f"logit_bias={{{sir}: -100}} (' sir')": {"logit_bias": {sir: -100}},
    }
    for name, options in cases.items():
        out = llm.generate(REPEATS, SamplingParams(max_tokens=24, **options))[0]
        counts = Counter(llm.tokenizer.decode([t]) for t in out["token_ids"])
        repeated = {token: n for token, n in counts.most_common() if n > 1}
        print(f"  {name}\n    {out['text']!r}\n    repeated: {repeated}")

    print(f"\n   greedy after {SHORT!r}, with and without min_tokens:")
    for options in ({}, {"min_tokens": 12}):
        out = llm.generate(SHORT, SamplingParams(max_tokens=24, **options))[0]
        print(f"  {options or 'plain'}: {len(out['token_ids'])} tokens, "
              f"{out['finish_reason']!r}: {out['text']!r}")


def choices(llm: LLM) -> list[str]:
    """n choices of one prompt on the scheduler: what each prefill computed, the pages held."""
    scheduler = llm.scheduler
    cache = scheduler.cache.prefix_cache
    print(f"\n2. n choices of one {len(llm.tokenizer.encode(CHOICES[3]))}-token prompt, 8 "
          f"tokens each, temperature 1, choice j seeded {SEED} + j; radix cache, pages of "
          f"{scheduler.cache.page_size} token")
    texts: list[str] = []
    held_by_one = 0
    for n, first_uid in ((1, 100), (3, 200)):
        prompt = llm.tokenizer.encode(CHOICES[n])
        reqs = [Req(first_uid + j, prompt,
                    SamplingParams(temperature=1.0, seed=SEED + j, max_tokens=8))
                for j in range(n)]
        for req in reqs:  # the server's n: n requests of one prompt, submitted together
            scheduler.add(req)
        computed, held = [], 0
        while scheduler.has_work:
            result = scheduler.step()
            if result.phase == "prefill":
                computed += list(result.new_lens)
            # pages the running requests hold (the cache's unlocked pages are not theirs)
            held = max(held, result.pages_in_use - cache.num_evictable_pages)
        alone = f" (unshared: {n} x {held_by_one} = {n * held_by_one})" if n > 1 else ""
        print(f"  n={n}: prompt tokens each prefill computed {computed}; KV pages held at "
              f"most {held}{alone}")
        held_by_one = held
        texts = [llm.tokenizer.decode(req.output_ids) for req in reqs]
    for j, text in enumerate(texts):
        print(f"    choice {j}: {text!r}")
    return texts


def served(client: OpenAI, tokenizer: Any, model_dir: Path, offline_choices: list[str]) -> None:
    """The same ideas through the server, as OpenAI's clients and lm-eval ask for them."""
    model = client.models.list().data[0].id
    print("\n3. the server, through the openai client")
    reply = client.completions.create(model=model, prompt=REPEATS, max_tokens=4,
                                      temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    print(f"  logprobs=3, greedy: {reply.choices[0].text!r}")
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        print(f"    {token!r:>12} {logprob:8.4f}   best 3: {_listed(top)}")

    bang = tokenizer.encode("!")[0]
    forced = client.completions.create(model=model, prompt=REPEATS, max_tokens=1,
                                       temperature=0, logprobs=3, logit_bias={str(bang): 100})
    flp = forced.choices[0].logprobs
    print(f"  logit_bias {{{bang}: 100}} ('!') forces {forced.choices[0].text!r}: logprob "
          f"{flp.token_logprobs[0]:.4f}, best 3: {_listed(flp.top_logprobs[0])}")
    # The reference: transformers' model on the same checkpoint, its log-softmax at the place
    # of the first generated token
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([tokenizer.encode(REPEATS)])).logits[0, -1]
    reference = torch.log_softmax(logits, dim=-1)
    first = tokenizer.encode(lp.tokens[0])[0]
    print(f"    transformers' log_softmax there: {lp.tokens[0]!r} {float(reference[first]):.4f}, "
          f"'!' {float(reference[bang]):.4f}")

    print(f"  loglikelihood as lm-eval asks it (echo, logprobs=1, max_tokens=1), context "
          f"{CONTEXT!r}")
    context_len = len(tokenizer.encode(CONTEXT))
    for ending in ENDINGS:
        scored = client.completions.create(model=model, prompt=CONTEXT + ending, max_tokens=1,
                                           temperature=0, logprobs=1, echo=True, seed=1234)
        slp = scored.choices[0].logprobs
        tokens, values = slp.tokens[context_len:-1], slp.token_logprobs[context_len:-1]
        print(f"    {ending!r}: first prompt token's logprob {slp.token_logprobs[0]}; "
              f"ending {tokens} {[round(v, 4) for v in values]}, sum {sum(values):.4f}")

    many = client.completions.create(model=model, prompt=CHOICES[3], n=3, max_tokens=8,
                                     temperature=1.0, seed=SEED)
    texts = [c.text for c in sorted(many.choices, key=lambda c: c.index)]
    print(f"  n=3, seed {SEED}: {texts}")
    print(f"    usage: {many.usage.prompt_tokens} prompt tokens (counted once), "
          f"{many.usage.completion_tokens} completion tokens; the same texts as offline: "
          f"{texts == offline_choices}")


def _listed(top: dict[str, float]) -> str:
    return ", ".join(f"{token!r} {logprob:.4f}" for token, logprob in top.items())


if __name__ == "__main__":
    main()
