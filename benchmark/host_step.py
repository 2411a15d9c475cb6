"""The host's share of a decode step: the scheduler and the engine, with the device's work out.

Overlap scheduling hides the host's work under the device's only while the host is the quicker
of the two. This script measures the host alone. It runs the real scheduler and engine on the
CPU, with the device's part of a step, the model and attention, replaced by a stand-in. The
stand-in does the host work a CUDA-graph replay does: it stages the batch's page ids,
positions and slots in numpy, into buffers made once, as the FlashInfer backend does before
every replay. It then returns one zero logit per request, as if the vocabulary were a single
token: the greedy pick, device work on a GPU, costs next to nothing here. Everything else is
the engine's own code: scheduling, page reservation, the batch's layout, the token pool's index
lists, sampling's bookkeeping, reading the tokens back, appending them, retiring the finished.

For each batch size of ``--batch-sizes``, that many requests with ``--context-len``-token
prompts are prefilled, then ``--steps`` decode steps are timed one by one (the synchronous
step, so that a step's time is its own). It reports the median milliseconds per step and per
request. Pages are one token each (the engine's default), so the page ids staged per step grow
with the context.

``--offline`` then times ``LLM.generate`` (overlap on, the radix cache) on the standard
workload of ``offline.py`` (256 requests, prompts and outputs of 100 to 1,024 tokens) with the
same stand-in: the host's whole share of that run, prefills, finishing requests and the prefix
cache included.

    python benchmark/host_step.py                                  # batch 1, 32, 128, 256
    python benchmark/host_step.py --batch-sizes 1,8 --context-len 64 --steps 5
    python benchmark/host_step.py --batch-sizes 128 --offline
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
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


def without_device_work(engine: Any) -> None:
    """Replace ``engine.logits`` by the host half of a replayed decode step and one zero logit
    per request (every pick is token 0).

    A prefill's host work (its eager plan) is left out too: only decode steps are timed.
    """
    import torch

    from minisgl.attention import fi
    from minisgl.layers.fast import paths

    table = engine.pages.table

    def logits(batch: Any, use_graph: bool = True, extra_rows: Any = None) -> torch.Tensor:
        engine.input_ids(batch)  # gathering the step's input ids is host work too
        if batch.is_decode:  # slots, then the page arrays (in pieces, as a replay cuts them)
            table.locate(batch.rows, batch.cached_lens, [c + 1 for c in batch.cached_lens])
            pieces = paths.decode_pieces(batch.size)
            if pieces:
                fi.piece_arrays(table, batch, pieces, spares=True)
            else:
                fi.page_arrays(table, batch)
        return torch.zeros(batch.size, 1)

    engine.logits = logits


def host_step_ms(model: str, batch_size: int, context_len: int, steps: int,
                 seed: int = 0) -> list[float]:
    """Milliseconds of host work of each of ``steps`` decode steps at ``batch_size``."""
    from minisgl.core import Req, SamplingParams
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    config = SchedulerConfig(model, device="cpu", overlap=False,
                             max_running_reqs=max(batch_size, 1),
                             max_prefill_tokens=max(context_len, 8192),
                             num_pages=batch_size * (context_len + steps + 2))
    scheduler = Scheduler(config)
    without_device_work(scheduler.engine)
    rng = random.Random(f"{seed}:host:{batch_size}")
    vocab = scheduler.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for uid in range(batch_size):
        scheduler.add(Req(uid, [rng.randrange(vocab) for _ in range(context_len)], params))
    while scheduler.num_running < batch_size:  # every prompt prefilled, first token read
        scheduler.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        result = scheduler.step()
        times.append(1e3 * (time.perf_counter() - start))
        if result.phase != "decode" or len(result.uids) != batch_size:
            raise RuntimeError(f"expected a decode step of {batch_size} requests, got "
                               f"{result.phase} of {len(result.uids)}")
    scheduler.step()  # the last tokens: every request finishes and gives its pages back
    scheduler.check_integrity()
    if scheduler.has_work or scheduler.cache.pages_in_use:
        raise RuntimeError("requests or pages were left behind")
    return times


def build_parser() -> argparse.ArgumentParser:
    from profile_decode import decode_batch_parser

    parser = decode_batch_parser("host_step.py", __doc__, "1,32,128,256", 50,
                                 "decode steps timed per batch size")
    parser.add_argument("--offline", action="store_true",
                        help="also time LLM.generate on offline.py's standard workload")
    return parser


def offline_host_seconds(model: str, num_requests: int = 256, min_len: int = 100,
                         max_len: int = 1024, seed: int = 0) -> tuple[float, list[list[int]]]:
    """Seconds of ``LLM.generate`` on ``offline.py``'s workload with the device's work
    replaced as in :func:`host_step_ms`, and the tokens each request produced."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM
    from offline import make_workload

    llm = LLM(model, device="cpu", prefix_cache="radix", max_running_reqs=num_requests,
              num_pages=num_requests * 2 * max_len)
    workload = make_workload(num_requests, min_len, max_len, seed,
                             llm.engine.model_config.vocab_size)
    without_device_work(llm.engine)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, progress=False)
    return time.perf_counter() - start, [out["token_ids"] for out in outputs]


def main(argv: Sequence[str] | None = None) -> dict[int, float]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.context_len < 1 or args.steps < 1:
        parser.error("--context-len and --steps must be >= 1")
    import torch

    torch.set_num_threads(1)  # the host's work is one thread's
    print(f"host: {platform.machine()} {platform.processor() or ''}".rstrip() +
          f", python {platform.python_version()}, torch {torch.__version__}")
    print(f"model {args.model}; {args.context_len}-token prompts, page size 1; median of "
          f"{args.steps} synchronous decode steps, the device's work replaced by nothing")
    print(f"{'batch':>5}  {'ms/step':>8}  {'us/request':>10}")
    medians = {}
    for size in args.batch_sizes:
        medians[size] = statistics.median(host_step_ms(args.model, size, args.context_len,
                                                       args.steps))
        print(f"{size:>5}  {medians[size]:>8.3f}  {1e3 * medians[size] / size:>10.1f}",
              flush=True)
    if args.offline:
        seconds, outputs = offline_host_seconds(args.model)
        tokens = sum(len(ids) for ids in outputs)
        print(f"offline.py's workload, {len(outputs)} requests through LLM.generate (overlap, "
              f"radix): host {seconds:.2f} s for {tokens} output tokens, "
              f"{1e6 * seconds / tokens:.1f} us a token")
    return medians


if __name__ == "__main__":
    main()
