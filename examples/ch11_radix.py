"""Chapter 11: the radix cache: eight requests that share a system prompt.

Every request starts with the same 30-token system prompt and ends with a question of its own.
The first request runs alone to its end; the other seven then arrive together. The workload runs
twice, with the naive cache (chapter 9: every prompt computed whole) and with the radix cache,
and the example prints the prompt tokens each request computed, the saving, the saving
predicted from the page size, the tree the radix cache holds afterwards, and that both runs
produced the same tokens.

A request's pages enter the tree when it finishes. The seven late requests find the first
one's pages, but only whole ones: 30 // 4 = 7 pages, 28 tokens each; they arrive together, so
none of them finds another's. The predicted saving is 28 x 7 = 196 tokens.

    python examples/ch11_radix.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse

import torch

from minisgl.core import Req, SamplingParams
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import configure_cpu_threads

PAGE_SIZE = 4
NUM_REQS = 8
SYSTEM_LEN = 30


def workload() -> list[list[int]]:
    """The prompts: the shared system prompt, then a question of 6 to 13 tokens."""
    generator = torch.Generator().manual_seed(0)
    system = torch.randint(100, 2048, (SYSTEM_LEN,), generator=generator).tolist()
    prompts = []
    for i in range(NUM_REQS):
        question = torch.randint(100, 2048, (6 + i,), generator=generator).tolist()
        question[0] = 10 + i  # the questions differ from their first token on
        prompts.append(system + question)
    return prompts


def run(scheduler: Scheduler, prompts: list[list[int]]) -> tuple[list[Req], dict[int, int]]:
    """Request 0 alone to its end, then the rest together; the prompt tokens each computed."""
    reqs = [Req(i, p, SamplingParams(max_tokens=4, ignore_eos=True))
            for i, p in enumerate(prompts)]
    computed = dict.fromkeys(range(len(reqs)), 0)
    for group in (reqs[:1], reqs[1:]):
        for req in group:
            scheduler.add(req)
        while scheduler.has_work:
            result = scheduler.step()
            if result.phase == "prefill":
                for uid, n in zip(result.uids, result.new_lens):
                    computed[uid] += n
    return reqs, computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = parser.parse_args()
    configure_cpu_threads()  # share the cores with the rest of the machine
    model_dir = example_checkpoint(args.model)

    prompts = workload()
    runs = {}
    for kind in ("naive", "radix"):
        scheduler = Scheduler(SchedulerConfig(model_dir, device=args.device, page_size=PAGE_SIZE,
                                              num_pages=64, max_running_reqs=8,
                                              prefix_cache=kind))
        if kind == "naive":
            engine = scheduler.engine
            print(f"model: {args.model} ({engine.model_config.architectures[0]}), device: "
                  f"{engine.device.type}, dtype: {str(engine.dtype)[6:]}")
            print(f"{NUM_REQS} requests: a {SYSTEM_LEN}-token system prompt + a question of "
                  f"6..{5 + NUM_REQS} tokens; pages of {PAGE_SIZE} tokens")
            print("request 0 runs alone to its end, then requests 1..7 arrive together\n")
        runs[kind] = (scheduler, *run(scheduler, prompts))

    print(f"{'uid':>3} {'prompt':>6} {'naive':>6} {'radix':>6}   (prompt tokens computed)")
    for uid, prompt in enumerate(prompts):
        print(f"{uid:>3} {len(prompt):>6} {runs['naive'][2][uid]:>6} {runs['radix'][2][uid]:>6}")
    total = {kind: sum(runs[kind][2].values()) for kind in runs}
    print(f"total {sum(map(len, prompts)):>6} {total['naive']:>6} {total['radix']:>6}")

    shared = SYSTEM_LEN // PAGE_SIZE * PAGE_SIZE  # whole pages only
    predicted = shared * (NUM_REQS - 1)
    saved = total["naive"] - total["radix"]
    print(f"\nsaved: {saved} tokens ({saved / total['naive']:.0%}); predicted: {SYSTEM_LEN} // "
          f"{PAGE_SIZE} x {PAGE_SIZE} = {shared} shared tokens x {NUM_REQS - 1} requests = "
          f"{predicted}: {'exact' if saved == predicted else 'MISMATCH'}")

    scheduler = runs["radix"][0]
    tree = scheduler.cache.prefix_cache
    assert isinstance(tree, RadixCache)
    print("\nthe radix tree after the run (token ids, | between pages):")
    print(tree.pretty(max_tokens=8))
    free = scheduler.cache.pages.num_free
    print(f"pages: {free} free + {tree.num_cached_pages} cached = {scheduler.cache.num_pages}; "
          f"{tree.num_locked_pages} locked")

    same = all(a.output_ids == b.output_ids for a, b in zip(runs["naive"][1], runs["radix"][1]))
    print(f"\noutputs identical with both caches: {same}")


if __name__ == "__main__":
    main()
