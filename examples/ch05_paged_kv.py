"""Chapter 5: the paged KV cache, with requests coming and going.

Twelve requests of random lengths share one KV pool. Eight arrive, three finish, four more
arrive, then everyone decodes a few tokens. The same story runs with 1-token and with 16-token
pages; then the memory that reserving a maximum length per request would have wasted is set
against what the pages waste, and K/V vectors make a round trip through the page table.

    python examples/ch05_paged_kv.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch

from minisgl.kvcache import MHAKVPool, PageAllocator
from minisgl.models.config import ModelConfig
from minisgl.kvcache.page_table import PageTable
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import configure_cpu_threads, resolve_device, resolve_dtype

MAX_LEN = 512  # the longest a request may become (prompt + output)
BUDGET = 8 * 2**20  # bytes of KV cache, the same for every layout compared below
NUM_REQS, SEED, DECODE_STEPS = 12, 0, 20


@dataclass
class Request:
    name: str
    prompt_len: int
    length: int = 0  # tokens whose K/V are in the cache
    row: int = -1  # its page table row while it runs


def serve(table: PageTable, alloc: PageAllocator, req: Request, new_length: int) -> int:
    """Grow ``req`` to ``new_length`` tokens: allocate the pages it lacks; returns how many."""
    need = table.pages_needed(req.row, new_length)
    table.append_pages(req.row, alloc.alloc(need))
    req.length = new_length
    return need


def simulate(page_size: int, prompt_lens: list[int], config: ModelConfig, dtype: torch.dtype,
             device: torch.device, show_rows: bool
             ) -> tuple[PageTable, PageAllocator, list[Request]]:
    num_pages = MHAKVPool.num_pages_for_budget(BUDGET, config, page_size, dtype)
    alloc = PageAllocator(num_pages)
    table = PageTable(max_reqs=NUM_REQS, max_pages_per_req=MAX_LEN // page_size,
                      page_size=page_size, device=device)
    reqs = [Request(f"r{i}", n) for i, n in enumerate(prompt_lens)]
    print(f"\npage size {page_size}: {num_pages} pages of {page_size} token(s)")

    def arrive(batch: list[Request]) -> None:
        for req in batch:
            req.row = table.alloc_row()
            serve(table, alloc, req, req.prompt_len)  # prefill: the whole prompt at once

    def report(event: str) -> None:
        print(f"  {event:<38} free pages {alloc.num_free:>5} / {num_pages}")

    arrive(reqs[:8])
    report("r0..r7 arrive")
    for req in (reqs[1], reqs[4], reqs[6]):
        alloc.free(table.free_row(req.row))  # finished: the row and its pages go back
        req.row = -1
    report("r1, r4, r6 finish")
    arrive(reqs[8:])
    report("r8..r11 arrive (reusing rows, pages)")
    live = [r for r in reqs if r.row >= 0]
    new_pages = sum(serve(table, alloc, r, r.length + DECODE_STEPS) for r in live)
    report(f"{len(live)} decode {DECODE_STEPS} tokens (+{new_pages} pages)")
    if show_rows:
        for req in sorted(live, key=lambda r: r.row):
            pages = " ".join(str(p) for p in table.row_pages(req.row).tolist())
            print(f"    row {req.row:>2}  {req.name:<3} {req.length:>3} tokens  [{pages}]")
    return table, alloc, live


def round_trip(config: ModelConfig, table: PageTable, live: list[Request], dtype: torch.dtype,
               device: torch.device, num_pages: int) -> tuple[float, bool]:
    """Store random K/V through the page table, read it back; (max |diff|, slots disjoint)."""
    pool = MHAKVPool.from_config(config, num_pages, table.page_size, dtype, device)
    generator = torch.Generator().manual_seed(SEED)
    shape = (config.num_kv_heads, config.head_dim)
    written = {r.name: [(torch.randn(r.length, *shape, generator=generator),
                         torch.randn(r.length, *shape, generator=generator))
                        for _ in range(config.num_layers)] for r in live}
    rows, lengths = [r.row for r in live], [r.length for r in live]
    out_loc = table.batch_token_slots(rows, [0] * len(live), lengths)  # every token, one call
    for layer in range(config.num_layers):
        k = torch.cat([written[r.name][layer][0] for r in live]).to(device, dtype)
        v = torch.cat([written[r.name][layer][1] for r in live]).to(device, dtype)
        pool.store_kv(k, v, out_loc, layer)
    worst = 0.0
    for req in live:  # read back one request at a time, as attention does
        slots = table.token_slots(req.row, 0, req.length)
        for layer in range(config.num_layers):
            k, v = pool.gather_kv(slots, layer)
            k_in, v_in = (t.to(device, dtype) for t in written[req.name][layer])
            worst = max(worst, (k - k_in).abs().max().item(), (v - v_in).abs().max().item())
    return worst, len(set(out_loc.tolist())) == len(out_loc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = parser.parse_args()
    configure_cpu_threads()  # share the cores with the rest of the machine
    model_dir = example_checkpoint(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    per_token = config.kv_bytes_per_token(dtype)
    print(f"model: {args.model} ({config.num_layers} layers, {config.num_kv_heads} KV heads x "
          f"{config.head_dim}), device: {device}, dtype: {str(dtype).removeprefix('torch.')}")
    print(f"KV bytes per token: {per_token:,}; budget {BUDGET / 2**20:.0f} MiB = "
          f"{BUDGET // per_token:,} token slots")

    rng = random.Random(SEED)
    # Prompts well below MAX_LEN, as most are; a contiguous cache must still reserve MAX_LEN.
    prompt_lens = [rng.randint(8, 240) for _ in range(NUM_REQS)]
    print("prompt lengths: " + " ".join(f"r{i}={n}" for i, n in enumerate(prompt_lens)))

    results = {ps: simulate(ps, prompt_lens, config, dtype, device, show_rows=ps == 16)
               for ps in (1, 16)}

    live = results[16][2]
    used = sum(r.length for r in live)
    print(f"\nmemory for the {len(live)} live requests ({used:,} tokens):")
    print(f"  {'layout':<30} {'slots held':>10} {'wasted':>8}")
    held = len(live) * MAX_LEN
    print(f"  {f'contiguous, {MAX_LEN} per request':<30} {held:>10,} {held - used:>8,} "
          f"({(held - used) / held:.0%})  fits {BUDGET // per_token // MAX_LEN} requests")
    for ps, (table, alloc, _) in results.items():
        held = alloc.num_used * ps
        print(f"  {f'paged, {ps}-token pages':<30} {held:>10,} {held - used:>8,} "
              f"({(held - used) / held:.0%})  {alloc.num_free * ps:,} slots still free")

    print("\nstore/gather round trip through the page table (every layer):")
    for ps, (table, alloc, live) in results.items():
        worst, disjoint = round_trip(config, table, live, dtype, device, alloc.num_pages)
        print(f"  page size {ps:>2}: {sum(r.length for r in live):,} tokens, "
              f"max |read - written| = {worst}, no slot shared: {disjoint}")
    for ps, (table, alloc, live) in results.items():
        for req in live:
            alloc.free(table.free_row(req.row))
        print(f"all finished, page size {ps:>2}: {alloc.num_free} / {alloc.num_pages} pages free")


if __name__ == "__main__":
    main()
