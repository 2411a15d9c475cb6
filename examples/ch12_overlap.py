"""Chapter 12: overlap scheduling: the step timeline with and without it, and the same tokens.

Six requests (two arrive late) run twice on the same engine settings: once with chapter 9's
synchronous step, once overlapped. For the overlapped run each step prints the batch it
*launched* and the batch whose tokens it *processed* (the one launched a step earlier), and the
requests that finished there; a request that stops on a token it samples mid-answer appears in
the next batch once more (marked ``*``) before the host learns it stopped. Then both runs are
compared: steps, forward passes, and every request's output.

With ``--timing`` (on by default on CUDA) each run also reports, per step, the host's time to
plan a batch (schedule + reserve pages), the time it sat waiting for the device's tokens, and
the total. On a CPU nothing runs asynchronously, so overlap saves nothing there; on a GPU the
waiting time shrinks by about the planning time.

    python examples/ch12_overlap.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
                                    [--timing | --no-timing]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from minisgl.core import Req, SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler, StepResult
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import configure_cpu_threads

T = TypeVar("T")
PAGE_SIZE = 4
ARRIVALS = {0: 0, 1: 0, 2: 0, 3: 0, 4: 3, 5: 5}  # uid -> arrival step
MAX_TOKENS = {0: 10, 1: 6, 2: 8, 3: 4, 4: 5, 5: 3}
STOPPER = 2  # this request gets a stop token it samples mid-answer:
STOP_AT = 3  # its 4th sample, read while its next decode step is already launched


def prompt(uid: int) -> list[int]:
    # A fixed, arbitrary prompt per request: token ids spread over the vocabulary.
    return [(uid * 131 + i * 17) % 1999 + 1 for i in range(5 + 3 * uid)]


@dataclass
class Timing:
    """Host time per step, split into planning and waiting for the device."""

    plan: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    total: float = 0.0


def timed(timing: list[float], fn: Callable[..., T], add: bool = False) -> Callable[..., T]:
    """``fn``, recording how long each call took (``add``: onto the last entry)."""
    def wrapper(*args: object) -> T:
        start = time.perf_counter()
        out = fn(*args)
        if add and timing:
            timing[-1] += time.perf_counter() - start
        else:
            timing.append(time.perf_counter() - start)
        return out
    return wrapper


def run(config: SchedulerConfig, overlap: bool, stop_token: int | None,
        timing: Timing) -> tuple[Scheduler, list[StepResult], list[Req]]:
    """The workload on a fresh scheduler; ``timing`` gets the host's planning time per step
    (schedule + page reservation) and its time processing tokens, which includes waiting for
    the device to produce them."""
    scheduler = Scheduler(replace(config, overlap=overlap))
    scheduler.schedule_next_batch = timed(timing.plan, scheduler.schedule_next_batch)
    scheduler.cache.reserve = timed(timing.plan, scheduler.cache.reserve, add=True)
    scheduler._read = timed(timing.wait, scheduler._read)
    reqs = []
    for uid in ARRIVALS:
        stops = (stop_token,) if uid == STOPPER and stop_token is not None else ()
        reqs.append(Req(uid, prompt(uid), SamplingParams(max_tokens=MAX_TOKENS[uid],
                                                         ignore_eos=True, stop_token_ids=stops)))
    results: list[StepResult] = []
    start = time.perf_counter()
    step = 0
    while step <= max(ARRIVALS.values()) or scheduler.has_work:
        for req in reqs:
            if ARRIVALS[req.uid] == step:
                scheduler.add(req)
        results.append(scheduler.step())
        scheduler.check_integrity()
        step += 1
    if scheduler.engine.device.type == "cuda":
        torch.cuda.synchronize()
    timing.total = time.perf_counter() - start
    return scheduler, results, reqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--timing", action=argparse.BooleanOptionalAction, default=None,
                        help="print host timings (default: on CUDA only; CPU output stays "
                             "deterministic)")
    args = parser.parse_args()
    configure_cpu_threads()  # share the cores with the rest of the machine
    model_dir = example_checkpoint(args.model)
    config = SchedulerConfig(model_dir, device=args.device, page_size=PAGE_SIZE, num_pages=64,
                             max_running_reqs=8, max_prefill_tokens=32)

    # A first synchronous run, without stop tokens, picks the stop token: the one request
    # STOPPER samples at STOP_AT, so it stops mid-answer in both runs below.
    _, _, probe = run(config, overlap=False, stop_token=None, timing=Timing())
    stop_token = probe[STOPPER].output_ids[STOP_AT]

    sync_timing, overlap_timing = Timing(), Timing()
    _, sync_results, sync_reqs = run(config, False, stop_token, sync_timing)
    scheduler, over_results, over_reqs = run(config, True, stop_token, overlap_timing)
    engine = scheduler.engine
    print(f"model: {args.model} ({engine.model_config.architectures[0]}), device: "
          f"{engine.device.type}, dtype: {str(engine.dtype)[6:]}")
    print(f"6 requests; request {STOPPER} stops on token {stop_token} "
          f"(sample {STOP_AT + 1} of {MAX_TOKENS[STOPPER]})")
    print("\noverlapped run: each step launches a batch, then processes the one before it")
    print(f"{'step':>4} {'launched':<24}{'processed':<24}finished")
    launched_prev = "-"
    for i, result in enumerate(over_results):
        finished_uids = {req.uid for req in result.finished}
        marks = [f"{uid}*" if uid in finished_uids else str(uid) for uid in result.uids]
        launched = "-" if result.phase is None else f"{result.phase[:3]} {','.join(marks)}"
        finished = ",".join(f"{r.uid}({r.finish_reason})" for r in result.finished) or "-"
        print(f"{i:>4} {launched:<24}{launched_prev:<24}{finished}")
        launched_prev = launched.replace("*", "")
    print("(* finished in the processed batch, yet runs in the launched one: "
          "its extra token is dropped)")

    def passes(results: list[StepResult]) -> int:
        return sum(r.phase is not None for r in results)

    print(f"\n{'':<28}{'sync':>8}{'overlap':>10}")
    print(f"{'steps':<28}{len(sync_results):>8}{len(over_results):>10}")
    print(f"{'forward passes':<28}{passes(sync_results):>8}{passes(over_results):>10}")
    print(f"{'decode tokens computed':<28}"
          f"{sum(r.num_tokens for r in sync_results if r.phase == 'decode'):>8}"
          f"{sum(r.num_tokens for r in over_results if r.phase == 'decode'):>10}")
    same = sum(a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
               for a, b in zip(sync_reqs, over_reqs))
    print(f"outputs identical: {same} of {len(sync_reqs)} requests")
    for req in over_reqs:
        print(f"  request {req.uid}: {len(req.output_ids)} tokens ({req.finish_reason}) "
              f"{req.output_ids}")

    timing = args.timing if args.timing is not None else engine.device.type == "cuda"
    if timing:
        print(f"\n{'host time per step (ms)':<28}{'sync':>8}{'overlap':>10}")
        for name in ("plan", "wait"):  # wait: processing tokens, waiting included
            s, o = getattr(sync_timing, name), getattr(overlap_timing, name)
            print(f"{name:<28}{1e3 * sum(s) / max(len(s), 1):>8.2f}"
                  f"{1e3 * sum(o) / max(len(o), 1):>10.2f}")
        print(f"{'total (ms)':<28}{1e3 * sync_timing.total:>8.1f}"
              f"{1e3 * overlap_timing.total:>10.1f}")


if __name__ == "__main__":
    main()
