"""Time the three MoE computations of chapter 18 on one layer of a checkpoint's shape.

    python benchmark/moe_paths.py --model models/qwen3-moe-like            # a GPU, bf16
    python benchmark/moe_paths.py --model models/tiny-qwen3-moe --device cpu --dtype float32

For each token count ``T`` the script draws one batch of hidden states and router logits (fixed
seed), routes it with the engine's own router, and times every path on the same routing:

* ``reference``: the per-expert loop (:func:`~minisgl.moe.reference.moe_reference`);
* ``grouped``: the rows sorted by expert and one grouped matrix multiply per projection
  (:func:`~minisgl.moe.grouped.moe_grouped`, ``torch.nn.functional.grouped_mm``);
* ``fused``: the Triton kernels (:func:`~minisgl.kernel.moe.moe_fused`), eagerly and replayed
  from a CUDA graph captured for that ``T`` (the way the engine runs a decode step).

Each time is the median of ``--repeats`` runs, each run timed by CUDA events (on a CPU, by the
wall clock). Every output is compared with the reference's (largest difference, relative to the
reference's largest value). On a GPU each row also gives the *floor*: the bytes of the experts
that ``T`` tokens really visit (only those are read), at the device's measured copy bandwidth.
The layer's weights are random: the time of a matrix multiply does not depend on their values.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a clone without installing: the repository's minisgl
sys.path.insert(0, str(HERE))  # sibling scripts (offline.py)

DEFAULT_TOKENS = "1,8,32,128,512,2048,8192"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Time the MoE paths (reference loop, grouped matrix multiply, fused Triton "
                    "kernels) on one layer of a checkpoint's shape.")
    parser.add_argument("--model", default="models/qwen3-moe-like",
                        help="a Qwen3-MoE checkpoint directory: only its config.json is read")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--tokens", default=DEFAULT_TOKENS,
                        help=f"comma-separated token counts T (default {DEFAULT_TOKENS})")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per path and T")
    parser.add_argument("--reference-max-tokens", type=int, default=2048,
                        help="skip the per-expert loop above this T (it is slow and says nothing "
                             "new there)")
    return parser


def timed_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs, after two warm-up runs."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(samples)


def graph_of(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """``fn`` captured in a CUDA graph: a replay function and the tensor it writes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph (Triton compiles here)
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay, out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.float().abs().max().item() or 1.0
    return (out.float() - ref.float()).abs().max().item() / scale


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        token_counts = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    if min(token_counts) < 1 or args.repeats < 1:
        parser.error("token counts and --repeats must be >= 1")

    from minisgl.layers import fast
    from minisgl.moe.grouped import moe_grouped
    from minisgl.moe.layer import moe_kernel
    from minisgl.moe.reference import moe_reference
    from minisgl.moe.router import route_topk
    from minisgl.utils.hf import load_hf_config
    from minisgl.utils.torch_utils import resolve_device

    config = load_hf_config(args.model)
    for key in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"):
        if key not in config:
            parser.error(f"{args.model}/config.json has no {key!r}: not a Qwen3-MoE checkpoint")
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    num_experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    renormalize = bool(config.get("norm_topk_prob", True))
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)

    gen = torch.Generator(device="cpu").manual_seed(0)
    # Scaled like trained weights (std 1/sqrt(fan-in)) so activations stay O(1) in bf16.
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5)
    gate_up, down = gate_up.to(device, dtype), down.to(device, dtype)
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()

    bandwidth = None
    if device.type == "cuda":
        from offline import copy_bandwidth

        bandwidth = copy_bandwidth(device)
        print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; "
              f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)")
    else:
        print(f"device: CPU, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(f"layer: {num_experts} experts, top-{top_k}, hidden {hidden}, intermediate {inter}, "
          f"{args.dtype}; {expert_bytes / 2**20:.1f} MiB per expert; median of "
          f"{args.repeats} runs")
    fused_ok = fast.paths.can_moe(torch.empty(1, device=device, dtype=dtype))
    columns = ["T", "experts hit", "floor ms", "reference ms", "grouped ms", "fused ms",
               "fused graph ms", "max rel. err (grouped, fused)"]
    print(" | ".join(columns))
    rows: list[dict[str, Any]] = []
    for T in token_counts:
        x = torch.randn(T, hidden, generator=gen).to(device, dtype)
        logits = torch.randn(T, num_experts, generator=gen).to(device, dtype)
        routing = route_topk(logits, top_k, renormalize)
        hit = int(routing.expert_ids.unique().numel())
        row: dict[str, Any] = {"tokens": T, "experts_hit": hit}
        if bandwidth is not None:
            row["floor_ms"] = 1e3 * hit * expert_bytes / bandwidth
        paths: dict[str, Callable[[], torch.Tensor]] = {
            "grouped": lambda: moe_grouped(x, gate_up, down, routing)}
        if T <= args.reference_max_tokens:
            paths["reference"] = lambda: moe_reference(x, gate_up, down, routing)
        if fused_ok:
            paths["fused"] = lambda: moe_kernel(x, gate_up, down, routing)
        outputs = {name: fn() for name, fn in paths.items()}
        for name, fn in paths.items():
            row[f"{name}_ms"] = timed_ms(fn, device, args.repeats)
        if fused_ok:
            replay, out = graph_of(paths["fused"])
            row["fused_graph_ms"] = timed_ms(replay, device, args.repeats)
            outputs["fused_graph"] = out
        base = outputs.get("reference", outputs["grouped"])
        row["errors"] = {name: relative_error(out, base) for name, out in outputs.items()
                         if out is not base}
        rows.append(row)
        errs = ", ".join(f"{row['errors'][n]:.1e}" for n in ("grouped", "fused")
                         if n in row["errors"])
        cells = [str(T), str(hit)] + [
            f"{row[key]:.3f}" if key in row else "-"
            for key in ("floor_ms", "reference_ms", "grouped_ms", "fused_ms", "fused_graph_ms")]
        print(" | ".join(cells + [errs or "-"]))

    return rows


if __name__ == "__main__":
    main()
