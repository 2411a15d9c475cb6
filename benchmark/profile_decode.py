"""Where the time of one decode step goes, at a small and a large batch.

For each batch size of ``--batch-sizes`` (default 1 and 128) the script prefills that many
requests with ``--context-len``-token prompts of random ids, then times whole decode steps
(pages, metadata, forward, sampling, tokens back on the host): replayed from a CUDA graph where
the engine captured one, and run eagerly. ``torch.profiler`` then records a few steps as the
engine runs them (replayed where it can): every kernel on the device, by name and by family,
with its time per step, and beside it the host's work (PyTorch operators and kernel launches). The step is read against its *HBM floor*: the bytes
a decode step cannot avoid reading (every weight once, and the KV of every request's context)
divided by the device's measured copy bandwidth.

    python benchmark/profile_decode.py --model models/qwen3-0.6b-like --out profile.json
    python benchmark/profile_decode.py --batch-sizes 1,4 --context-len 64   # a CPU run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
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

WARMUP_STEPS = 3
PREFILL_CHUNK = 16  # requests prefilled per batch, to keep the prefill's activations small
TOP_KERNELS = 12
TOP_HOST_OPS = 8


def start_requests(engine: Any, batch_size: int, context_len: int, max_tokens: int,
                   seed: int) -> list[Any]:
    """``batch_size`` requests with random prompts, prefilled and ready to decode."""
    import random

    rng = random.Random(f"{seed}:profile:{batch_size}")
    vocab = engine.model_config.vocab_size
    return start_prompts(engine, [[rng.randrange(vocab) for _ in range(context_len)]
                                  for _ in range(batch_size)], max_tokens)


def start_prompts(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    """A request for each prompt, prefilled and ready to decode ``max_tokens`` tokens."""
    from minisgl.core import Batch, Req, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [Req(i, prompt, params) for i, prompt in enumerate(prompts)]
    for first in range(0, len(reqs), PREFILL_CHUNK):
        chunk = reqs[first:first + PREFILL_CHUNK]
        engine.pages.reserve(*chunk)
        batch = Batch(chunk, "prefill")
        tokens = engine.forward(batch).tolist()
        batch.advance()
        for req, token in zip(chunk, tokens):
            req.append_token(token)
    return reqs


def decode_step(engine: Any, reqs: list[Any], use_graph: bool) -> float:
    """One whole decode step, until its tokens are on the host; its seconds."""
    from minisgl.core import Batch

    start = time.perf_counter()
    engine.pages.reserve(*reqs)  # as the scheduler does: one reservation for the batch
    batch = Batch(reqs, "decode")
    tokens = engine.forward(batch, use_graph=use_graph).tolist()
    batch.advance()
    for req, token in zip(reqs, tokens):
        req.append_token(token)
    return time.perf_counter() - start


def median_step_ms(engine: Any, reqs: list[Any], steps: int, use_graph: bool) -> float:
    for _ in range(WARMUP_STEPS):
        decode_step(engine, reqs, use_graph)
    return 1e3 * statistics.median(decode_step(engine, reqs, use_graph) for _ in range(steps))


def _device_us(event: Any) -> float:
    """An event's own time on the device in µs (the attribute's name changed across torch)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


# Kernel families, by a piece of their names: what each share of a step is spent on.
KERNEL_FAMILIES = (
    ("attention", ("BatchDecode", "BatchPrefill", "MergeStates")),
    ("GEMMs", ("nvjet", "gemm", "Gemm", "splitK", "gemv")),
    ("qk-norm + RoPE + K/V store", ("qk_prologue",)),
    ("norms", ("RMSNorm", "rmsnorm")),
    ("SiLU and multiply", ("act_and_mul",)),
    ("copies and indexing", ("index", "copy", "Memcpy", "Memset", "fill")),
)


def kernel_family(name: str) -> str:
    for family, pieces in KERNEL_FAMILIES:
        if any(piece in name for piece in pieces):
            return family
    return "other"


