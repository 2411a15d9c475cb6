"""Time the one-row matrix kernel's tilings on a model's batch-1 products, weights not in L2.

For each product a decode step at batch 1 makes (qkv, o, gate_up, down with the activation
folded in, and the LM head's float32 logits), every tiling ``(BLOCK_N, BLOCK_K, warps)`` is
captured in a CUDA graph that multiplies by enough distinct copies of the weight to overflow
L2, as a decode step reads each weight once. The table gives microseconds per product (launch
gap inside a graph included) and the weight bytes read per second, for the tiling the kernel
uses (``minisgl.kernel.gemv.TILES``) and the fastest three, against the device's copy bandwidth.

    python benchmark/gemv_tiling.py --model models/qwen3-0.6b-like
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the benchmark's sibling modules, also when imported by path
    sys.path.insert(0, str(HERE))
try:
    import minisgl  # noqa: F401
except ImportError:  # run from a checkout that was not pip-installed
    sys.path.insert(0, str(HERE.parent))

L2_OVERFLOW_BYTES = 256 << 20  # several times any GPU's L2: each replay reads from HBM
REPLAYS = 20


def tilings() -> list[tuple[int, int, int]]:
    """Rows a program, columns a step, warps: each thread holding 8 to 64 weights a step."""
    return [(n, k, w) for n, k, w in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024),
                                                       (1, 2, 4, 8))
            if 8 <= n * k / (32 * w) <= 64]


def graph_us(fn: Callable[[], None], calls: int) -> float:
    """Microseconds per call of ``fn``'s ``calls`` launches, replayed from a CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPLAYS / calls)
    return statistics.median(times)


def products(model: str) -> list[tuple[str, int, int, bool, bool]]:
    """``(name, N, K, gated, float32 out)`` of each batch-1 product of the checkpoint."""
    from minisgl.models.config import ModelConfig

    c = ModelConfig.from_pretrained(model)
    qkv = (c.num_qo_heads + 2 * c.num_kv_heads) * c.head_dim
    return [("qkv_proj", qkv, c.hidden_size, False, False),
            ("o_proj", c.hidden_size, c.num_qo_heads * c.head_dim, False, False),
            ("gate_up_proj", 2 * c.intermediate_size, c.hidden_size, False, False),
            ("down_proj (gated)", c.hidden_size, c.intermediate_size, True, False),
            ("lm_head (float32)", c.vocab_size, c.hidden_size, False, True)]


def time_product(n: int, k: int, gated: bool, float32: bool,
                 tiles: Sequence[tuple[int, int, int]]) -> dict[tuple[int, int, int], float]:
    """Microseconds per product for each tiling, the weights read from HBM each time."""
    import torch

    from minisgl.kernel.gemv import gemv

    copies = max(1, -(-L2_OVERFLOW_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    x = torch.randn(1, 2 * k if gated else k, dtype=torch.bfloat16, device="cuda")
    out_dtype = torch.float32 if float32 else None
    result = {}
    for t in tiles:
        result[t] = graph_us(lambda: [gemv(x, w, out_dtype, gated, tiles=t) for w in weights],
                             copies)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmark/gemv_tiling.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/qwen3-0.6b-like", help="a checkpoint directory")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        parser.error("the kernel is a GPU kernel: run this on a machine with a CUDA GPU")
    from offline import copy_bandwidth

    from minisgl.kernel.gemv import TILES

    bandwidth = copy_bandwidth(torch.device("cuda")) / 2  # read + written: what one read gets
    print(f"device: {torch.cuda.get_device_name()}; model: {args.model}; copy bandwidth "
          f"{bandwidth * 2 / 1e9:.0f} GB/s read + written, so {bandwidth / 1e9:.0f} GB/s a read")
    candidates = sorted(set(tilings()) | {TILES})
    print(f"{'product':<20}{'N x K':>16}{'tiles':>16}{'us':>8}{'GB/s':>7}   fastest three")
    for name, n, k, gated, float32 in products(args.model):
        times = time_product(n, k, gated, float32, candidates)
        best = sorted(times, key=times.get)[:3]
        gbs = {t: n * k * 2 / (times[t] * 1e-6) / 1e9 for t in times}
        ranked = ", ".join(f"{t} {times[t]:.2f} us {gbs[t]:.0f} GB/s" for t in best)
        print(f"{name:<20}{f'{n} x {k}':>16}{str(TILES):>16}{times[TILES]:>8.2f}"
              f"{gbs[TILES]:>7.0f}   {ranked}", flush=True)


if __name__ == "__main__":
    main()
