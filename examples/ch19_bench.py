"""Chapter 19: both benchmarks, small, on the CPU, and one figure from what they recorded.

The offline benchmark runs every ablation on the tiny model: the base engine against one switch
at a time (CUDA graphs, overlap, fused kernels, the radix cache on a shared-prefix load, chunked
prefill while long prompts arrive). On a CPU two of those switches have nothing to switch (no
CUDA graphs, no fused kernels in float32), and the table shows it. The online benchmark then
starts the server and sends streamed requests at two rates, with goodput objectives and a
concurrency cap. Last, the TTFT-by-rate figure is drawn from the online run's JSON.

    python examples/ch19_bench.py [--model models/tiny-qwen3] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmark"
sys.path.insert(0, str(BENCHMARK))

import offline  # noqa: E402
import online  # noqa: E402
import plots  # noqa: E402

from minisgl.utils.hf import example_checkpoint  # noqa: E402

ABLATIONS = ["--ablations", "all", "--systems", "minisgl", "--num-requests", "8",
             "--min-len", "8", "--max-len", "24", "--num-prefixes", "2", "--prefix-len", "48",
             "--short-requests", "4", "--long-requests", "2", "--long-len", "256",
             "--chunk-size", "64", "--no-progress"]
ONLINE = ["--device", "cpu", "--rates", "8,inf", "--num-requests", "8", "--max-input", "32",
          "--max-output", "16", "--max-concurrency", "4", "--goodput", "ttft=500,tpot=50",
          "--warmup-requests", "2", "--no-progress"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the JSON and the figure go (default: a temporary folder)")
    args = parser.parse_args()
    example_checkpoint(args.model)
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="ch19-"))
    out.mkdir(parents=True, exist_ok=True)

    print("=== offline: ablations on the CPU\n", flush=True)
    offline.main(["--model", args.model, "--device", "cpu", *ABLATIONS,
                  "--out", str(out / "ablations.json")])

    print("\n=== online: the server under load\n", flush=True)
    report = online.main(["--model", args.model, *ONLINE, "--out", str(out / "online.json")])
    if report.errors:
        sys.exit(f"{report.errors} online request(s) failed")

    figure = out / "ch19_ttft_by_rate.svg"
    figure.write_text(plots.percentiles_by_rate(
        report.to_json(), "ttft_ms", "Time to first token against request rate"))
    print(f"\nfigure: {figure.name}, {figure.stat().st_size} bytes of SVG, "
          f"{figure.read_text().count('<circle')} points (p50 and p99 at "
          f"{len(report.results)} rates)")


if __name__ == "__main__":
    main()
