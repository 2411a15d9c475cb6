"""Chapter 9: continuous batching: requests arrive over time, join the batch, and leave it.

Seven requests arrive on a seeded schedule: three at step 0, the others a few steps later. The
KV pool is kept small on purpose (16 pages of 4 tokens), so not everyone fits at once: a request
waits until its worst case (prompt + max_tokens) fits in the pages nobody has been promised.
Each step prints the batch the scheduler ran (prefill or decode, which requests, how many
tokens), the pages in use, the waiting queue and who finished. Then every request runs again
alone, and the outputs are compared.

    python examples/ch09_batching.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
                                     [--num-pages 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from minisgl.core import Req, SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.prefill import lifetime_pages
from minisgl.scheduler.scheduler import Scheduler, StepResult
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import configure_cpu_threads

PAGE_SIZE = 4
MAX_PREFILL_TOKENS = 24  # a small per-step token budget, so that it shows
STOP_UID = 4  # this request gets a stop token (see stop_token_for)


@dataclass(frozen=True)
class Arrival:
    """One request of the schedule: when it arrives, its prompt and its parameters."""

    uid: int
    step: int
    prompt_ids: list[int]
    params: SamplingParams

    def make_req(self) -> Req:
        return Req(self.uid, self.prompt_ids, self.params)


def make_schedule(seed: int, vocab_size: int, stop_token: int | None = None) -> list[Arrival]:
    """Seven requests: random prompts and lengths; three arrive at step 0, four later."""
    rng = random.Random(seed)
    steps = [0, 0, 0] + sorted(rng.randint(1, 8) for _ in range(4))
    schedule = []
    for uid, step in enumerate(steps):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(3, 16))]
        stop = (stop_token,) if uid == STOP_UID and stop_token is not None else ()
        params = SamplingParams(max_tokens=rng.randint(3, 10), ignore_eos=True,
                                stop_token_ids=stop)
        schedule.append(Arrival(uid, step, prompt, params))
    return schedule


def run_alone(scheduler: Scheduler, req: Req) -> Req:
    """One request through the scheduler with nothing else around: sequential generation."""
    scheduler.add(req)
    while not req.is_finished:
        scheduler.step()
    return req


def stop_token_for(scheduler: Scheduler, arrival: Arrival) -> int:
    """A token that ``arrival`` generates early on, to use as its stop token.

    The tiny model's weights are random, so it never produces its end-of-sequence token by
    itself. A stop token it is known to produce (its third new token, or the first later one
    that it has not produced before) shows a request ending with "stop".
    """
    out = run_alone(scheduler, arrival.make_req()).output_ids
    return next(t for i, t in enumerate(out) if i >= 2 and t not in out[:i])


def show_step(step: int, result: StepResult, arrived: list[int], promised: int) -> None:
    """One line: the batch that ran, the pages after it, the queue, who finished."""
    came = f"+{','.join(map(str, arrived))}" if arrived else ""
    if result.phase is None:  # nothing waited or ran
        print(f"{step:>4} {came:<7} idle")
        return
    done = " ".join(f"{r.uid}:{r.finish_reason}" for r in result.finished)
    line = (f"{step:>4} {came:<7} {result.phase:<8}{list(result.uids)!s:<16}"
            f"{result.num_tokens:>4} {result.pages_in_use:>5} {promised:>5}/{result.num_pages:<3}"
            f"{list(result.waiting)!s:<11}{done}")
    print(line.rstrip())


def run_continuous(scheduler: Scheduler, schedule: list[Arrival]) -> dict[int, Req]:
    """Add each request on its arrival step, and step the scheduler until all have finished."""
    print(f"\n{'step':>4} {'arrive':<7} {'phase':<8}{'batch (uids)':<16}{'tok':>4} "
          f"{'pages':>5} {'promised':<9}{'waiting':<11}finished")
    finished: dict[int, Req] = {}
    step = 0
    while len(finished) < len(schedule):
        arrived = [a for a in schedule if a.step == step]
        for arrival in arrived:
            scheduler.add(arrival.make_req())
        result = scheduler.step()
        scheduler.check_integrity()
        # Promised: pages in use, plus those the running requests may still need.
        promised = scheduler.cache.num_pages - scheduler.prefill_budget().pages
        show_step(step, result, [a.uid for a in arrived], promised)
        finished.update((req.uid, req) for req in result.finished)
        step += 1
    return finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--num-pages", type=int, default=16, help="KV pages in the pool")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request schedule")
    args = parser.parse_args()
    configure_cpu_threads()  # share the cores with the rest of the machine
    model_dir = example_checkpoint(args.model)

    scheduler = Scheduler(SchedulerConfig(model_dir, device=args.device, page_size=PAGE_SIZE,
                                          num_pages=args.num_pages, max_running_reqs=8,
                                          max_prefill_tokens=MAX_PREFILL_TOKENS))
    engine = scheduler.engine
    print(f"model: {args.model} ({engine.model_config.architectures[0]}), device: "
          f"{engine.device.type}, dtype: {str(engine.dtype)[6:]}")
    print(f"KV pool: {scheduler.cache.num_pages} pages x {PAGE_SIZE} tokens; "
          f"max_running_reqs {scheduler.config.max_running_reqs}; "
          f"max_prefill_tokens {MAX_PREFILL_TOKENS}")

    vocab = engine.model_config.vocab_size
    stop = stop_token_for(scheduler, make_schedule(args.seed, vocab)[STOP_UID])
    schedule = make_schedule(args.seed, vocab, stop_token=stop)
    print("\nuid  arrives  prompt  max_tokens  worst-case pages")
    for a in schedule:
        stop_note = f"   (stops on token {stop})" if a.params.stop_token_ids else ""
        print(f"{a.uid:>3} {a.step:>8} {len(a.prompt_ids):>7} {a.params.max_tokens:>11} "
              f"{lifetime_pages(a.make_req(), PAGE_SIZE):>17}{stop_note}")

    finished = run_continuous(scheduler, schedule)
    print(f"pages in use after the run: {scheduler.cache.pages_in_use} of "
          f"{scheduler.cache.num_pages}")

    print("\nuid  finish  tokens  continuous == alone")
    for a in schedule:
        req = finished[a.uid]
        alone = run_alone(scheduler, a.make_req())
        same = "yes" if alone.output_ids == req.output_ids else "NO"
        print(f"{a.uid:>3}  {req.finish_reason:<6} {len(req.output_ids):>6}  {same}")


if __name__ == "__main__":
    main()
