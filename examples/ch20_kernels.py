"""Chapter 20: each kernel beside the plain code it replaces, and what each adds to a step.

First, which kernels run on this machine (on a CPU none does: the plain code is the engine).
Then the arithmetic that lets a long request's attention be cut into pieces: each piece
attended alone, with the log-sum-exp of its scores, and the pieces merged, equals attention
over all the keys. Then the passes a batch-1 step folds into its matrix reads (a decoder
layer's add-and-norm, the MLP's SiLU-and-multiply), against the two passes each replaces.
Last, ``benchmark/kernel_steps.py``: the kernels added one step at a time, measured.

    python examples/ch20_kernels.py [--model models/tiny-qwen3] [--steps gemv,gated,normed]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmark"
sys.path.insert(0, str(BENCHMARK))

import kernel_steps  # noqa: E402

from minisgl.kernel import kernel_status, use_fused  # noqa: E402
from minisgl.kernel.trials import STEPS  # noqa: E402
from minisgl.layers import ReplicatedLinear, RMSNorm, silu_and_mul  # noqa: E402
from minisgl.layers.linear import matmul, normed_linear  # noqa: E402
from minisgl.utils.hf import example_checkpoint  # noqa: E402


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One head's attention over some keys: the output and the natural log-sum-exp of the
    scores (``-inf`` and zeros for no keys)."""
    if keys.shape[0] == 0:
        return torch.zeros_like(q), torch.tensor(-math.inf, dtype=q.dtype)
    scores = keys @ q / math.sqrt(q.shape[0])
    return torch.softmax(scores, dim=0) @ values, torch.logsumexp(scores, dim=0)


def merge(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Each piece weighs ``exp(lse_i - max lse)``, its share of the whole softmax's sum."""
    lse = torch.stack([p[1] for p in pieces])
    weights = torch.exp(lse - lse.max())
    outs = torch.stack([p[0] for p in pieces])
    return (weights[:, None] * outs).sum(dim=0) / weights.sum()


def show_pieces() -> None:
    print("\n=== attention in pieces, merged by log-sum-exp (float64, one head)")
    gen = torch.Generator().manual_seed(20)
    q = torch.randn(64, generator=gen, dtype=torch.float64) * 3  # sharp scores
    keys = torch.randn(1000, 64, generator=gen, dtype=torch.float64)
    values = torch.randn(1000, 64, generator=gen, dtype=torch.float64)
    whole, _ = attend(q, keys, values)
    for cuts in ([0, 1000], [0, 500, 1000], [0, 1, 2, 999, 1000], [0, 250, 250, 600, 1000]):
        pieces = [attend(q, keys[a:b], values[a:b]) for a, b in zip(cuts, cuts[1:])]
        sizes = [b - a for a, b in zip(cuts, cuts[1:])]
        err = (merge(pieces) - whole).abs().max().item()
        print(f"pieces of {sizes}: max |merged - whole| = {err:.1e}")


def show_folded(device: torch.device) -> None:
    print("\n=== passes folded into the matrix read, batch 1")
    if device.type != "cuda":
        print("no CUDA GPU: the plain passes run (the norm, the activation, then the product);"
              " the tests hold the kernels to them on a GPU")
        return
    torch.manual_seed(0)
    hidden, inter = 1024, 3072
    norm = RMSNorm(hidden).to(device, torch.bfloat16)
    qkv = ReplicatedLinear(hidden, 4096).to(device, torch.bfloat16)
    torch.nn.init.normal_(qkv.weight, std=hidden ** -0.5)
    x, residual = (torch.randn(1, hidden, device=device, dtype=torch.bfloat16) for _ in "xr")
    down = torch.randn(hidden, inter, device=device, dtype=torch.bfloat16) * inter ** -0.5
    gate_up = torch.randn(1, 2 * inter, device=device, dtype=torch.bfloat16)
    with use_fused(False):
        plain_qkv, plain_res = normed_linear(norm, qkv, x, residual)
        plain_down = matmul(silu_and_mul(gate_up), down)
    fused_qkv, fused_res = normed_linear(norm, qkv, x, residual)
    fused_down = matmul(gate_up, down, gated=True)
    for name, a, b in (("add + norm + qkv product", fused_qkv, plain_qkv),
                       ("new residual", fused_res, plain_res),
                       ("silu * up + down product", fused_down, plain_down)):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        print(f"{name:<26} relative difference {rel:.1e} (bf16 rounds at 3.9e-3)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--steps", default=",".join(STEPS), help="the kernel steps to add")
    args = parser.parse_args()
    example_checkpoint(args.model)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"=== the kernels on {device}: {', '.join(STEPS)}")
    if device.type == "cpu":
        print("none runs on a CPU: every layer takes its plain PyTorch path")
    show_pieces()
    show_folded(device)
    if device.type == "cuda":  # the states are known once a layer has offered each a call
        print("\nkernel status:", ", ".join(f"{k} {v}" for k, v in kernel_status().items()))
    print("\n=== the kernels added one step at a time (benchmark/kernel_steps.py)\n", flush=True)
    small = [] if device.type == "cuda" else ["--context-len", "64", "--max-tokens", "16"]
    kernel_steps.main(["--model", args.model, "--device", str(device), "--steps", args.steps,
                       *small])


if __name__ == "__main__":
    main()
