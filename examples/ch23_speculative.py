"""Chapter 23: speculative decoding, on the book's small trained model.

First the acceptance rule by hand, on a four-token vocabulary: whatever the draft proposes,
what comes out is distributed as the target's ``p``, and a guess is kept ``sum min(p, q)`` of
the time. Then prompt lookup on a history that repeats itself. Then ``LLM``: greedy decoding
without guesses, with prompt lookup and with a draft model, token for token the same, in fewer
passes of the target, and every KV page back in the pool afterwards; with sampling, a seed
still gives the same text twice. Last the server with ``--speculative`` through the ``openai``
client, and the counters ``/metrics`` keeps.

    python examples/ch23_speculative.py [--model models/tiny-shakespeare] [--draft DIR]
                                        [--device auto|cpu|cuda]

Without ``--draft`` the draft is the model's own first four layers (``tools/cut_model.py``),
written to a temporary directory. Such a draft costs two thirds of the target, so this example
counts passes of the target and tokens, not seconds; ``benchmark/speculative.py`` measures
the speed on a GPU. Greedy, or seeded: the output is the same on every run on one machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx
import torch
from openai import OpenAI

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.speculative.accept import accept_sampled
from minisgl.speculative.ngram import propose_ngram
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import resolve_device

# The server harness and the model cutter are tools of this repository, not the engine.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from cut_model import cut_layers  # noqa: E402
from server_process import ServerError, ServerProcess, parse_metrics  # noqa: E402

PROMPTS = [
    "To be, or not to be, that is the question:\nWhether",
    "KING. Now is the winter of our discontent made glorious summer",
    "First Citizen.\nBefore we proceed any further, hear me speak.\n",
    "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?\n",
]
MAX_TOKENS = 48
DRAFT_LAYERS = 4  # of tiny-shakespeare's 6
TRIALS = 100_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-shakespeare")
    parser.add_argument("--draft", help="the draft's checkpoint (default: the model's first "
                                        f"{DRAFT_LAYERS} layers)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args()
    model_dir = example_checkpoint(args.model)
    device = resolve_device(args.device).type
    print("Chapter 23: speculative decoding")
    print(f"model: {args.model}; device: {device}")
    the_rule_by_hand()
    lookup_by_hand()
    with tempfile.TemporaryDirectory(prefix="minisgl-draft-") as tmp:
        draft = args.draft or str(cut_layers(model_dir, DRAFT_LAYERS, tmp))
        print(f"draft: {args.draft or f'its first {DRAFT_LAYERS} layers (tools/cut_model.py)'}")
        offline(model_dir, device, draft)
    try:
        with ServerProcess(model_dir, device=device,
                           args=("--speculative", "ngram,k=4")) as server:
            served(server.url)
    except ServerError as exc:
        sys.exit(str(exc))


def the_rule_by_hand() -> None:
    """Speculative sampling over four tokens: one guess, many trials."""
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])  # the target's distribution
    q = torch.tensor([0.2, 0.5, 0.1, 0.2])  # the draft's: it likes token 1 too much
    gen = torch.Generator().manual_seed(0)
    guesses = torch.multinomial(q, TRIALS, replacement=True, generator=gen)[:, None]
    verdict = accept_sampled(guesses, q.expand(TRIALS, 1, 4),
                             p.expand(TRIALS, 2, 4), generator=gen)
    first = verdict.tokens[:, 0]
    seen = torch.bincount(first, minlength=4).float() / TRIALS
    kept = verdict.accepted.float().mean().item()
    print(f"\n1. the acceptance rule, {TRIALS:,} trials of one guess drawn from q")
    print(f"  p (target)     {fmt(p)}")
    print(f"  q (draft)      {fmt(q)}")
    print(f"  kept           {kept:.4f}   (sum of min(p, q) = {torch.minimum(p, q).sum():.4f})")
    print(f"  first token    {fmt(seen)}   (distributed as p)")
    residual = (p - q).clamp(min=0)
    print(f"  residual       {fmt(residual / residual.sum())}   (norm(max(0, p - q)): "
          "what replaces a rejected guess)")


def lookup_by_hand() -> None:
    """Prompt lookup on a history that repeats: what followed the tail last time."""
    history = [7, 3, 9, 4, 1, 8, 2, 7, 3, 9]
    print("\n2. prompt lookup")
    print(f"  history {history}: its tail [7, 3, 9] occurred at the start")
    print(f"  proposes {propose_ngram(history, k=4)}, the four tokens that followed it there")
    print(f"  with no earlier match, [1, 2, 3] proposes {propose_ngram([1, 2, 3], k=4)}")


def offline(model_dir: str, device: str, draft: str) -> None:
    """Greedy output with and without guesses, and what each proposer saved."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    print(f"\n3. offline, {len(PROMPTS)} prompts, {MAX_TOKENS} greedy tokens each")
    print(f"  {'speculation':<18} {'target passes':>13} {'guesses':>8} {'kept':>6} "
          f"{'tokens/pass':>11}  same tokens  pages after")
    plain = None
    for spec in (None, "ngram,k=4", f"draft={draft},k=4"):
        with LLM(model_dir, device=device, speculative=spec) as llm:
            outs = llm.generate(PROMPTS, greedy, progress=False)
            scheduler = llm.scheduler
            decode_passes = scheduler.num_steps - 1  # the first step prefilled every prompt
            speculator = scheduler.speculator
            proposed = speculator.num_proposed if speculator else 0
            accepted = speculator.num_accepted if speculator else 0
            pages = scheduler.cache.pages_in_use
        tokens = [out["token_ids"] for out in outs]
        plain = plain or tokens
        after_first = sum(len(t) - 1 for t in tokens)  # the prefill makes each first token
        name = "off" if spec is None else spec.split(",")[0].split("=")[0]
        print(f"  {name:<18} {decode_passes:>13} {proposed:>8} {accepted:>6} "
              f"{after_first / decode_passes / len(PROMPTS):>11.2f}  {tokens == plain!s:<11}"
              f"  {pages}")
    print(f"  first prompt: {outs[0]['text'][:70]!r}")

    sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=i)
               for i in range(len(PROMPTS))]
    texts = []
    for _ in range(2):
        with LLM(model_dir, device=device, speculative=f"draft={draft},k=4") as llm:
            texts.append([out["text"] for out in llm.generate(PROMPTS, sampled,
                                                                progress=False)])
    print(f"  sampled (temperature 0.8, seeds 0-{len(PROMPTS) - 1}), twice with the draft: "
          f"same text both times: {texts[0] == texts[1]}")
    print(f"    {texts[0][1][:70]!r}")


def served(url: str) -> None:
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    print("\n4. the server, --speculative ngram,k=4, through the openai client")
    for prompt in PROMPTS[:2]:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                          temperature=0)
        print(f"  {prompt[:30]!r}... -> {reply.choices[0].text!r}")
    metrics = parse_metrics(httpx.get(f"{url}/metrics").text)
    proposed = metrics["minisgl_spec_proposed_tokens_total"]
    accepted = metrics["minisgl_spec_accepted_tokens_total"]
    print(f"  /metrics: minisgl_spec_proposed_tokens_total {proposed}, "
          f"minisgl_spec_accepted_tokens_total {accepted} ({accepted / proposed:.0%} kept)")


def fmt(values: torch.Tensor) -> str:
    return "  ".join(f"{v:.4f}" for v in values.tolist())


if __name__ == "__main__":
    main()
