"""Chapter 20's ablation: the kernels added one step at a time, each measured in one run.

Row 0 is the plain engine (PyTorch layers, FlashInfer attention, CUDA graphs); each next row
turns on one more of ``minisgl.kernel.trials.STEPS``, in the chapter's order. For each row an
engine is started with exactly those kernels (a graph replays what it captured, so the switch
is set before the capture) and measured:

* kernels per decode step and device-busy time per step at batch 1, under ``torch.profiler``
  (``profile_decode.profile_batch``, ``--context-len`` tokens of context);
* batch-1 milliseconds per decode step as ``LLM.generate`` runs it (``decode_latency``);
* with ``--offline``, the standard offline workload's output tokens per second and its share
  of the HBM floor (``offline.run_minisgl``, overlap and the radix cache on).

    python benchmark/kernel_steps.py --model models/qwen3-0.6b-like --offline --out steps.json
    python benchmark/kernel_steps.py --model models/tiny-qwen3 --device cpu   # plumbing only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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


def measure_row(steps: Sequence[str], args: argparse.Namespace,
                bandwidth: float | None) -> dict[str, Any]:
    """One engine with exactly ``steps`` on: its batch-1 profile, latency and throughput."""
    from decode_latency import decode_step_ms
    from offline import free_device_memory, make_workload, resolve_device, run_minisgl
    from profile_decode import profile_batch

    from minisgl.kernel import use_fused
    from minisgl.llm import LLM

    row: dict[str, Any] = {"steps": list(steps)}
    with use_fused(steps):
        # A small pool: the batch-1 measurements need little, and the offline run's engine
        # must find the memory free while this one is being collected.
        with LLM(args.model, device=args.device, memory_fraction=0.2) as llm:
            engine = llm.engine
            weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
            profile_args = argparse.Namespace(steps=10, profile_steps=5, seed=0,
                                              context_len=args.context_len)
            profiled = profile_batch(engine, 1, profile_args, bandwidth, weights)
            row["kernels_per_step"] = profiled["profile"]["kernels_per_step"]
            row["device_busy_ms"] = profiled["profile"]["device_busy_ms"]
            row["graph_step_ms"] = profiled["graph_step_ms"]
            prompt = list(range(1, args.prompt_len + 1))
            row["decode_ms"] = statistics.median(
                decode_step_ms(llm, prompt, args.max_tokens, repeats=3))
            vocab_size = engine.model_config.vocab_size
        del llm, engine  # the offline run below needs the memory this engine's pool holds
        free_device_memory(resolve_device(args.device))
        if args.offline:
            load = make_workload(args.num_requests, args.min_len, args.max_len, args.seed,
                                 vocab_size)
            results: list[Any] = []
            offline_args = argparse.Namespace(model=args.model, device=args.device, dtype="auto",
                                              tp=1, no_progress=True)
            run_minisgl(offline_args, load, ["overlap+radix"], bandwidth, results.append)
            (result,) = results
            row["offline_tok_per_s"] = result.tok_per_s
            row["offline_floor_share"] = result.decode.floor_fraction if result.decode else None
    return row


def format_row(name: str, row: dict[str, Any]) -> str:
    graph = row["graph_step_ms"]
    text = (f"{name:<14}{row['kernels_per_step']:>9.0f}{row['device_busy_ms']:>12.3f}"
            f"{'-' if graph is None else f'{graph:.3f}':>12}{row['decode_ms']:>12.3f}")
    if "offline_tok_per_s" in row:
        share = row["offline_floor_share"]
        text += f"{row['offline_tok_per_s']:>12.0f}{'-' if share is None else f'{share:.1%}':>9}"
    return text


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    from minisgl.kernel.trials import STEPS

    parser = argparse.ArgumentParser(prog="python benchmark/kernel_steps.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/qwen3-0.6b-like", help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help="the steps to add, in order (default: all of %(default)s)")
    parser.add_argument("--context-len", type=int, default=1024,
                        help="prompt tokens of the profiled batch-1 request (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=32,
                        help="decode_latency's prompt (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="decode_latency's tokens (default: %(default)s)")
    parser.add_argument("--offline", action="store_true",
                        help="also run the standard offline workload for every row")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    if unknown := set(steps) - set(STEPS):
        parser.error(f"unknown steps {sorted(unknown)}; known: {', '.join(STEPS)}")
    from offline import copy_bandwidth, resolve_device

    device = resolve_device(args.device)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    header = f"{'kernels on':<14}{'kernels':>9}{'device ms':>12}{'graph ms':>12}{'decode ms':>12}"
    if args.offline:
        header += f"{'tok/s':>12}{'floor':>9}"
    print(f"model {args.model} on {device}; batch 1: kernels and device-busy ms per step at "
          f"{args.context_len} context tokens, graph ms per step there, decode ms per step "
          f"through LLM.generate ({args.prompt_len}-token prompt, {args.max_tokens} tokens)")
    print(header, flush=True)
    rows = []
    for n in range(len(steps) + 1):
        row = measure_row(steps[:n], args, bandwidth)
        rows.append(row)
        print(format_row("plain" if n == 0 else f"+ {steps[n - 1]}", row), flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
