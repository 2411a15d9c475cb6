"""Chapter 7: the engine, driven by hand: one batched prefill, then batched decode steps.

Three prompts of different lengths are prefilled together in one forward pass and then decoded
together, one token per request per step. Each step prints the batch, the positions the engine
fed, the sampled tokens and the KV pages in use. Then each prompt runs alone, and the tokens
are compared.

    python examples/ch07_engine.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
                                   [--page-size 4] [--steps 8]
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoTokenizer

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import configure_cpu_threads

PROMPTS = [
    "The capital of France is",
    "Hi",
    "Once upon a time, in a land far away, there lived a",
]


def show_budget(engine: Engine) -> None:
    """The arithmetic behind the KV pool's size."""
    b, cfg = engine.kv_budget, engine.model_config
    dtype_bytes = engine.kv_pool.dtype.itemsize
    print(f"KV budget: {b.source}")
    print(f"  budget     {b.budget_bytes:>14,} bytes")
    print(f"  one token  2 (K and V) x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x "
          f"{cfg.head_dim} x {dtype_bytes} bytes = {b.bytes_per_token:,} bytes")
    print(f"  one page   {b.page_size} tokens = {b.bytes_per_page:,} bytes")
    capped = (f", capped at {b.max_useful_pages:,} (every page-table row full, + 1)"
              if b.capped else "")
    print(f"  pages      {b.budget_bytes:,} // {b.bytes_per_page:,} = "
          f"{b.budget_bytes // b.bytes_per_page:,}{capped}")
    print(f"  pool       {b.num_pages:,} pages = {b.num_tokens:,} tokens = "
          f"{b.pool_bytes / 2**20:.1f} MiB; max_seq_len {engine.max_seq_len}")


def spans(values: list[int], lengths: list[int]) -> str:
    """Positions per request, as ``0-4 | 0-11`` for a prefill or ``5 12`` for a decode step."""
    out, start = [], 0
    for n in lengths:
        chunk = values[start:start + n]
        out.append(f"{chunk[0]}-{chunk[-1]}" if n > 1 else str(chunk[0]))
        start += n
    return " ".join(out)


def run_batched(engine: Engine, prompts: list[list[int]], steps: int,
                verbose: bool) -> list[list[int]]:
    """Prefill every prompt in one batch, then decode them together for ``steps`` steps."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    reqs = [Req(uid, ids, params) for uid, ids in enumerate(prompts)]
    if verbose:
        print(f"\n{'step':>4}  {'phase':<7} {'reqs':>4} {'T':>3}  {'positions':<17}"
              f"{'sampled':<20}{'pages used':>10}")
    for step in range(steps + 1):
        live = [r for r in reqs if not r.is_finished]
        if not live:
            break
        new_pages = sum(engine.pages.reserve(r) for r in live)  # pages for this step's new tokens
        batch = Batch(live, "prefill" if step == 0 else "decode")
        lengths = batch.new_lens
        tokens = engine.forward(batch).tolist()
        batch.advance()  # the new tokens are cached now: the loop, not the engine, says so
        for req, token in zip(live, tokens):
            req.append_token(token, engine.eos_token_ids)
        if verbose:
            positions = engine.attn_backend.metadata.positions.tolist()
            used = engine.pages.num_used
            print(f"{step:>4}  {batch.phase:<7} {batch.size:>4} {sum(lengths):>3}  "
                  f"{spans(positions, lengths):<17}{' '.join(f'{t:>4}' for t in tokens):<20}"
                  f"{used:>6} (+{new_pages})")
            if batch.is_prefill:
                last = engine.attn_backend.metadata.last_indices.tolist()
                print(f"{'':>14}rows {[r.table_row for r in live]}, logits of rows {last} "
                      f"of the {sum(lengths)} outputs")
    for req in reqs:
        engine.pages.release(req)
    return [r.output_ids for r in reqs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--page-size", type=int, default=4, help="tokens per KV page")
    parser.add_argument("--steps", type=int, default=8, help="decode steps after the prefill")
    args = parser.parse_args()
    configure_cpu_threads()  # share the cores with the rest of the machine
    model_dir = example_checkpoint(args.model)
    if args.steps < 1:
        sys.exit(f"--steps must be >= 1, got {args.steps}")

    engine = Engine(EngineConfig(model_dir, device=args.device, page_size=args.page_size))
    print(f"model: {args.model} ({engine.model_config.architectures[0]}, "
          f"{engine.model_config.num_layers} layers), device: {engine.device.type}, "
          f"dtype: {str(engine.dtype)[6:]}, attention: {engine.attn_backend.name}")
    show_budget(engine)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    print(f"\nprompts: {', '.join(f'{len(p)} tokens' for p in prompts)} "
          f"({sum(len(p) for p in prompts)} in all); {args.page_size}-token pages")
    free_before = engine.pages.num_free
    batched = run_batched(engine, prompts, args.steps, verbose=True)
    print(f"pages free after release: {engine.pages.num_free} of {free_before}")

    print("\none prompt at a time:")
    differ = 0
    for i, prompt in enumerate(prompts):
        alone = run_batched(engine, [prompt], args.steps, verbose=False)[0]
        differ += alone != batched[i]
        same = "same as batched" if alone == batched[i] else "DIFFERS from batched"
        print(f"  request {i}: {alone}  {same}")
    if differ and engine.dtype != torch.float32:
        print(f"  (in {str(engine.dtype)[6:]} a batch sums in another order than a single "
              "request; a near tie between two tokens can flip)")


if __name__ == "__main__":
    main()
