"""Speculative decoding's speedup: output tokens per second with and without guessing, in one run.

For each batch size, the held-out prompts (lines of the plays the trained models never saw,
``models/tiny-shakespeare/readability_prompts.json``) run to a fixed length, greedy, in batches of
that size, every prompt at least once (how often a guess is right depends on the text: one
prompt alone would measure that prompt), first with plain decode steps and then with each
proposer; the table gives output tokens per second, the
share of guesses the target kept, the milliseconds of a round (a speculative step: the guesses,
the verify pass and the bookkeeping; for plain decoding, one step: the run's time over its
tokens per request) and the host's part of its guessing (``propose``'s wall time: on a GPU a
draft's steps are launched at the end of the round before, so this is what is left to wait for,
not the draft's cost), and the speedup over plain decoding at that batch size. Every
speculative run's tokens are compared with the plain run's, and the last column is the share of
them that agree up to each request's first difference. Greedy speculation changes none in exact
arithmetic (100% on the CPU, in float32); in bfloat16 a batch of another shape rounds
differently, and where plain decoding's top two tokens nearly tie, the other may win and the
text goes another way from there. ``,ahead=off`` makes each round of a draft wait for the host to
read the verdict before it: the two settings side by side measure what launching a round ahead
saves.

    python benchmark/speculative.py --model models/shakespeare-target \\
        --speculative draft=models/tiny-shakespeare,k=4 ngram --batch-sizes 1 8 32 128
    python benchmark/speculative.py --model models/shakespeare-target --batch-sizes 1 8 \\
        --speculative draft=models/shakespeare-draft,k=6 \\
                      draft=models/shakespeare-draft,k=6,ahead=off
    python benchmark/speculative.py --model models/tiny-shakespeare --device cpu --batch-sizes 1 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
try:
    import minisgl  # noqa: F401
except ImportError:  # run from a checkout that was not pip-installed
    sys.path.insert(0, str(HERE.parent))

PROMPTS = HERE.parent / "models" / "tiny-shakespeare" / "readability_prompts.json"


def held_out_prompts(count: int) -> list[str]:
    """``count`` prompts, the held-out ones repeated as needed."""
    prompts = json.loads(PROMPTS.read_text(encoding="utf-8"))
    return [prompts[i % len(prompts)] for i in range(count)]


def batches_of(size: int, num_prompts: int) -> list[list[str]]:
    """Held-out prompts in batches of ``size``: as many whole batches as it takes to give
    each of the first ``num_prompts`` at least once."""
    prompts = held_out_prompts(-(-num_prompts // size) * size)
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def timed(calls: list[float], method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, appending each call's wall seconds to ``calls``. Both methods timed here end
    by reading the device's results, so their wall time includes the device's."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - start)
    return wrapper


def measure(model: str, device: str, speculative: str | None, batch_sizes: Sequence[int],
            max_tokens: int, repeats: int = 3, warmup_s: float = 2.0) -> dict[int, dict[str, Any]]:
    """Per batch size: tokens per second, tokens, the share of guesses kept, and the
    milliseconds of a round and of its guessing, from the fastest of ``repeats`` runs.

    A batch-1 run lasts a tenth of a second, too short for an idle GPU to raise its clocks:
    generating for ``warmup_s`` seconds first, and keeping the fastest run, measures the
    engine rather than the clock (on an H200 the first run was up to 1.7 times slower)."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    num_prompts = len(json.loads(PROMPTS.read_text(encoding="utf-8")))
    rows: dict[int, dict[str, Any]] = {}
    with LLM(model, device=device, speculative=speculative,
             max_running_reqs=max(batch_sizes)) as llm:
        start = time.perf_counter()
        for size in batch_sizes:  # every size once: its graphs' first replays
            llm.generate(held_out_prompts(size), params, progress=False)
        while time.perf_counter() - start < warmup_s:  # and the clocks up
            llm.generate(held_out_prompts(1), params, progress=False)
        speculator = llm.scheduler.speculator
        rounds: list[float] = []
        guessing: list[float] = []
        if speculator is not None:  # instance attributes: decode() calls self.propose
            speculator.decode = timed(rounds, speculator.decode)
            speculator.propose = timed(guessing, speculator.propose)
        for size in batch_sizes:
            for _ in range(repeats):
                rounds.clear()
                guessing.clear()
                before = (0, 0) if speculator is None else (speculator.num_proposed,
                                                            speculator.num_accepted)
                batches = batches_of(size, num_prompts)
                start = time.perf_counter()
                out = [o for batch in batches for o in llm.generate(batch, params,
                                                                    progress=False)]
                seconds = time.perf_counter() - start
                row = {"tok_s": len(out) * max_tokens / seconds,
                       "tokens": [o["token_ids"] for o in out],
                       "round_ms": 1e3 * seconds / (len(batches) * max_tokens),
                       "guess_ms": 0.0}
                if speculator is not None:
                    row["round_ms"] = 1e3 * sum(rounds) / max(1, len(rounds))
                    row["guess_ms"] = 1e3 * sum(guessing) / max(1, len(guessing))
                    proposed = speculator.num_proposed - before[0]
                    row["kept"] = (speculator.num_accepted - before[1]) / max(1, proposed)
                if size not in rows or row["tok_s"] > rows[size]["tok_s"]:
                    rows[size] = row
    return rows


