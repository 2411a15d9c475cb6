"""Chapter 10: chunked prefill: a long prompt among short ones, under a per-step token budget.

Three short requests start decoding; then a 70-token prompt arrives, then two more short ones.
The per-step budget is 16 tokens. With chunked prefill the long prompt is cut into chunks of at
most 16 tokens; each step prints how much of the budget it used, which request computed which
chunk (``uid +tokens (done/prompt)``), and that the running requests decode between two chunks.
The same workload then runs without chunking (chapter 9: the long prompt in one 70-token step),
and the two runs are compared: the largest step, the longest a running request waited for its
next token, and every request's output.

    python examples/ch10_chunked.py [--model models/tiny-qwen3] [--device auto|cpu|cuda]
                                    [--budget 16]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from minisgl.core import Req, SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler, StepResult
from minisgl.utils.hf import example_checkpoint
from minisgl.utils.torch_utils import configure_cpu_threads

PAGE_SIZE = 4
LONG_UID = 3
BAR_WIDTH = 24  # the widest "budget use" bar


@dataclass(frozen=True)
class Arrival:
    """One request of the workload: when it arrives, its prompt length and its answer length."""

    uid: int
    step: int
    prompt_len: int
    max_tokens: int

    def make_req(self) -> Req:
        # A fixed, arbitrary prompt per request: token ids spread over the vocabulary.
        prompt = [(self.uid * 131 + i * 17) % 1999 + 1 for i in range(self.prompt_len)]
        return Req(self.uid, prompt, SamplingParams(max_tokens=self.max_tokens, ignore_eos=True))


WORKLOAD = [Arrival(0, 0, 6, 12), Arrival(1, 0, 5, 12), Arrival(2, 0, 7, 12),
            Arrival(LONG_UID, 2, 70, 4), Arrival(4, 3, 9, 3), Arrival(5, 5, 4, 3)]


@dataclass
class Run:
    """What one run produced: each step's result, and each request's output."""

    results: list[StepResult]
    outputs: dict[int, list[int]]

    @property
    def largest_step(self) -> int:
        return max(r.num_tokens for r in self.results)

    def longest_gap(self) -> int:
        """The most tokens the model computed from one output token of a request to its next
        (the step that makes the next one included): the pause a streaming user sees."""
        prompt_lens = {a.uid: a.prompt_len for a in WORKLOAD}
        computed = 0  # tokens computed by the model so far, over all steps
        prompt_done: dict[int, int] = {}
        last_token_at: dict[int, int] = {}  # uid -> `computed` when it got its last token
        longest = 0
        for result in self.results:
            computed += result.num_tokens
            for uid, n in zip(result.uids, result.new_lens):
                if result.phase == "prefill":
                    prompt_done[uid] = prompt_done.get(uid, 0) + n
                    if prompt_done[uid] < prompt_lens[uid]:
                        continue  # a chunk that is not the last: no token
                if uid in last_token_at:
                    longest = max(longest, computed - last_token_at[uid])
                last_token_at[uid] = computed
        return longest


def run(scheduler: Scheduler, show: bool) -> Run:
    """Add each request on its arrival step; step until all have finished."""
    budget = scheduler.config.max_prefill_tokens
    reqs = {a.uid: a.make_req() for a in WORKLOAD}
    done: dict[int, int] = {}  # uid -> prompt tokens computed so far
    results: list[StepResult] = []
    while len(results) <= max(a.step for a in WORKLOAD) or scheduler.has_work:
        for arrival in WORKLOAD:
            if arrival.step == len(results):
                scheduler.add(reqs[arrival.uid])
        result = scheduler.step()
        scheduler.check_integrity()
        results.append(result)
        if show:
            print(describe(result, budget, reqs, done))
    return Run(results, {uid: req.output_ids for uid, req in reqs.items()})


def describe(result: StepResult, budget: int, reqs: dict[int, Req], done: dict[int, int]) -> str:
    """One line: the step, its phase, its tokens against the budget, and who computed what."""
    width = min(budget, BAR_WIDTH)  # one mark per token, or per budget / BAR_WIDTH tokens
    filled = round(width * min(result.num_tokens, budget) / budget)
    bar = "#" * filled + "." * (width - filled) + ("+" if result.num_tokens > budget else "")
    if result.phase == "prefill":
        parts = []
        for uid, n in zip(result.uids, result.new_lens):
            done[uid] = done.get(uid, 0) + n
            parts.append(f"{uid} +{n} ({done[uid]}/{len(reqs[uid].prompt_ids)})")
        batch = "  ".join(parts)
    else:
        batch = "decode " + " ".join(map(str, result.uids))
    # A star marks the request between two chunks: it waits holding its row and pages.
    waiting = " ".join(f"{uid}*" if 0 < done.get(uid, 0) < len(reqs[uid].prompt_ids)
                       else str(uid) for uid in result.waiting) or "-"
    return f"{result.step:>4} {result.phase:<8}{result.num_tokens:>4}  {bar:<{width + 1}} " \
           f"{waiting:<8}{batch}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3", help="a checkpoint directory")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--budget", type=int, default=16, help="max_prefill_tokens per step")
    args = parser.parse_args()
    configure_cpu_threads()  # share the cores with the rest of the machine
    model_dir = example_checkpoint(args.model)

    def make(chunked_prefill: bool) -> Scheduler:
        return Scheduler(SchedulerConfig(model_dir, device=args.device, page_size=PAGE_SIZE,
                                         num_pages=64, max_running_reqs=8,
                                         max_prefill_tokens=args.budget,
                                         chunked_prefill=chunked_prefill))

    chunked = make(chunked_prefill=True)
    engine = chunked.engine
    print(f"model: {args.model} ({engine.model_config.architectures[0]}), device: "
          f"{engine.device.type}, dtype: {str(engine.dtype)[6:]}")
    print(f"max_prefill_tokens {args.budget} per step; {chunked.cache.num_pages} pages x "
          f"{PAGE_SIZE} tokens")
    print("workload (uid: prompt tokens @ arrival step): "
          + ", ".join(f"{a.uid}: {a.prompt_len}@{a.step}" for a in WORKLOAD))

    print("\nchunked prefill; batch: uid +tokens computed (prompt done/prompt length); "
          "waiting: * = mid-prefill")
    width = min(args.budget, BAR_WIDTH) + 1
    print(f"{'step':>4} {'phase':<8}{'tok':>4}  {'budget use':<{width}} {'waiting':<8}batch")
    with_chunks = run(chunked, show=True)
    without = run(make(chunked_prefill=False), show=False)

    print(f"\n{'':<30}{'chunked':>8}{'unchunked':>11}")
    print(f"{'steps':<30}{len(with_chunks.results):>8}{len(without.results):>11}")
    print(f"{'largest step (tokens)':<30}{with_chunks.largest_step:>8}"
          f"{without.largest_step:>11}")
    print(f"{'longest gap between 2 tokens':<30}{with_chunks.longest_gap():>8}"
          f"{without.longest_gap():>11}   (tokens the model computed)")
    same = [uid for uid in with_chunks.outputs
            if with_chunks.outputs[uid] == without.outputs[uid]]
    print(f"outputs equal to the unchunked run: {len(same)} of {len(WORKLOAD)} requests"
          f"{'' if len(same) == len(WORKLOAD) else '  MISMATCH'}")


if __name__ == "__main__":
    main()
