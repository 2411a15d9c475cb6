"""What the sampling API costs a decode step: penalties, logit_bias and logprobs against plain
sampling, at a small and a large batch.

Each configuration runs ``--batch-sizes`` requests of ``--prompt-len`` random prompt tokens
through ``LLM.generate`` for ``--max-tokens`` tokens (``ignore_eos``), after a warm-up; a run
of one token is subtracted, as in ``decode_latency.py``, so the figure is one decode step with
everything around it. The step's extra time over plain greedy decoding is what the option
costs, measured in the same run.

    python benchmark/sampler_cost.py --model models/tiny-qwen3 --device cpu
    python benchmark/sampler_cost.py --model models/qwen3-0.6b-like --device cuda
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
try:
    import minisgl  # noqa: F401
except ImportError:  # run from a checkout that was not pip-installed
    sys.path.insert(0, str(HERE.parent))

SAMPLED = {"temperature": 1.0, "top_p": 0.9}  # unseeded: one draw for the batch
PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5}
CONFIGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "sampled (temperature 1, top-p 0.9)": SAMPLED,
    "sampled + penalties": {**SAMPLED, **PENALTIES},
    "sampled + logit_bias (8 tokens)": {**SAMPLED, "logit_bias": {t: 1.0 for t in range(8)}},
    "sampled + logprobs (top 5)": {**SAMPLED, "logprobs": 5},
    "sampled + penalties + logprobs": {**SAMPLED, **PENALTIES, "logprobs": 5},
}


def step_ms(llm: Any, prompts: list[list[int]], options: dict[str, Any], max_tokens: int,
            repeats: int) -> float:
    """Median milliseconds of one decode step of ``prompts`` sampled with ``options``."""
    from minisgl.core import SamplingParams

    def run(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, **options)
        start = time.perf_counter()
        llm.generate(prompts, params, progress=False)
        return time.perf_counter() - start

    run(max_tokens)  # warm-up
    return statistics.median(1e3 * (run(max_tokens) - run(1)) / (max_tokens - 1)
                             for _ in range(repeats))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/tiny-qwen3")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-sizes", default="1,128", help="comma-separated")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from minisgl.llm import LLM

    llm = LLM(args.model, device=args.device)
    vocab = llm.scheduler.engine.model_config.vocab_size
    rows = []
    print(f"{'configuration':38} {'batch':>5} {'ms/step':>8} {'over greedy':>11}")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        rng = random.Random(batch_size)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
                   for _ in range(batch_size)]
        base = None
        for name, options in CONFIGS.items():
            ms = step_ms(llm, prompts, options, args.max_tokens, args.repeats)
            base = ms if base is None else base
            rows.append({"config": name, "batch_size": batch_size, "ms_per_step": ms,
                         "over_greedy_ms": ms - base})
            print(f"{name:38} {batch_size:5d} {ms:8.3f} {ms - base:+11.3f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
