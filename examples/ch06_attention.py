"""Chapter 6: paged attention backends against a dense reference.

A handful of requests of different lengths get pages scattered over a KV pool; some already
have tokens there (a cached prefix, or the past of a decode step). Each available backend then
runs one batched forward pass of their new tokens, and its output is compared with plain causal
attention over each request's whole sequence. Then the tiny model runs a batch of prompts
through the paged backend and its logits are compared with one-prompt-at-a-time dense attention.

    python examples/ch06_attention.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from minisgl.attention import create_attention_backend, layout_of, total_lens
from minisgl.attention.fi import page_arrays
from minisgl.attention.utils import indptr_of
from minisgl.kvcache import MHAKVPool
from minisgl.layers.attention import DenseCausalAttention, use_attention_backend
from minisgl.models import load_model
from minisgl.models.config import ModelConfig
from minisgl.kvcache.page_table import PageTable, pages_for
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import configure_cpu_threads, resolve_device, resolve_dtype

SEED = 0
# (cached_len, new_len) per request, for three kinds of batch.
CASES = {
    "prefill": [(0, 7), (0, 1), (0, 24), (0, 16)],
    "cached prefix + new": [(5, 1), (17, 9), (32, 16), (3, 20)],
    "decode": [(6, 1), (0, 1), (15, 1), (16, 1), (40, 1)],
}


class Batch:
    """A pool and a page table holding some requests, with random q/k/v for their tokens."""

    def __init__(self, case: list[tuple[int, int]], page_size: int, config: ModelConfig,
                 dtype: torch.dtype, device: torch.device, is_decode: bool) -> None:
        generator = torch.Generator().manual_seed(SEED)
        totals = [c + n for c, n in case]
        num_pages = sum(pages_for(t, page_size) for t in totals) + 4
        self.pool = MHAKVPool(1, config.num_kv_heads, config.head_dim, num_pages, page_size,
                              dtype, device)
        self.table = PageTable(len(case), pages_for(max(totals), page_size),
                               page_size=page_size, device=device)
        pages = torch.randperm(num_pages, generator=generator).tolist()  # scattered pages
        rows = [self.table.alloc_row() for _ in case]
        for row, total in zip(rows, totals):
            self.table.append_pages(row, [pages.pop() for _ in range(pages_for(total, page_size))])

        def rand(heads: int, t: int) -> torch.Tensor:
            return torch.randn(t, heads, config.head_dim, generator=generator).to(device, dtype)

        self.q = [rand(config.num_qo_heads, t) for t in totals]
        self.k = [rand(config.num_kv_heads, t) for t in totals]
        self.v = [rand(config.num_kv_heads, t) for t in totals]
        for row, (cached, _), k, v in zip(rows, case, self.k, self.v):  # the past is stored
            if cached:
                slots = self.table.token_slots(row, 0, cached)
                self.pool.store_kv(k[:cached], v[:cached], slots, 0)
        self.layout = layout_of(rows, [c for c, _ in case], [n for _, n in case], is_decode)

    def error(self, backend_name: str, num_qo_heads: int) -> float:
        """Max |backend - dense| over the new tokens of every request."""
        backend = create_attention_backend(backend_name, self.pool, self.table, num_qo_heads)
        backend.prepare(self.layout)
        new = [(c, q, k, v) for c, q, k, v in
               zip(self.layout.cached_lens, self.q, self.k, self.v)]
        out = backend.forward(torch.cat([q[c:] for c, q, _, _ in new]),
                              torch.cat([k[c:] for c, _, k, _ in new]),
                              torch.cat([v[c:] for c, _, _, v in new]), 0)
        dense = DenseCausalAttention()
        reference = torch.cat([dense.forward(q, k, v, 0)[c:] for c, q, k, v in new])
        return (out.float() - reference.float()).abs().max().item()


def show_metadata(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    """What prepare() computes for one small batch, with 16-token pages."""
    batch = Batch([(20, 5), (0, 7), (33, 1)], 16, config, dtype, device, is_decode=False)
    backend = create_attention_backend("torch", batch.pool, batch.table, config.num_qo_heads)
    meta = backend.prepare(batch.layout)
    layout, table = batch.layout, batch.table
    print("\none batch, 16-token pages: (row, cached, new) = "
          + ", ".join(f"({r}, {c}, {n})" for r, c, n in
                      zip(layout.rows, layout.cached_lens, layout.new_lens)))
    for row in layout.rows:
        print(f"  row {row} pages {table.row_pages(row).tolist()}")
    print(f"  positions     {meta.positions.tolist()}")
    print(f"  out_loc       {meta.out_loc.tolist()}")
    print(f"  last_indices  {meta.last_indices.tolist()}   (rows whose logits are sampled)")
    print(f"  qo_indptr     {indptr_of(layout.new_lens)}   (new tokens per request)")
    print(f"  kv_indptr     {indptr_of(total_lens(layout))}   (torch: token slots per request)")
    arrays = page_arrays(table, layout)  # FlashInfer's description, built on the host
    print(f"  page_indptr   {arrays['page_indptr'].tolist()}   (FlashInfer: pages per request)")
    print(f"  page_indices  {arrays['page_indices'].tolist()}")
    print(f"  last_page_len {arrays['last_page_lens'].tolist()}")


def compare_backends(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                     backends: list[str]) -> None:
    print(f"\nmax |backend - dense reference| over the new tokens ({str(dtype)[6:]}):")
    print(f"  {'backend':<11}{'page':>5}  " + "".join(f"{name:>22}" for name in CASES))
    for name in backends:
        for page_size in (1, 16):
            errors = [Batch(case, page_size, config, dtype, device, kind == "decode")
                      .error(name, config.num_qo_heads) for kind, case in CASES.items()]
            print(f"  {name:<11}{page_size:>5}  " + "".join(f"{e:>22.2e}" for e in errors))


def compare_model(model_dir: Path, device: torch.device, dtype: torch.dtype,
                  backends: list[str]) -> None:
    """A batch of prompts through the paged backend vs each prompt alone, dense."""
    model = load_model(model_dir, device=device, dtype=dtype, progress=False)
    config = model.config
    generator = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(config.vocab_size, (n,), generator=generator).to(device)
               for n in (9, 1, 23, 16)]
    with torch.no_grad():
        dense = torch.cat([model.forward(p, torch.arange(len(p), device=device)) for p in prompts])
    print(f"\ntiny model, {len(prompts)} prompts of {[len(p) for p in prompts]} tokens in one "
          "batch vs one at a time with dense attention:")
    for name in backends:
        pool = MHAKVPool.from_config(config, 64, 16, dtype, device)
        table = PageTable(len(prompts), 4, page_size=16, device=device)
        free_pages = list(range(pool.num_pages))  # pop() hands them out from the top down
        rows = [table.alloc_row() for _ in prompts]
        for row, prompt in zip(rows, prompts):
            table.append_pages(row, [free_pages.pop() for _ in range(pages_for(len(prompt), 16))])
        backend = create_attention_backend(name, pool, table, config.num_qo_heads)
        meta = backend.prepare(layout_of(rows, [0] * len(prompts), [len(p) for p in prompts]))
        with use_attention_backend(backend), torch.no_grad():
            paged = model.forward(torch.cat(prompts), meta.positions)
        same = (paged.argmax(-1) == dense.argmax(-1)).sum().item()
        print(f"  {name:<11} max |logits paged - dense| = {(paged - dense).abs().max().item():.2e}"
              f", same greedy token at {same}/{len(dense)} positions")
    if dtype != torch.float32:
        print(f"  (largest |logit| {dense.abs().max().item():.2f}; in {str(dtype)[6:]} a near tie "
              "between two tokens can flip)")


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
    print(f"model: {args.model} ({config.num_qo_heads} query heads, {config.num_kv_heads} KV "
          f"heads x {config.head_dim}), device: {device}, dtype: {str(dtype)[6:]}")
    backends = ["torch"]
    if device.type != "cuda":
        print("backends: torch (flashinfer needs a CUDA GPU: skipped)")
    elif importlib.util.find_spec("flashinfer") is None:
        print("backends: torch (flashinfer is not installed: pip install -e '.[gpu]')")
    else:
        backends.append("flashinfer")
        print("backends: torch, flashinfer")
    show_metadata(config, device, dtype)
    compare_backends(config, device, dtype, backends)
    compare_model(model_dir, device, dtype, backends)


if __name__ == "__main__":
    main()
