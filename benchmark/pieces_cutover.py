"""Where cutting a decode batch into pieces starts to pay: the graph step with and without.

Chapter 20 derives a cut-over batch size from the GPU's wave of thread blocks; this script
measures it. One engine never cuts a decode batch into pieces, another cuts every one (the
threshold ``PIECES_MIN_BATCH`` set to 1 before it captures its graphs); both time whole decode
steps replayed from their graphs (pages, plan, replay, tokens back on the host) at each batch
size, every request with ``--context-len`` tokens of context, or, with ``--mixed``, contexts
drawn between an eighth of it and twice it (one long request then holds a wave up). The
cut-over is the first batch size from which the cut batch is faster at every size measured.

    python benchmark/pieces_cutover.py --model models/qwen3-0.6b-like --device cuda
    python benchmark/pieces_cutover.py --model models/tiny-qwen3 --device cpu --batch-sizes 2,4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the benchmark's sibling modules, also when imported by path
    sys.path.insert(0, str(HERE))
try:
    import minisgl  # noqa: F401
except ImportError:  # run from a checkout that was not pip-installed
    sys.path.insert(0, str(HERE.parent))

SIZES = "16,32,48,64,80,96,128,160,192,256"


@contextlib.contextmanager
def cutting(always: bool) -> Iterator[None]:
    """Pieces for every decode batch (``always``) or for none, inside the block."""
    from minisgl.kernel import pieces
    from minisgl.kernel.trials import DEFAULT_STEPS, use_fused

    threshold = pieces.PIECES_MIN_BATCH
    pieces.PIECES_MIN_BATCH = 1 if always else threshold
    try:
        with use_fused(DEFAULT_STEPS | {"pieces"} if always else DEFAULT_STEPS - {"pieces"}):
            yield
    finally:
        pieces.PIECES_MIN_BATCH = threshold


def context_lengths(batch_size: int, context_len: int, mixed: bool, seed: int) -> list[int]:
    if not mixed:
        return [context_len] * batch_size
    rng = random.Random(f"{seed}:cutover:{batch_size}")
    return [rng.randint(max(1, context_len // 8), 2 * context_len) for _ in range(batch_size)]


def step_times(always: bool, args: argparse.Namespace) -> dict[int, float]:
    """Median graph-step ms at each batch size, pieces always or never."""
    from profile_decode import WARMUP_STEPS, median_step_ms, start_prompts

    from minisgl.llm import LLM

    times: dict[int, float] = {}
    with cutting(always), LLM(args.model, device=args.device,
                              max_running_reqs=max(args.batch_sizes)) as llm:
        engine = llm.engine
        for bs in args.batch_sizes:
            lengths = context_lengths(bs, args.context_len, args.mixed, args.seed)
            rng = random.Random(f"{args.seed}:cutover-prompts:{bs}")
            prompts = [[rng.randrange(engine.model_config.vocab_size) for _ in range(n)]
                       for n in lengths]
            reqs = start_prompts(engine, prompts, 3 * WARMUP_STEPS + args.steps)
            times[bs] = median_step_ms(engine, reqs, args.steps, use_graph=True)
            for req in reqs:
                engine.pages.release(req)
    return times


def cut_over(never: dict[int, float], always: dict[int, float]) -> int | None:
    """The smallest batch size from which cutting is faster at every larger size measured."""
    found = None
    for bs in sorted(never, reverse=True):
        if always[bs] >= never[bs]:
            break
        found = bs
    return found


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from profile_decode import batch_sizes

    parser = argparse.ArgumentParser(prog="python benchmark/pieces_cutover.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/qwen3-0.6b-like", help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--batch-sizes", type=batch_sizes, default=SIZES,
                        help="decode batch sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--context-len", type=int, default=1024,
                        help="context tokens of every request (default: %(default)s)")
    parser.add_argument("--mixed", action="store_true",
                        help="contexts drawn between context-len / 8 and 2 * context-len")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    args = parser.parse_args(argv)
    from minisgl.kernel import pieces

    print(f"model {args.model}; decode graph step ms, "
          f"{'mixed contexts around' if args.mixed else 'every request at'} {args.context_len} "
          f"tokens; pieces from batch {pieces.PIECES_MIN_BATCH} in the engine", flush=True)
    never = step_times(False, args)
    always = step_times(True, args)
    print(f"{'batch':>6}{'no pieces':>12}{'pieces':>10}{'ratio':>8}")
    for bs in args.batch_sizes:
        print(f"{bs:>6}{never[bs]:>12.3f}{always[bs]:>10.3f}{never[bs] / always[bs]:>7.2f}x")
    found = cut_over(never, always)
    print(f"cut-over: {'none in this range' if found is None else f'from batch {found}'}")
    result = {"model": args.model, "context_len": args.context_len, "mixed": args.mixed,
              "no_pieces_ms": never, "pieces_ms": always, "cut_over": found}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