def agreeing_share(outputs: Sequence[Sequence[int]], plain: Sequence[Sequence[int]]) -> float:
    """The share of plain decoding's tokens that ``outputs`` repeats before each request's
    first difference."""
    agreeing = 0
    for ours, theirs in zip(outputs, plain, strict=True):
        agreeing += next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                         min(len(ours), len(theirs)))
    return agreeing / max(1, sum(map(len, plain)))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python benchmark/speculative.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-shakespeare", help="the target")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--speculative", nargs="+",
                        default=["draft=models/tiny-shakespeare,k=4", "ngram"],
                        help="the proposers to compare (--speculative settings)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per batch size; the fastest counts")
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="seconds of generating before the first timed run")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON")
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.max_tokens < 2 or args.repeats < 1 or args.warmup < 0:
        parser.error("batch sizes and --repeats must be >= 1, --max-tokens >= 2 and "
                     "--warmup >= 0")
    timing = {"repeats": args.repeats, "warmup_s": args.warmup}

    plain = measure(args.model, args.device, None, args.batch_sizes, args.max_tokens, **timing)
    table: dict[str, Any] = {"plain": {b: r["tok_s"] for b, r in plain.items()}}
    print(f"target {args.model}, {args.max_tokens} tokens per request, greedy")
    print(f"{'proposer':<46} {'batch':>5} {'tok/s':>9} {'kept':>6} {'ms/round':>9} "
          f"{'guessing':>9} {'speedup':>8}  same")
    for size, row in plain.items():
        print(f"{'(none)':<46} {size:>5} {row['tok_s']:>9.1f} {'':>6} {row['round_ms']:>9.3f} "
              f"{'':>9} {1.0:>7.2f}x")
    for setting in args.speculative:
        rows = measure(args.model, args.device, setting, args.batch_sizes, args.max_tokens,
                       **timing)
        table[setting] = {}
        for size, row in rows.items():
            speedup = row["tok_s"] / plain[size]["tok_s"]
            same = agreeing_share(row["tokens"], plain[size]["tokens"])
            table[setting][size] = {"tok_s": row["tok_s"], "kept": row["kept"],
                                    "round_ms": row["round_ms"], "guess_ms": row["guess_ms"],
                                    "speedup": speedup, "agreeing_share": same}
            print(f"{setting:<46} {size:>5} {row['tok_s']:>9.1f} {row['kept']:>6.2f} "
                  f"{row['round_ms']:>9.3f} {row['guess_ms']:>9.3f} {speedup:>7.2f}x  "
                  f"{same:>4.0%}")
    if args.out is not None:
        args.out.write_text(json.dumps(table, indent=2), encoding="utf-8")
    return table


if __name__ == "__main__":
    main()
