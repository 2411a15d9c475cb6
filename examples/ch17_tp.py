"""Chapter 17: tensor parallelism: the same prompts at TP=1 and TP=N, token for token.

First the split itself, from the checkpoint's config: what each of the N ranks holds of every
layer (query heads, KV heads, MLP columns, vocabulary rows) and what one token of KV cache
costs each rank. Then ``LLM`` runs eight prompts greedily at TP=1 and at TP=N with the same
settings (radix cache, chunked prefill, overlap scheduling), and the two outputs are compared
token for token, with the time each took.

On a CPU the N ranks are N processes talking through gloo over loopback; on CUDA each rank
takes one GPU and they talk through NCCL (``--device cuda --tp 2`` needs two GPUs).

    python examples/ch17_tp.py [--model models/tiny-qwen3] [--device cpu|cuda] [--tp 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from minisgl.core import SamplingParams
from minisgl.layers.base import first_local_kv_head, local_kv_heads
from minisgl.layers.embedding import vocab_rows
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import resolve_device, resolve_dtype

PROMPTS = [
    "The first rank holds",
    "Once upon a time, two processes",
    "An all-reduce adds up",
    "Split the heads, not the tokens:",
    "The first rank holds the first half",
    "Gloo on a CPU, NCCL on a GPU",
    "Every rank runs the same scheduler",
    "1, 2, 3, 4,",
]
OPTIONS = {"page_size": 4, "num_pages": 256, "max_running_reqs": 4, "prefix_cache": "radix",
           "chunked_prefill": True, "max_prefill_tokens": 16}


def print_split(config: ModelConfig, tp: int, dtype: torch.dtype) -> None:
    """What rank r of ``tp`` holds, computed by the functions the layers use."""
    print(f"{'rank':>4}  {'q heads':>9}  {'kv heads':>9}  {'mlp cols':>11}  {'vocab rows':>13}  "
          f"{'KV B/token':>10}")
    for rank in range(tp):
        q = config.num_qo_heads // tp
        kv = local_kv_heads(config.num_kv_heads, tp)
        kv0 = first_local_kv_head(config.num_kv_heads, rank, tp)
        cols = config.intermediate_size // tp
        start, end, _ = vocab_rows(config.vocab_size, rank, tp)
        kv_bytes = dataclasses.replace(config, num_kv_heads=kv).kv_bytes_per_token(dtype)
        print(f"{rank:>4}  {rank * q:>4}..{(rank + 1) * q - 1:<3}  {kv0:>4}..{kv0 + kv - 1:<3}  "
              f"{rank * cols:>5}..{(rank + 1) * cols - 1:<5}  {start:>6}..{end - 1:<6}"
              f"  {kv_bytes:>10}")
    print(f"(whole model: {config.num_qo_heads} q heads, {config.num_kv_heads} kv heads, "
          f"{config.intermediate_size} mlp cols, {config.vocab_size} vocab rows, "
          f"{config.kv_bytes_per_token(dtype)} KV bytes/token in {str(dtype)[6:]})")


def generate(model_dir: str, device: str, tp: int) -> tuple[list[list[int]], float, str]:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(model_dir, device=device, tp=tp, **OPTIONS) as llm:
        llm.generate(PROMPTS[:1], params)  # a first pass: warm-up, not timed
        start = time.perf_counter()
        outputs = llm.generate(PROMPTS, params)
        elapsed = time.perf_counter() - start
        budget = llm.engine.kv_budget
        pool = f"{budget.num_pages} pages x {budget.bytes_per_page} B per rank"
    return [out["token_ids"] for out in outputs], elapsed, pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    args = parser.parse_args()
    model_dir = str(example_checkpoint(args.model))
    config = ModelConfig.from_pretrained(model_dir)
    print(f"model: {args.model} ({config.architectures[0]}), device: {args.device}, "
          f"tp: 1 vs {args.tp}\n")
    print(f"what each of {args.tp} ranks holds:")
    print_split(config, args.tp, resolve_dtype("auto", resolve_device(args.device)))

    single, single_s, single_pool = generate(model_dir, args.device, 1)
    split, split_s, split_pool = generate(model_dir, args.device, args.tp)
    print(f"\n{len(PROMPTS)} prompts, 12 greedy tokens each")
    print(f"{'prompt':<36} {'first tokens (TP=1)':<26} same at TP={args.tp}")
    for prompt, a, b in zip(PROMPTS, single, split):
        print(f"{prompt:<36} {str(a[:4])[1:-1] + ', ...':<26} {'yes' if a == b else 'NO'}")
    same = sum(a == b for a, b in zip(single, split))
    print(f"\nidentical outputs: {same} of {len(PROMPTS)}")
    print(f"KV pool, TP=1: {single_pool}")
    print(f"KV pool, TP={args.tp}: {split_pool}")
    print(f"time for the batch: TP=1 {single_s:.2f} s, TP={args.tp} {split_s:.2f} s")


if __name__ == "__main__":
    main()
