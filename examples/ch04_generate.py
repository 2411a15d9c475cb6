"""Chapter 4: continue a prompt greedily and by sampling; time the loop with and without a cache.

    python examples/ch04_generate.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
                                     [--tokens 256]

The tiny model has random weights, so its "text" is noise; what matters is which tokens each
setting allows, that seeded runs repeat exactly, and how fast the loop runs. With
``--model models/tiny-shakespeare``, the book's small trained model, the settings continue the
prompt in words, and their differences can be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch
from transformers import AutoTokenizer

from minisgl.core import SamplingParams
from minisgl.engine.sample import compute_probs
from minisgl.engine.simple_loop import generate
from minisgl.models import load_model
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import configure_cpu_threads, resolve_device, resolve_dtype

PROMPT = "The capital of France is"
CONTINUATION = 12  # tokens shown for each sampling setting
SEED = 1234

SETTINGS: list[tuple[str, SamplingParams]] = [
    ("greedy", SamplingParams(temperature=0.0)),
    ("temperature 1.0", SamplingParams(temperature=1.0, seed=SEED)),
    ("temperature 0.3", SamplingParams(temperature=0.3, seed=SEED)),
    ("top-k 5", SamplingParams(temperature=1.0, top_k=5, seed=SEED)),
    ("top-p 0.5", SamplingParams(temperature=1.0, top_p=0.5, seed=SEED)),
    ("min-p 0.2", SamplingParams(temperature=1.0, min_p=0.2, seed=SEED)),
    ("k 50, p 0.9, T 0.7", SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=SEED)),
]


def time_generation(
    model: torch.nn.Module, prompt: list[int], n: int, use_cache: bool, repeats: int = 2
) -> tuple[float, list[int]]:
    """Tokens per second of greedy generation of exactly ``n`` tokens (EOS ignored), best of
    ``repeats`` runs after a short warm-up; also returns the tokens."""
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    generate(model, prompt, SamplingParams(max_tokens=4, ignore_eos=True), use_cache=use_cache)
    best = float("inf")
    for _ in range(repeats):
        _sync(prompt_device(model))
        start = time.perf_counter()
        result = generate(model, prompt, params, use_cache=use_cache)
        _sync(prompt_device(model))
        best = min(best, time.perf_counter() - start)
    return n / best, result.token_ids


def prompt_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _sync(device: torch.device) -> None:
    # CUDA kernels run asynchronously: wait for them before reading the clock.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--tokens", type=int, default=256, help="tokens generated when timing")
    args = parser.parse_args()
    configure_cpu_threads()  # share the cores with the rest of the machine
    model_dir = example_checkpoint(args.model)
    if args.tokens < 1:
        sys.exit(f"--tokens must be >= 1, got {args.tokens}")

    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    model = load_model(model_dir, device=device, dtype=dtype, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print(
        f"model: {args.model} ({model.config.architectures[0]}, "
        f"{model.config.num_layers} layers, vocab {model.config.vocab_size})"
    )
    print(f"device: {device.type}, dtype: {str(dtype).removeprefix('torch.')}")

    prompt = tokenizer.encode(PROMPT)
    print(f"prompt: {PROMPT!r} -> {len(prompt)} tokens {prompt}")
    with torch.inference_mode():  # the logits of the first step, to see what each filter keeps
        first_logits = model(
            torch.tensor(prompt, device=device),
            torch.arange(len(prompt), device=device),
            logits_indices=torch.tensor([len(prompt) - 1], device=device),
        )
    print()
    print(f"{CONTINUATION} new tokens per setting; sampled settings share seed {SEED};")
    print("'kept' = tokens the filters leave at the first step, 'p(top)' = their best one's share")
    for label, params in SETTINGS:
        probs = compute_probs(first_logits, [params])[0]
        params = dataclasses.replace(params, max_tokens=CONTINUATION)
        result = generate(model, prompt, params)
        rerun = generate(model, prompt, params).token_ids == result.token_ids
        print(
            f"  {label:<19} kept {int((probs > 0).sum()):>4}  p(top) {float(probs.max()):.4f}"
            f"  {tokenizer.decode(result.token_ids)!r}"
        )
        print(
            f"  {'':<19} ids {result.token_ids} ({result.finish_reason}; "
            f"rerun {'identical' if rerun else 'DIFFERENT'})"
        )
    print()

    n = args.tokens
    print(f"speed: greedy, {n} new tokens after the {len(prompt)}-token prompt, EOS ignored")
    slow, without = time_generation(model, prompt, n, use_cache=False)
    fast, with_cache = time_generation(model, prompt, n, use_cache=True)
    print(f"  {'loop':<34}{'tokens/s':>10}")
    print(f"  {'no cache (re-run every token)':<34}{slow:>10.1f}")
    print(f"  {'contiguous KV cache':<34}{fast:>10.1f}")
    print(f"  speed-up: {fast / slow:.1f}x")
    if without == with_cache:
        print(f"  same {n} tokens with and without the cache: yes")
    else:  # possible in bf16: different summation orders can flip a near-tie
        first = next(i for i, (a, b) in enumerate(zip(without, with_cache, strict=True)) if a != b)
        print(f"  tokens with and without the cache first differ at token {first}")


if __name__ == "__main__":
    main()
