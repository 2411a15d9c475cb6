"""What constrained decoding costs: the standard offline workload with 0%, 50% and 100% of its
requests under a JSON schema, with overlap scheduling on and off, and the host's time per mask.

The workload is ``offline.py``'s (random prompts and output lengths, ``ignore_eos``); a
constrained request's output must follow :data:`SCHEMA`, an array of integers, so it runs to its
length like the others unless the model closes the array (a model that never learned JSON
closes it early, and its outputs then are shorter). So each constrained run is compared with a
free run of the same requests at the same output lengths: the ratio is what the masks cost for
the same tokens. Every request outside a grammar pays nothing by design (no mask, no early
read); at 50% it shares its batches with constrained ones, and the ratio shows what that costs
it. The mask row times llguidance filling one row of the bitmask on this host, along one output
of the schema.

    python benchmark/structured_cost.py --model models/tiny-qwen3 --device cpu --num-requests 16
    python benchmark/structured_cost.py --model models/qwen3-0.6b-like --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the benchmark's sibling modules, also when imported by path
    sys.path.insert(0, str(HERE))
try:
    import minisgl  # noqa: F401
except ImportError:  # run from a checkout that was not pip-installed
    sys.path.insert(0, str(HERE.parent))

SCHEMA = {"type": "object", "properties": {"values": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999999}}},
    "required": ["values"]}
SHARES = (0.0, 0.5, 1.0)


def run_share(llm: Any, workload: Any, share: float, overlap: bool,
              lengths: Sequence[int] | None = None) -> dict[str, Any]:
    """One timed run of the workload with ``share`` of its requests constrained (every
    ``1 / share``-th, spread through the batch), each request's output at most its workload
    length, or ``lengths[i]`` where given."""
    from offline import empty_prefix_cache, set_overlap, synchronize

    from minisgl.core import SamplingParams
    from minisgl.grammar import json_schema_grammar

    grammar = json_schema_grammar(SCHEMA)
    count = round(share * workload.num_requests)
    chosen = {int(i * workload.num_requests / count) for i in range(count)} if count else set()
    params = [SamplingParams(max_tokens=n, ignore_eos=True,
                             grammar=grammar if i in chosen else None)
              for i, n in enumerate(lengths or workload.output_lens)]
    set_overlap(llm.scheduler, overlap)
    empty_prefix_cache(llm.scheduler)
    synchronize(llm.engine.device)
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, progress=False)
    synchronize(llm.engine.device)
    wall = time.perf_counter() - start
    made = [len(out["token_ids"]) for out in outputs]
    return {"constrained": share, "overlap": overlap, "wall_s": wall, "tokens": sum(made),
            "tok_per_s": sum(made) / wall, "lengths": made}


def mask_us(llm: Any, steps: int = 64) -> float:
    """Median microseconds llguidance takes to fill one bitmask row for :data:`SCHEMA`, at
    each step of an output it allows."""
    import llguidance.torch
    import torch

    from minisgl.grammar import json_schema_grammar

    state = llm.scheduler.grammars.start(json_schema_grammar(SCHEMA))
    tokenizer = llm.scheduler.grammars.tokenizer
    text = '{"values": [' + ", ".join(str(17 * i) for i in range(steps)) + "]}"
    row = torch.zeros(llguidance.torch.get_bitmask_shape(1, llm.engine.model_config.vocab_size),
                      dtype=torch.int32)
    times = []
    for token in tokenizer.tokenize_str(text)[:steps]:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(state.matcher, row, 0)
        times.append(1e6 * (time.perf_counter() - start))
        state.matcher.consume_token(token)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/tiny-qwen3")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from offline import make_workload, warm_up_minisgl

    from minisgl.llm import LLM

    rows = []
    with LLM(args.model, device=args.device, dtype=args.dtype) as llm:
        workload = make_workload(args.num_requests, args.min_len, args.max_len, args.seed,
                                 llm.engine.model_config.vocab_size)
        warm_up_minisgl(llm)
        print(f"{args.num_requests} requests on {llm.engine.device}; one mask row: "
              f"{mask_us(llm):.0f} us (median)")
        print(f"{'constrained':>11} {'overlap':>7} {'tokens':>8} {'tok/s':>9} "
              f"{'free tok/s':>10} {'ratio':>6}")
        for overlap in (True, False):
            for share in SHARES:
                row = run_share(llm, workload, share, overlap)
                free = row if share == 0 else run_share(llm, workload, 0.0, overlap,
                                                         row["lengths"])
                if free["tokens"] != row["tokens"]:
                    raise RuntimeError(f"the free run made {free['tokens']} tokens, the "
                                       f"constrained one {row['tokens']}")
                row["free_tok_per_s"] = free["tok_per_s"]
                row["vs_unconstrained"] = row["tok_per_s"] / free["tok_per_s"]
                rows.append(row)
                print(f"{share:11.0%} {'on' if overlap else 'off':>7} {row['tokens']:8d} "
                      f"{row['tok_per_s']:9.1f} {row['free_tok_per_s']:10.1f} "
                      f"{row['vs_unconstrained']:6.2f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
