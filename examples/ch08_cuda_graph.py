"""Chapter 8: decode steps replayed from CUDA graphs, against the same steps run eagerly.

On a GPU the engine captures the decode step for a few batch sizes; for each size this prints
the latency of a whole decode step (pages, metadata, forward, sampling) run eagerly and replayed
from the graph, and checks that the replay computes what the eager step computes. On a CPU there
are no CUDA graphs: the example says why, shows which captured size each batch would be padded
to, and runs a few eager decode steps.

    python examples/ch08_cuda_graph.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
                                       [--batch-sizes 1,8,64,256] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.engine.graph import GraphRunner, default_capture_sizes, padded_batch_size
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import configure_cpu_threads

PROMPT_LEN = 16
WARMUP_STEPS = 3
SEED = 0


def start_requests(engine: Engine, batch_size: int, max_tokens: int) -> list[Req]:
    """``batch_size`` requests with random 16-token prompts, prefilled and ready to decode."""
    generator = torch.Generator().manual_seed(SEED)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [Req(i, torch.randint(engine.model_config.vocab_size, (PROMPT_LEN,),
                                 generator=generator).tolist(), params)
            for i in range(batch_size)]
    decode_step(engine, reqs, "prefill")
    return reqs


def decode_step(engine: Engine, reqs: list[Req], phase: str = "decode",
                use_graph: bool = True) -> float:
    """One whole step, from reserving pages to the sampled tokens on the host; its seconds."""
    start = time.perf_counter()
    for req in reqs:
        engine.pages.reserve(req)
    batch = Batch(reqs, phase)
    tokens = engine.forward(batch, use_graph=use_graph).tolist()  # waits for the GPU
    batch.advance()
    for req, token in zip(reqs, tokens):
        req.append_token(token)
    return time.perf_counter() - start


def median_ms(engine: Engine, reqs: list[Req], steps: int, use_graph: bool) -> float:
    for _ in range(WARMUP_STEPS):
        decode_step(engine, reqs, use_graph=use_graph)
    return 1e3 * statistics.median(decode_step(engine, reqs, use_graph=use_graph)
                                   for _ in range(steps))


def compare_outputs(engine: Engine, runner: GraphRunner, reqs: list[Req]) -> str:
    """Logits of one decode step three ways: eager, the graph's kernels launched one by one,
    and the graph replayed. The last two must be bit for bit equal."""
    for req in reqs:
        engine.pages.reserve(req)
    batch = Batch(reqs, "decode")
    ids = engine.input_ids(batch)
    eager = engine.logits(batch, use_graph=False).clone()
    launched = engine.replay(batch, ids, launched=True).clone()
    replayed = engine.replay(batch, ids).clone()
    exact = "yes" if torch.equal(replayed, launched) else "NO"
    diff = (replayed - eager).abs().max().item()
    same = int((replayed.argmax(-1) == eager.argmax(-1)).sum())
    return f"{exact:>17}  {diff:>10.2e}  {f'{same}/{len(reqs)}':>11}"


def time_graphs(engine: Engine, runner: GraphRunner, steps: int) -> None:
    """The latency table: eager against replayed decode steps, one row per captured size."""
    print(f"CUDA graphs: captured batch sizes {list(runner.batch_sizes)} in "
          f"{runner.capture_seconds:.1f} s")
    print_padding(list(runner.batch_sizes))
    print(f"\ndecode step ({PROMPT_LEN}-token prompts; median of {steps} steps after "
          f"{WARMUP_STEPS} warm-up steps):")
    print(f"  {'batch':>5}  {'eager ms':>9}  {'graph ms':>9}  {'speed-up':>8}  "
          f"{'replay = launches':>17}  {'vs eager':>10}  {'same argmax':>11}")
    for bs in runner.batch_sizes:
        reqs = start_requests(engine, bs, max_tokens=2 * (WARMUP_STEPS + steps) + 2)
        check = compare_outputs(engine, runner, reqs)
        eager = median_ms(engine, reqs, steps, use_graph=False)
        graph = median_ms(engine, reqs, steps, use_graph=True)
        print(f"  {bs:>5}  {eager:>9.2f}  {graph:>9.2f}  {eager / graph:>7.1f}x  {check}")
        for req in reqs:
            engine.pages.release(req)
    print("replay = launches: replayed logits equal, bit for bit, those of the same kernels "
          "launched one by one\nvs eager: max |logit difference| from the eager step (bf16 "
          "rounding); same argmax: requests\nwhose greedy token is the same either way")


def explain_fallback(engine: Engine, runner: GraphRunner, sizes: list[int]) -> None:
    """No graphs here: say why, show what padding would do, and decode eagerly anyway."""
    print(f"CUDA graphs: off ({runner.disabled_reason}).")
    print("Every decode step runs eagerly. With graphs, this example would time eager steps "
          f"against\ngraph replays for batch sizes {', '.join(map(str, sizes))}.")
    print_padding(sizes)
    default = default_capture_sizes(256)
    print(f"(the default capture list up to 256 has {len(default)} sizes: "
          f"{', '.join(map(str, default[:6]))}, ..., {default[-1]})")
    reqs = start_requests(engine, 4, max_tokens=5)
    for _ in range(4):
        decode_step(engine, reqs)
    print(f"\neager decode on {engine.device.type}, 4 requests, 4 steps after the prefill:")
    for req in reqs:
        print(f"  request {req.uid}: {req.output_ids}")
        engine.pages.release(req)


def describe(engine: Engine) -> None:
    device = engine.device.type
    if device == "cuda":
        device += f" ({torch.cuda.get_device_name(engine.device)})"
    print(f"model: {engine.config.model_path} ({engine.model_config.architectures[0]}, "
          f"{engine.model_config.num_layers} layers), device: {device}, "
          f"dtype: {str(engine.dtype)[6:]}, attention: {engine.attn_backend.name}")


def print_padding(sizes: list[int]) -> None:
    """Which captured size each batch size would replay (or 'eager' beyond the largest)."""
    examples = sorted({1, 2, 3, 5, 9, max(sizes), max(sizes) + 1, *sizes})
    graph = [padded_batch_size(b, sizes) for b in examples]
    print("padding: a decode batch of B requests replays the graph of the next captured size")
    print("  B      " + "".join(f"{b:>6}" for b in examples))
    print("  graph  " + "".join(f"{g if g else 'eager':>6}" for g in graph))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--batch-sizes", default="1,8,64,256",
                        help="decode batch sizes to capture and time (comma-separated)")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per mode")
    args = parser.parse_args()
    configure_cpu_threads()  # share the cores with the rest of the machine
    example_checkpoint(args.model)
    try:
        sizes = sorted({int(s) for s in args.batch_sizes.split(",")})
    except ValueError:
        sys.exit(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if sizes[0] < 1 or args.steps < 1:
        sys.exit("batch sizes and --steps must be >= 1")
    engine = Engine(EngineConfig(args.model, device=args.device, cuda_graph_batch_sizes=sizes,
                                 max_running_reqs=max(sizes)))
    describe(engine)
    runner = engine.graph_runner
    assert isinstance(runner, GraphRunner)
    if runner.enabled:
        time_graphs(engine, runner, args.steps)
    else:
        explain_fallback(engine, runner, sizes)

if __name__ == "__main__":
    main()
