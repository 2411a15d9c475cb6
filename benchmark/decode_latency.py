"""Batch-1 decode latency as a user sees it: one request through ``LLM.generate``.

One request with a ``--prompt-len``-token prompt decodes ``--max-tokens`` greedy tokens with
``ignore_eos``, after a warm-up run. A run of one token measures the prefill and start-up of
a request; the difference, divided by the remaining tokens, is the time of one decode step
with everything the engine does around it (scheduling, sampling, tokens back to the host).

    python benchmark/decode_latency.py --model models/qwen3-0.6b-like
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
try:
    import minisgl  # noqa: F401
except ImportError:  # run from a checkout that was not pip-installed
    sys.path.insert(0, str(HERE.parent))


def decode_step_ms(llm: object, prompt: list[int], max_tokens: int, repeats: int) -> list[float]:
    """Milliseconds per decode step, once per repeat (after one warm-up run)."""
    from minisgl.core import SamplingParams

    def run(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - start

    run(max_tokens)  # warm-up: first kernels, first graph replays
    return [1e3 * (run(max_tokens) - run(1)) / (max_tokens - 1) for _ in range(repeats)]


def main(argv: Sequence[str] | None = None) -> float:
    parser = argparse.ArgumentParser(prog="python benchmark/decode_latency.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--prompt-len", type=int, default=32, help="default: %(default)s")
    parser.add_argument("--max-tokens", type=int, default=256, help="default: %(default)s")
    parser.add_argument("--repeats", type=int, default=3, help="default: %(default)s")
    args = parser.parse_args(argv)
    if args.prompt_len < 1 or args.max_tokens < 2 or args.repeats < 1:
        parser.error("--prompt-len and --repeats must be >= 1, --max-tokens >= 2")
    from minisgl.llm import LLM

    prompt = list(range(1, args.prompt_len + 1))  # any ids do: greedy, ignore_eos
    with LLM(args.model, device=args.device) as llm:
        device = llm.engine.device
        steps = decode_step_ms(llm, prompt, args.max_tokens, args.repeats)
    median = statistics.median(steps)
    print(f"batch-1 decode on {device}, {args.prompt_len}-token prompt, {args.max_tokens} "
          f"tokens: {median:.3f} ms per step (runs: {', '.join(f'{s:.3f}' for s in steps)})")
    return median


if __name__ == "__main__":
    main()