def profile_steps(engine: Any, reqs: list[Any], steps: int, use_graph: bool) -> dict[str, Any]:
    """Decode steps under ``torch.profiler``: the device's kernels by name and by family and
    the host's own time by operator, all per step. Replayed graphs show their kernels too."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    for _ in range(WARMUP_STEPS):
        decode_step(engine, reqs, use_graph)
    with profile(activities=activities) as prof:
        wall = sum(decode_step(engine, reqs, use_graph) for _ in range(steps))
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    host: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device_us = _device_us(event)
        if event.self_cpu_time_total == 0 and device_us > 0:  # a kernel (or a device copy)
            kernels[event.key][0] += event.count / steps
            kernels[event.key][1] += device_us / steps
        elif event.self_cpu_time_total > 0:
            host[event.key] += event.self_cpu_time_total / steps
    busy_us = sum(us for _, us in kernels.values())
    families: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, (calls, us) in kernels.items():
        families[kernel_family(name)][0] += calls
        families[kernel_family(name)][1] += us
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return {
        "graph": use_graph, "step_ms": 1e3 * wall / steps, "device_busy_ms": busy_us / 1e3,
        "kernels_per_step": sum(n for n, _ in kernels.values()),
        "families": [{"name": name, "calls": calls, "us": us, "share": us / busy_us}
                     for name, (calls, us) in sorted(families.items(), key=lambda kv: -kv[1][1])],
        "kernels": [{"name": name, "calls": calls, "us": us, "share": us / busy_us}
                    for name, (calls, us) in ranked[:TOP_KERNELS]],
        "host_ops": [{"name": name, "us": us} for name, us in
                     sorted(host.items(), key=lambda kv: -kv[1])[:TOP_HOST_OPS]]}


def hbm_floor_ms(weight_bytes: int, kv_bytes_per_token: int, context_tokens: int,
                 bandwidth: float) -> float:
    """The least time a decode step can take: every weight and the KV of every context
    token read once, at the measured bandwidth (bytes per second)."""
    return 1e3 * (weight_bytes + kv_bytes_per_token * context_tokens) / bandwidth


def profile_batch(engine: Any, batch_size: int, args: argparse.Namespace,
                  bandwidth: float | None, weight_bytes: int) -> dict[str, Any]:
    graph_ok = engine.graph_runner.enabled
    # Enough tokens for the warm-ups, the timed steps of both modes and the profiled ones.
    budget = 4 * WARMUP_STEPS + 2 * args.steps + args.profile_steps + 2
    reqs = start_requests(engine, batch_size, args.context_len, budget, args.seed)
    eager_ms = median_step_ms(engine, reqs, args.steps, use_graph=False)
    graph_ms = median_step_ms(engine, reqs, args.steps, use_graph=True) if graph_ok else None
    profiled = profile_steps(engine, reqs, args.profile_steps, use_graph=graph_ok)
    context = sum(r.num_tokens for r in reqs)
    kv_bytes = engine.model_config.kv_bytes_per_token(engine.dtype)
    out = {"batch_size": batch_size, "context_tokens": context, "eager_step_ms": eager_ms,
           "graph_step_ms": graph_ms, "weight_bytes": weight_bytes,
           "kv_bytes": kv_bytes * context, "profile": profiled}
    if bandwidth is not None:
        out["hbm_floor_ms"] = hbm_floor_ms(weight_bytes, kv_bytes, context, bandwidth)
    for req in reqs:
        engine.pages.release(req)
    return out


def describe(result: dict[str, Any]) -> str:
    p = result["profile"]
    graph = result["graph_step_ms"]
    floor = result.get("hbm_floor_ms")
    best = graph if graph is not None else result["eager_step_ms"]
    mode = "graph" if p["graph"] else "eager"
    lines = [
        f"batch {result['batch_size']} ({result['context_tokens']} context tokens): step "
        f"{'graph ' + format(graph, '.2f') + ' ms, ' if graph is not None else ''}eager "
        f"{result['eager_step_ms']:.2f} ms"
        + (f"; HBM floor {floor:.3f} ms (weights {result['weight_bytes'] / 2**20:.0f} MiB + "
           f"KV {result['kv_bytes'] / 2**20:.0f} MiB) = {100 * floor / best:.0f}% of the "
           "best step" if floor is not None else ""),
        f"  profiled {mode} step: {p['step_ms']:.2f} ms on the host clock, device busy "
        f"{p['device_busy_ms']:.3f} ms in {p['kernels_per_step']:.0f} kernels"]
    if p["kernels"]:
        lines.append(f"  {'kernel family (device)':<60} {'calls':>5} {'us/step':>8} {'share':>6}")
        for k in p["families"]:
            lines.append(f"  {k['name'][:60]:<60} {k['calls']:>5.0f} {k['us']:>8.1f} "
                         f"{100 * k['share']:>5.1f}%")
        lines.append(f"  {'kernel (device)':<60} {'calls':>5} {'us/step':>8} {'share':>6}")
        for k in p["kernels"]:
            lines.append(f"  {k['name'][:60]:<60} {k['calls']:>5.0f} {k['us']:>8.1f} "
                         f"{100 * k['share']:>5.1f}%")
    lines.append(f"  {'host operator (own time)':<60} {'us/step':>14}")
    for op in p["host_ops"]:
        lines.append(f"  {op['name'][:60]:<60} {op['us']:>14.1f}")
    return "\n".join(lines)


def batch_sizes(text: str) -> list[int]:
    """``--batch-sizes``: comma-separated positive integers, sorted, each once."""
    try:
        sizes = sorted({int(size) for size in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected, got {text!r}")
    if sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def decode_batch_parser(script: str, doc: str, sizes: str, steps: int,
                        steps_help: str) -> argparse.ArgumentParser:
    """The options every decode-step benchmark shares: model, batch sizes, context, steps.

    ``script`` names the benchmark's file; the first line of its ``doc`` describes it."""
    parser = argparse.ArgumentParser(prog=f"python benchmark/{script}",
                                     description=doc.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--batch-sizes", type=batch_sizes, default=sizes,
                        help="decode batch sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--context-len", type=int, default=1024,
                        help="prompt tokens of every request (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=steps,
                        help=f"{steps_help} (default: %(default)s)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = decode_batch_parser("profile_decode.py", __doc__, "1,128", 20,
                                 "timed steps per mode")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--profile-steps", type=int, default=5,
                        help="steps under the profiler, replayed where a graph is captured "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    sizes = args.batch_sizes
    if args.context_len < 1 or args.steps < 1 or args.profile_steps < 1:
        parser.error("--context-len, --steps and --profile-steps must be >= 1")
    import torch

    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine
    from offline import copy_bandwidth, header_info
    from minisgl.utils.hf import load_hf_config

    engine = Engine(EngineConfig(args.model, device=args.device, cuda_graph_batch_sizes=sizes,
                                 max_running_reqs=max(sizes)))
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    bandwidth = copy_bandwidth(engine.device) if engine.device.type == "cuda" else None
    report: dict[str, Any] = {
        "header": header_info(Path(args.model), load_hf_config(args.model), engine.device,
                              engine.dtype),
        "context_len": args.context_len, "copy_bandwidth_bytes_per_s": bandwidth,
        "cuda_graph": engine.graph_runner.enabled, "results": []}
    h = report["header"]
    print(f"device: {h['device']}; model: {h['model']} ({h['architecture']}), {h['dtype']}; "
          f"torch {torch.__version__}")
    if bandwidth is not None:
        print(f"device copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + written)")
    print(f"decode steps at batch {', '.join(map(str, sizes))}, {args.context_len}-token "
          f"prompts; median of {args.steps} steps, {args.profile_steps} steps profiled "
          "(graph replays where captured)\n",
          flush=True)
    for size in sizes:
        result = profile_batch(engine, size, args, bandwidth, weight_bytes)
        report["results"].append(result)
        print(describe(result), flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
