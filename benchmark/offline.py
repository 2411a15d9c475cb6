"""Offline throughput: minisgl against transformers on one fixed batch of requests.

The workload: ``--num-requests`` requests whose prompt and output lengths are drawn uniformly
from ``[--min-len, --max-len]``, and whose prompts are random token ids of the model's
vocabulary, all from one seeded generator (``--seed``), so every system and every run sees the
same requests. Decoding is greedy and ignores end-of-sequence tokens: each request produces
exactly its drawn number of tokens.

The systems (``--systems``, all by default):

- ``minisgl``: the offline ``LLM`` in four configurations, overlap scheduling on or off times
  the radix or the naive prefix cache (on CUDA: bfloat16, FlashInfer, CUDA graphs). One engine
  per prefix cache, warmed up first, with overlap switched between its two runs;
- ``transformers``: ``generate`` on the requests as one left-padded batch (or
  ``--hf-batch-size`` requests per batch; halved until a batch fits the GPU when not given),
  every row running to the longest output of its batch. Only each request's own tokens count
  as output; the rest is waste;
- ``transformers-cb``: transformers' continuous batching, each request with its own
  ``max_new_tokens``, when the installed version has it.

Each system prints its result as soon as it finishes; a table closes the run, with the speed-up
over plain transformers and, on CUDA, how close each minisgl configuration's decode steps come
to the time the GPU needs just to read the weights and the KV cache once per step (the "HBM
floor"). ``--out results.json`` writes everything, after every system, machine-readable.

    python benchmark/offline.py --model models/qwen3-0.6b-like            # the GPU run
    python benchmark/offline.py --num-requests 8 --min-len 8 --max-len 32  # a quick CPU run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import itertools
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the benchmark's sibling modules, also when imported by path
    sys.path.insert(0, str(HERE))
SYSTEMS = ("minisgl", "transformers", "transformers-cb")
# (overlap, prefix cache): the four minisgl configurations, in the order they run.
MINISGL_CONFIGS = ("overlap+radix", "sync+radix", "overlap+naive", "sync+naive")
WARMUP_REQUESTS = 4
WARMUP_PROMPT_LEN = 32
WARMUP_OUTPUT_LEN = 8
COPY_BENCH_BYTES = 2 * 2**30  # large enough that launch costs vanish, small next to any GPU
CB_STALL_S = 300  # transformers-cb is given up when no request finishes for this long


# ----------------------------------------------------------------------------- the workload
@dataclass(frozen=True)
class Workload:
    """The requests every system runs: prompts and the number of tokens each must produce."""

    prompts: list[list[int]]
    output_lens: list[int]
    seed: int
    min_len: int
    max_len: int

    @property
    def input_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def output_tokens(self) -> int:
        """Useful output tokens: every request's own output length."""
        return sum(self.output_lens)


def make_workload(num_requests: int, min_len: int, max_len: int, seed: int,
                  vocab_size: int) -> Workload:
    """Draw the lengths (inputs, then outputs), then the prompts, from one seeded generator."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    input_lens = torch.randint(min_len, max_len + 1, (num_requests,), generator=generator)
    output_lens = torch.randint(min_len, max_len + 1, (num_requests,), generator=generator)
    prompts = [torch.randint(vocab_size, (int(n),), generator=generator).tolist()
               for n in input_lens]
    return Workload(prompts, output_lens.tolist(), seed, min_len, max_len)


# ----------------------------------------------------------------------------- results
@dataclass
class DecodeStats:
    """minisgl's decode steps, against the HBM floor (the floor fields are CUDA only)."""

    steps: int
    mean_batch: float
    seconds: float  # wall time of the scheduler steps that ran (launched) a decode batch
    prefill_steps: int
    prefill_seconds: float
    # Bytes the decode steps must read at least (all weight bytes once per step, and the KV of
    # every request's context), divided by the measured copy bandwidth.
    floor_seconds: float | None = None
    floor_fraction: float | None = None  # floor_seconds / seconds


@dataclass
class SystemResult:
    """One system (or minisgl configuration) on the workload."""

    system: str
    config: str
    num_requests: int
    output_tokens: int  # useful tokens: each request's own output length at most
    wall_s: float
    computed_tokens: int  # tokens generated, useful or not (a padded batch wastes some)
    output_lens_ok: bool  # every request produced exactly its drawn output length
    decode: DecodeStats | None = None
    speedup: float | None = None

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def label(self) -> str:
        return f"{self.system} ({self.config})"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tok_per_s"] = self.tok_per_s
        return out


@dataclass
class Report:
    """Everything the run measured; written to ``--out`` after every system."""

    header: dict[str, Any]
    workload: dict[str, Any]
    results: list[SystemResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # system -> why it did not run

    def baseline(self) -> SystemResult | None:
        return next((r for r in self.results if r.system == "transformers"), None)

    def update_speedups(self) -> None:
        base = self.baseline()
        for result in self.results:
            result.speedup = None if base is None else result.tok_per_s / base.tok_per_s

    def to_json(self) -> dict[str, Any]:
        self.update_speedups()
        return {"header": self.header, "workload": self.workload,
                "results": [r.to_json() for r in self.results], "skipped": self.skipped}


# ----------------------------------------------------------------------------- the device
def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: Any, say: str | None = None) -> None:
    """Return what the previous system held, so the next one starts from a free device."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        if say is not None:
            print(f"{say}: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB still "
                  "allocated on the GPU", flush=True)


def copy_bandwidth(device: Any, nbytes: int = COPY_BENCH_BYTES, repeats: int = 20) -> float:
    """Device memory bandwidth in bytes/s: a large device-to-device copy, read + written."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):  # warm-up
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    del src, dst
    free_device_memory(device)
    return 2 * nbytes / seconds


# ----------------------------------------------------------------------------- minisgl
@dataclass
class StepLog:
    """What each scheduler step ran and how long it took (appended by a wrapper of ``step``)."""

    seconds: list[float] = field(default_factory=list)
    phases: list[str | None] = field(default_factory=list)
    uids: list[tuple[int, ...]] = field(default_factory=list)
    prompt_lens: dict[int, int] = field(default_factory=dict)  # uid -> prompt length

    def record(self, seconds: float, result: Any) -> None:
        self.seconds.append(seconds)
        self.phases.append(result.phase)
        self.uids.append(result.uids)
        for req in result.finished:
            self.prompt_lens[req.uid] = len(req.prompt_ids)


def watch_steps(scheduler: Any) -> StepLog:
    """Time every ``scheduler.step()`` and keep its batch, at the cost of a clock read."""
    log = StepLog()
    step = scheduler.step

    def timed_step() -> Any:
        start = time.perf_counter()
        result = step()
        log.record(time.perf_counter() - start, result)
        return result

    scheduler.step = timed_step
    return log


def decode_stats(log: StepLog, weight_bytes: int, kv_bytes_per_token: int,
                 bandwidth: float | None) -> DecodeStats:
    """Decode steps and their time; with a bandwidth, the floor: the weights and the KV of
    every request's context, read once per decode step."""
    decoded: dict[int, int] = {}  # uid -> decode steps so far
    steps = batch_total = context_total = 0
    seconds = prefill_seconds = 0.0
    prefill_steps = 0
    last_phase = None
    for step_s, phase, uids in zip(log.seconds, log.phases, log.uids):
        if phase is None:
            # An overlapped step that launches nothing only waits for the batch launched
            # before it: its time belongs to that batch's phase.
            if last_phase == "decode":
                seconds += step_s
            elif last_phase == "prefill":
                prefill_seconds += step_s
            continue
        last_phase = phase
        if phase == "prefill":
            prefill_steps += 1
            prefill_seconds += step_s
            continue
        steps += 1
        batch_total += len(uids)
        seconds += step_s
        for uid in uids:
            decoded[uid] = decoded.get(uid, 0) + 1
            # The step feeds token prompt + k - 1 and reads the K/V of everything up to it.
            context_total += log.prompt_lens[uid] + decoded[uid]
    stats = DecodeStats(steps=steps, mean_batch=batch_total / max(steps, 1), seconds=seconds,
                        prefill_steps=prefill_steps, prefill_seconds=prefill_seconds)
    if bandwidth is not None and steps:
        floor_bytes = steps * weight_bytes + context_total * kv_bytes_per_token
        stats.floor_seconds = floor_bytes / bandwidth
        stats.floor_fraction = stats.floor_seconds / seconds
    return stats


def run_minisgl(args: argparse.Namespace, workload: Workload, configs: Sequence[str],
                bandwidth: float | None, emit: Callable[[SystemResult], None]) -> None:
    """The four configurations, one engine per prefix cache, overlap switched in between."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    for cache in ("radix", "naive"):
        wanted = [c for c in configs if c.endswith("+" + cache)]
        if not wanted:
            continue
        ranks = f" on {args.tp} tensor-parallel ranks" if args.tp > 1 else ""
        print(f"minisgl: starting an engine with the {cache} prefix cache{ranks}", flush=True)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, prefix_cache=cache,
                  tp=args.tp)
        engine = llm.engine
        warm_up_minisgl(llm)
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        kv_bytes = engine.rank_config.kv_bytes_per_token(engine.dtype)  # this rank's heads
        for config in wanted:
            overlap = config.startswith("overlap")
            set_overlap(llm.scheduler, overlap)
            # Every run starts cold: the radix tree still holds the previous run's prompts,
            # which would turn this run's prefills into cache hits.
            empty_prefix_cache(llm.scheduler)
            log = watch_steps(llm.scheduler)
            synchronize(engine.device)
            start = time.perf_counter()
            outputs = llm.generate(workload.prompts, params, progress=not args.no_progress)
            synchronize(engine.device)
            wall = time.perf_counter() - start
            del llm.scheduler.step  # the wrapper was an instance attribute: back to the method
            lens = [len(out["token_ids"]) for out in outputs]
            emit(SystemResult(
                system="minisgl", config=config.replace("+", ", "),
                num_requests=workload.num_requests,
                output_tokens=sum(min(n, want) for n, want in zip(lens, workload.output_lens)),
                wall_s=wall, computed_tokens=sum(lens),
                output_lens_ok=lens == workload.output_lens,
                decode=decode_stats(log, weight_bytes, kv_bytes, bandwidth)))
        llm.close()  # stops the other ranks, if any
        del llm, engine
        free_device_memory(resolve_device(args.device), say=f"minisgl ({cache}) freed")


def warm_up_minisgl(llm: Any) -> None:
    """A few short requests first, so that no timed run pays for first-use costs (kernel
    compilation, allocator growth)."""
    from minisgl.core import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    prompts = [[(7 * i + 13 * j) % vocab for j in range(WARMUP_PROMPT_LEN)]
               for i in range(WARMUP_REQUESTS)]
    for overlap in (True, False):
        set_overlap(llm.scheduler, overlap)
        llm.generate(prompts, SamplingParams(max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True),
                     progress=False)


def empty_prefix_cache(scheduler: Any) -> None:
    """Evict every page the prefix cache keeps (none are locked: nothing runs)."""
    assert not scheduler.has_work, "empty the prefix cache only while nothing runs"
    cache = scheduler.cache
    cache.evict(cache.prefix_cache.num_evictable_pages)
    assert cache.pages_in_use == 0, "the prefix cache kept pages"


def set_overlap(scheduler: Any, overlap: bool) -> None:
    """Switch an idle scheduler's overlap between runs (see ``Scheduler``)."""
    assert not scheduler.has_work, "switch overlap only while nothing runs"
    scheduler.overlap = overlap


def resolve_device(device: str) -> Any:
    from minisgl.utils.torch_utils import resolve_device as resolve

    return resolve(device)


# ----------------------------------------------------------------------------- transformers
def load_hf_model(path: Path, device: Any, dtype: Any) -> Any:
    """The checkpoint in transformers, with end-of-sequence turned off (the workload ignores
    it): transformers fills an unset ``eos_token_id`` from the model's generation config."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def pad_token_id(model: Any) -> int:
    pad = model.generation_config.pad_token_id
    return 0 if pad is None else int(pad if isinstance(pad, int) else pad[0])


def hf_generate(model: Any, prompts: Sequence[list[int]], max_new_tokens: int) -> Any:
    """Greedy ``generate`` on the prompts as one left-padded batch; returns the new tokens."""
    import torch
    from transformers import GenerationConfig

    pad = pad_token_id(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the last column
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=pad)
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=config)
    return out[:, width:]


def run_transformers(args: argparse.Namespace, workload: Workload, model: Any,
                     emit: Callable[[SystemResult], None]) -> None:
    """Padded batches: each runs to its longest output; only each row's own tokens count."""
    size = args.hf_batch_size or workload.num_requests
    print(f"transformers: generate in {-(-workload.num_requests // size)} padded batch(es) of "
          f"up to {size} requests", flush=True)
    run = generate_padded(model, workload.prompts, workload.output_lens, args.hf_batch_size)
    emit(SystemResult(system="transformers", config=f"padded batches of {run.batch_size}",
                      num_requests=workload.num_requests, output_tokens=run.useful,
                      wall_s=run.wall_s, computed_tokens=run.computed, output_lens_ok=run.ok))


@dataclass
class PaddedRun:
    useful: int  # each row's own tokens
    computed: int  # every row run to its batch's longest output
    ok: bool  # every request got its whole output
    wall_s: float
    batch_size: int  # requests per padded batch


def generate_padded(model: Any, prompts: Sequence[list[int]], output_lens: Sequence[int],
                    size: int | None) -> PaddedRun:
    """``generate`` on ``size`` requests at a time after a short warm-up, timed.

    A padded batch's KV cache holds every row at its longest prompt plus its longest output, so
    one batch of every request may not fit a GPU's memory. With ``size`` None (no batch size
    was asked for) the run starts as one batch, and a batch that runs out of memory starts the
    whole run over in batches of half the size; with a size the error says what to pass.
    """
    import torch

    shrink, size = size is None, size or len(prompts)
    hf_generate(model, prompts[:2], WARMUP_OUTPUT_LEN)  # warm-up
    while True:
        try:
            return _timed_padded_run(model, prompts, output_lens, size)
        except torch.OutOfMemoryError as exc:
            if not shrink or size == 1:
                raise RuntimeError(f"transformers ran out of GPU memory in padded batches of "
                                   f"{size}: pass a smaller --hf-batch-size") from exc
        smaller = -(-size // 2)
        # Out of the except block: the exception no longer holds the failed batch's tensors.
        free_device_memory(model.device)
        print(f"transformers: out of GPU memory in padded batches of {size}; starting over "
              f"in batches of {smaller}", flush=True)
        size = smaller


def _timed_padded_run(model: Any, prompts: Sequence[list[int]], output_lens: Sequence[int],
                      size: int) -> PaddedRun:
    synchronize(model.device)
    useful = computed = 0
    ok = True
    start = time.perf_counter()
    for first in range(0, len(prompts), size):
        wanted = output_lens[first:first + size]
        new = hf_generate(model, prompts[first:first + size], max(wanted))
        computed += new.numel()
        got = [min(new.shape[1], n) for n in wanted]
        useful += sum(got)
        ok &= got == list(wanted)
    synchronize(model.device)
    return PaddedRun(useful, computed, ok, time.perf_counter() - start, size)


def cb_unavailable_reason(model: Any) -> str | None:
    """Why transformers' continuous batching cannot run here, or None."""
    import transformers

    if hasattr(model, "continuous_batching_context_manager"):
        return None
    if hasattr(model, "generate_batch"):
        return None  # an older API: one max_new_tokens for all, useful tokens counted
    return (f"transformers {transformers.__version__} has no continuous batching "
            "(no generate_batch / ContinuousBatchingManager)")


def run_transformers_cb(args: argparse.Namespace, workload: Workload, model: Any,
                        emit: Callable[[SystemResult], None]) -> None:
    """transformers' continuous batching, each request with its own ``max_new_tokens``."""
    from transformers import GenerationConfig

    device = model.device
    config = GenerationConfig(max_new_tokens=max(workload.output_lens), do_sample=False,
                              eos_token_id=-1, pad_token_id=pad_token_id(model))
    if not hasattr(model, "continuous_batching_context_manager"):  # the older API
        print("transformers-cb: generate_batch (one max_new_tokens for every request)",
              flush=True)
        start = time.perf_counter()
        outputs = model.generate_batch(inputs=workload.prompts, generation_config=config)
        synchronize(device)
        wall = time.perf_counter() - start
        lens = [len(out.generated_tokens) for out in outputs.values()]
        emit(cb_result(workload, wall, lens))
        return
    print("transformers-cb: continuous batching manager, per-request max_new_tokens",
          flush=True)
    kwargs: dict[str, Any] = {"generation_config": config, "block": True, "timeout": 30}
    manager_params = inspect.signature(model.continuous_batching_context_manager).parameters
    if "warmup" in manager_params:
        # Warm up (graph capture, compilation) before the clock starts, as minisgl does.
        kwargs["warmup"] = True
    hints = workload_hints(workload)
    if hints is not None and "workload_hints" in manager_params:
        kwargs["workload_hints"] = hints
    with model.continuous_batching_context_manager(**kwargs) as manager:
        add_params = inspect.signature(manager.add_request).parameters
        start = time.perf_counter()  # after the manager's warm-up
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
            extra = {"eos_token_id": -1} if "eos_token_id" in add_params else {}
            manager.add_request(prompt, request_id=f"req{i}", max_new_tokens=n, **extra)
        results: dict[str, Any] = {}
        last_progress = time.perf_counter()
        while len(results) < workload.num_requests:
            out = manager.get_result(timeout=1)
            if out is None and time.perf_counter() - last_progress > CB_STALL_S:
                raise RuntimeError(f"transformers-cb: no request finished in {CB_STALL_S} s; "
                                   f"{workload.num_requests - len(results)} left")
            if out is not None and out.is_finished():
                last_progress = time.perf_counter()
                if out.error is not None:
                    raise RuntimeError(f"transformers-cb: request {out.request_id} failed: "
                                       f"{out.error}")
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError(f"transformers-cb: the generation thread stopped with "
                                   f"{workload.num_requests - len(results)} request(s) left")
        synchronize(device)
        wall = time.perf_counter() - start
    lens = [len(results[f"req{i}"].generated_tokens) for i in range(workload.num_requests)]
    emit(cb_result(workload, wall, lens))


def workload_hints(workload: Workload) -> Any:
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    return WorkloadHints(max_prompt_length=max(workload.input_lens),
                         max_generated_length=max(workload.output_lens),
                         num_requests=workload.num_requests)


def cb_result(workload: Workload, wall: float, lens: list[int]) -> SystemResult:
    return SystemResult(
        system="transformers-cb", config="continuous batching",
        num_requests=workload.num_requests,
        output_tokens=sum(min(n, want) for n, want in zip(lens, workload.output_lens)),
        wall_s=wall, computed_tokens=sum(lens), output_lens_ok=lens == workload.output_lens)


# ----------------------------------------------------------------------------- ablations
ABLATIONS = ("cuda-graph", "overlap", "fused", "prefix-cache", "chunked-prefill")
# What each ablation is read by: (a field of AblationResult, its label, higher is better).
HEADLINES = {
    "cuda-graph": ("tok_per_s", "output tok/s", True),
    "overlap": ("tok_per_s", "output tok/s", True),
    "fused": ("tok_per_s", "output tok/s", True),
    "prefix-cache": ("ttft_p50_ms", "TTFT p50 ms", False),
    "chunked-prefill": ("itl_p99_ms", "running ITL p99 ms", False),
}
SHORT_LONG_FIRST_ARRIVAL = 8  # decode steps of the short requests before the first long prompt
SHORT_LONG_ARRIVAL_GAP = 32  # decode steps between two long prompts


@dataclass(frozen=True)
class Arm:
    """One side of an ablation: an engine (options over the base ones, fused kernels on or
    off), the scheduler's overlap, and the workload it runs. Arms that agree on all of these
    are one measurement, run once and reported under each ablation they belong to."""

    ablation: str
    label: str
    workload: str  # "random", "shared-prefix" or "short-long"
    options: tuple[tuple[str, Any], ...] = ()
    overlap: bool = True
    fused: bool = True

    @property
    def engine_key(self) -> tuple[tuple[tuple[str, Any], ...], bool]:
        return self.options, self.fused

    @property
    def run_key(self) -> tuple[Any, ...]:
        return self.engine_key, self.overlap, self.workload


def ablation_arms(names: Sequence[str], chunk_size: int) -> list[Arm]:
    """The arms of the chosen ablations. The base engine has CUDA graphs, fused kernels, the
    radix cache and overlap on, and chunked prefill off; each arm changes one thing."""
    budget = (("max_prefill_tokens", chunk_size),)
    arms = {
        "cuda-graph": [Arm("cuda-graph", "graphs on", "random"),
                       Arm("cuda-graph", "graphs off", "random", (("cuda_graph", False),))],
        "overlap": [Arm("overlap", "overlap on", "random"),
                    Arm("overlap", "overlap off", "random", overlap=False)],
        "fused": [Arm("fused", "fused on", "random"),
                  Arm("fused", "fused off", "random", fused=False)],
        "prefix-cache": [Arm("prefix-cache", "radix", "shared-prefix"),
                         Arm("prefix-cache", "naive", "shared-prefix",
                             (("prefix_cache", "naive"),))],
        "chunked-prefill": [Arm("chunked-prefill", "chunked", "short-long",
                                budget + (("chunked_prefill", True),)),
                            Arm("chunked-prefill", "unchunked", "short-long", budget)],
    }
    return [arm for name in names for arm in arms[name]]


@dataclass
class Trace:
    """When each request was added and when each of its tokens reached the host."""

    added_s: dict[int, float] = field(default_factory=dict)
    token_s: dict[int, list[float]] = field(default_factory=dict)
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens the prefill steps computed (a cache hit skips some)
    decode_steps: int = 0
    wall_s: float = 0.0

    def ttft_s(self, uid: int) -> float:
        return self.token_s[uid][0] - self.added_s[uid]

    def itl_s(self, uid: int) -> list[float]:
        times = self.token_s[uid]
        return [b - a for a, b in zip(times, times[1:])]


def run_traced(scheduler: Any, waves: Sequence[tuple[int | None, list[Any]]]) -> Trace:
    """Step ``scheduler`` until every request of every wave has finished, timing each token.

    A wave ``(after, reqs)`` is added once the scheduler has run ``after`` decode steps, or,
    with ``after=None``, once everything added before it has finished; a wave whose moment
    never comes (nothing left to decode) is added when the scheduler falls idle. A token's
    time is when the host first sees it in its request's ``output_ids``, after the step that
    brought it there, as a server would see it."""
    trace = Trace()
    pending = list(waves)
    live: list[Any] = []
    start = time.perf_counter()
    while pending or live:
        while pending and (not scheduler.has_work or (
                pending[0][0] is not None and trace.decode_steps >= pending[0][0])):
            now = time.perf_counter() - start
            for req in pending.pop(0)[1]:
                scheduler.add(req)
                trace.added_s[req.uid], trace.token_s[req.uid] = now, []
                trace.prompt_tokens += len(req.prompt_ids)
                live.append(req)
        result = scheduler.step()
        if result.phase == "prefill":
            trace.prefill_tokens += result.num_tokens
        elif result.phase == "decode":
            trace.decode_steps += 1
        now = time.perf_counter() - start
        for req in live:
            times = trace.token_s[req.uid]
            times += [now] * (len(req.output_ids) - len(times))
        live = [req for req in live if not req.is_finished]
    trace.wall_s = time.perf_counter() - start
    return trace


@dataclass
class AblationResult:
    """One measured arm; ``ttft_ms`` and ``itl_ms`` cover the requests ``measured`` names.
    ``arms`` names it in each ablation that reads it (ablation -> the arm's label)."""

    arms: dict[str, str]
    workload: str
    engine: dict[str, Any]  # what actually ran: graphs, fused kernels, cache, chunking
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    prefill_tokens: int
    decode_steps: int
    measured: str
    ttft_ms: dict[str, float] | None
    itl_ms: dict[str, float] | None
    predicted_saving: int | None = None
    output_lens_ok: bool = True

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def ablations(self) -> list[str]:
        return list(self.arms)

    @property
    def ttft_p50_ms(self) -> float | None:
        return None if self.ttft_ms is None else self.ttft_ms["p50"]

    @property
    def itl_p99_ms(self) -> float | None:
        return None if self.itl_ms is None else self.itl_ms["p99"]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tok_per_s"] = self.tok_per_s
        out["saved_tokens"] = self.prompt_tokens - self.prefill_tokens
        return out


def ablation_workloads(args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """The three workloads of the ablations, from the workload options, all seeded."""
    from workloads import make_shared_prefix, make_workload

    lens = (args.min_len, args.max_len)
    random_load = make_workload(args.num_requests, lens, lens, args.seed)
    shared = make_shared_prefix(args.num_requests, args.num_prefixes, args.prefix_len, lens,
                                lens, args.seed)
    shorts = make_workload(args.short_requests, lens, (args.max_len, args.max_len), args.seed)
    return {"random": (random_load, random_load.prompts(vocab_size, 0)),
            "shared-prefix": (shared, shared.prompts(vocab_size, 0)),
            "short-long": (shorts, shorts.prompts(vocab_size, 0)
                           + make_workload(args.long_requests, (args.long_len, args.long_len),
                                           (1, 1), args.seed).prompts(vocab_size, 1))}


def measure_arm(llm: Any, arm: Arm, args: argparse.Namespace, loads: dict[str, Any],
                uids: Any) -> AblationResult:
    """Run one arm's workload on a warmed-up engine and reduce its trace."""
    from measure import summarize
    from minisgl.core import Req, SamplingParams

    scheduler = llm.scheduler
    set_overlap(scheduler, arm.overlap)
    empty_prefix_cache(scheduler)
    workload, prompts = loads[arm.workload]

    def reqs(indices: Sequence[int], output_len: Callable[[int], int]) -> list[Any]:
        return [Req(next(uids), prompts[i],
                    SamplingParams(max_tokens=output_len(i), ignore_eos=True)) for i in indices]

    drawn = lambda i: workload.output_lens[i]  # noqa: E731
    predicted = None
    if arm.workload == "shared-prefix":
        # Each system prompt's first request runs to its end; then the rest, together.
        seeds = workload.first_of_each_group()
        rest = [i for i in range(workload.num_requests) if i not in seeds]
        waves = [(None, reqs(seeds, drawn)), (None, reqs(rest, drawn))]
        measured, timed = "requests after the first of each system prompt", waves[1][1]
        if scheduler.config.prefix_cache == "radix":
            predicted = workload.predicted_prefill_savings(scheduler.config.page_size)
    elif arm.workload == "short-long":
        shorts = reqs(range(workload.num_requests), drawn)
        longs = reqs(range(workload.num_requests, len(prompts)), lambda i: LONG_OUTPUT_LEN)
        waves = [(0, shorts)] + [(SHORT_LONG_FIRST_ARRIVAL + k * SHORT_LONG_ARRIVAL_GAP, [r])
                                 for k, r in enumerate(longs)]
        measured, timed = "ITL: the short requests; TTFT: the long prompts", shorts
    else:
        waves = [(0, reqs(range(workload.num_requests), drawn))]
        measured, timed = "every request", waves[0][1]
    synchronize(llm.engine.device)
    trace = run_traced(scheduler, waves)
    everyone = [r for _, wave in waves for r in wave]
    ttft_of = longs if arm.workload == "short-long" else timed
    config = scheduler.config
    return AblationResult(
        arms={arm.ablation: arm.label}, workload=arm.workload,
        engine={"cuda_graph": bool(llm.engine.graph_runner.enabled), "fused": fused_active(arm),
                "overlap": arm.overlap, "prefix_cache": config.prefix_cache,
                "chunked_prefill": config.chunked_prefill,
                "max_prefill_tokens": config.max_prefill_tokens},
        wall_s=trace.wall_s, output_tokens=sum(len(r.output_ids) for r in everyone),
        prompt_tokens=trace.prompt_tokens, prefill_tokens=trace.prefill_tokens,
        decode_steps=trace.decode_steps, measured=measured,
        ttft_ms=summarize([trace.ttft_s(r.uid) for r in ttft_of], 1e3),
        itl_ms=summarize([g for r in timed for g in trace.itl_s(r.uid)], 1e3),
        predicted_saving=predicted,
        output_lens_ok=all(len(r.output_ids) == r.params.max_tokens for r in everyone))


LONG_OUTPUT_LEN = 8  # the long prompts' outputs: their point is the prefill


def kernel_package() -> ModuleType | None:
    """``minisgl.kernel`` (chapter 20), or None in a tree without it (nothing to switch)."""
    try:
        from minisgl import kernel
    except ImportError:
        return None
    return kernel


def fused_active(arm: Arm) -> bool:
    """Whether the arm's layers called the fused kernels (they need CUDA and bf16/fp16)."""
    kernel = kernel_package()
    return (arm.fused and kernel is not None
            and any(status == "on" for status in kernel.kernel_status().values()))


def run_ablations(args: argparse.Namespace, names: Sequence[str], vocab_size: int,
                  emit: Callable[[AblationResult, bool], None]) -> None:
    """Every arm, grouped by engine so that each engine starts once; ``emit`` gets each
    result, and whether it is new or an earlier one that another ablation reads too."""
    from minisgl.llm import LLM

    loads = ablation_workloads(args, vocab_size)
    arms = ablation_arms(names, args.chunk_size)
    done: dict[tuple[Any, ...], AblationResult] = {}
    uids = itertools.count(1_000_000)  # apart from the warm-up's
    for key in dict.fromkeys(arm.engine_key for arm in arms):
        options, use_fused = key
        group = [arm for arm in arms if arm.engine_key == key]
        described = ", ".join(f"{k}={v}" for k, v in options) or "the base options"
        print(f"ablations: an engine with {described}, fused kernels "
              f"{'on' if use_fused else 'off'}, for {', '.join(a.label for a in group)}",
              flush=True)
        kernel = kernel_package()
        with kernel.use_fused(use_fused) if kernel else contextlib.nullcontext():
            # Rows (and captured graph sizes) for the largest batch the workloads make.
            rows = max(args.num_requests, args.short_requests + args.long_requests)
            llm = LLM(args.model, device=args.device, dtype=args.dtype,
                      **{"prefix_cache": "radix", "max_running_reqs": rows, **dict(options)})
            warm_up_minisgl(llm)
            for arm in group:
                if arm.run_key in done:  # the same measurement, read by another ablation
                    done[arm.run_key].arms[arm.ablation] = arm.label
                    emit(done[arm.run_key], False)
                    continue
                result = measure_arm(llm, arm, args, loads, uids)
                done[arm.run_key] = result
                emit(result, True)
        del llm
        free_device_memory(resolve_device(args.device))


def run_transformers_alongside(args: argparse.Namespace, names: Sequence[str],
                               vocab_size: int, device: Any, dtype: Any) -> AblationResult:
    """transformers' ``generate`` on the ablations' random workload, in padded batches: the
    reference the throughput ablations are read against."""
    from workloads import make_workload

    lens = (args.min_len, args.max_len)
    load = make_workload(args.num_requests, lens, lens, args.seed)
    prompts = load.prompts(vocab_size, 0)
    model = load_hf_model(Path(args.model), device, dtype)
    run = generate_padded(model, prompts, load.output_lens, args.hf_batch_size)
    del model
    free_device_memory(device)
    throughput = [n for n in names if HEADLINES[n][0] == "tok_per_s"]
    return AblationResult(
        arms=dict.fromkeys(throughput, "transformers"), workload="random",
        engine={"system": f"transformers generate, padded batches of {run.batch_size}"},
        wall_s=run.wall_s, output_tokens=run.useful, prompt_tokens=sum(load.input_lens),
        prefill_tokens=sum(load.input_lens), decode_steps=0, measured="throughput only",
        ttft_ms=None, itl_ms=None, output_lens_ok=run.ok)


@dataclass
class AblationReport:
    """Everything an ablation run measured; written to ``--out`` after every arm."""

    header: dict[str, Any]
    workload: dict[str, Any]
    results: list[AblationResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"header": self.header, "workload": self.workload,
                "headlines": {k: {"field": f, "label": label, "higher_is_better": up}
                              for k, (f, label, up) in HEADLINES.items()},
                "results": [r.to_json() for r in self.results]}


def describe_ablation(result: AblationResult) -> str:
    arms = ", ".join(f"{k} [{v}]" for k, v in result.arms.items())
    text = (f"{arms}: {result.output_tokens} output "
            f"tokens in {result.wall_s:.2f} s = {result.tok_per_s:.1f} tok/s")
    if result.decode_steps:
        text += (f"; {result.prefill_tokens} of {result.prompt_tokens} prompt tokens "
                 f"computed, {result.decode_steps} decode steps")
    if result.predicted_saving is not None:
        text += (f"; saved {result.prompt_tokens - result.prefill_tokens} "
                 f"(predicted {result.predicted_saving})")
    if result.ttft_ms is not None:
        text += f"; TTFT p50/p99 {result.ttft_ms['p50']:.1f}/{result.ttft_ms['p99']:.1f} ms"
    if result.itl_ms is not None:
        text += (f"; ITL p50/p99/max {result.itl_ms['p50']:.1f}/{result.itl_ms['p99']:.1f}/"
                 f"{result.itl_ms['max']:.1f} ms")
    if not result.output_lens_ok:
        text += "  [WARNING: output lengths differ from the asked ones]"
    return text


def format_ablation_table(report: AblationReport) -> str:
    rows = [("ablation", "arm", "tok/s", "prefill tok", "TTFT p50/p99 ms",
             "ITL p50/p99/max ms", "headline")]
    for name in ABLATIONS:
        field_name, label, _ = HEADLINES[name]
        for r in (r for r in report.results if name in r.ablations):
            value = getattr(r, field_name)
            rows.append((name, r.arms[name], f"{r.tok_per_s:.1f}",
                         f"{r.prefill_tokens}/{r.prompt_tokens}",
                         "-" if r.ttft_ms is None else
                         f"{r.ttft_ms['p50']:.1f}/{r.ttft_ms['p99']:.1f}",
                         "-" if r.itl_ms is None else
                         f"{r.itl_ms['p50']:.1f}/{r.itl_ms['p99']:.1f}/{r.itl_ms['max']:.1f}",
                         "-" if value is None else f"{label} {value:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ablation_main(args: argparse.Namespace, model_path: Path, config: dict[str, Any],
                  device: Any, dtype: Any) -> AblationReport:
    names = list(ABLATIONS) if "all" in args.ablations else \
        [n for n in ABLATIONS if n in args.ablations]
    lens = f"[{args.min_len}, {args.max_len}]"
    report = AblationReport(header=header_info(model_path, config, device, dtype), workload={
        "ablations": names, "num_requests": args.num_requests, "min_len": args.min_len,
        "max_len": args.max_len, "seed": args.seed, "num_prefixes": args.num_prefixes,
        "prefix_len": args.prefix_len, "short_requests": args.short_requests,
        "long_requests": args.long_requests, "long_len": args.long_len,
        "chunk_size": args.chunk_size})
    h = report.header
    print(f"device: {h['device']}; model: {h['model']} ({h['architecture']}), {h['dtype']}")
    print(f"versions: python {h['python']}, torch {h['torch']}, transformers "
          f"{h['transformers']}, flashinfer {h['flashinfer'] or 'not installed'}")
    print(f"ablations: {', '.join(names)}; greedy, end-of-sequence ignored")
    print(f"  random: {args.num_requests} requests, prompts and outputs uniform in {lens}")
    print(f"  shared-prefix: {args.num_requests} requests over {args.num_prefixes} system "
          f"prompts of {args.prefix_len} tokens, suffixes and outputs in {lens}; the first "
          "request of each system prompt runs alone first, the rest then together")
    print(f"  short-long: {args.short_requests} short requests (prompts in {lens}, "
          f"{args.max_len} tokens out), joined by {args.long_requests} prompts of "
          f"{args.long_len} tokens after {SHORT_LONG_FIRST_ARRIVAL} decode steps and every "
          f"{SHORT_LONG_ARRIVAL_GAP} after; prefill budget {args.chunk_size} tokens a step")
    print(flush=True)

    def emit(result: AblationResult, new: bool) -> None:
        if new:
            report.results.append(result)
            print(describe_ablation(result), flush=True)
        save(report, args.out)

    run_ablations(args, names, config["vocab_size"], emit)
    if "transformers" in args.systems and any(HEADLINES[n][0] == "tok_per_s" for n in names):
        print("transformers: generate on the random workload, alongside", flush=True)
        emit(run_transformers_alongside(args, names, config["vocab_size"], device, dtype),
             True)
    print()
    print(format_ablation_table(report))
    save(report, args.out)
    return report


# ----------------------------------------------------------------------------- printing
def header_info(model_path: Path, config: dict[str, Any], device: Any, dtype: Any
                ) -> dict[str, Any]:
    import torch
    import transformers

    try:
        import flashinfer

        flashinfer_version = getattr(flashinfer, "__version__", "installed")
    except ImportError:
        flashinfer_version = None
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}, " \
                      f"{torch.get_num_threads()} threads)"
    return {"device": device_name, "device_type": device.type, "model": str(model_path),
            "architecture": ", ".join(config.get("architectures", [])),
            "dtype": str(dtype).removeprefix("torch."), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "flashinfer": flashinfer_version}


def format_table(report: Report) -> str:
    report.update_speedups()
    rows = [("system / config", "requests", "output tok", "wall s", "tok/s", "speedup",
             "HBM floor")]
    for r in report.results:
        floor = r.decode.floor_fraction if r.decode is not None else None
        rows.append((r.label, str(r.num_requests), str(r.output_tokens), f"{r.wall_s:.2f}",
                     f"{r.tok_per_s:.1f}",
                     "-" if r.speedup is None else f"{r.speedup:.2f}x",
                     "-" if floor is None else f"{100 * floor:.1f}%"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe(result: SystemResult) -> str:
    text = (f"{result.label}: {result.output_tokens} output tokens in {result.wall_s:.2f} s = "
            f"{result.tok_per_s:.1f} tok/s")
    if result.computed_tokens != result.output_tokens:
        text += f" ({result.computed_tokens} tokens computed)"
    d = result.decode
    if d is not None:
        text += (f"; {d.prefill_steps} prefill steps {d.prefill_seconds:.2f} s, {d.steps} "
                 f"decode steps {d.seconds:.2f} s (mean batch {d.mean_batch:.1f})")
        if d.floor_fraction is not None:
            text += f", HBM floor {d.floor_seconds:.2f} s = {100 * d.floor_fraction:.1f}%"
    if not result.output_lens_ok:
        text += "  [WARNING: output lengths differ from the drawn ones]"
    return text


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmark/offline.py",
        description="Offline throughput of minisgl (overlap x prefix cache) against "
                    "transformers, on N requests with random lengths.")
    parser.add_argument("--model", default="models/tiny-qwen3",
                        help="checkpoint directory or hub id (default: models/tiny-qwen3)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or "
                             "float16")
    parser.add_argument("--num-requests", type=int, default=256, help="requests (default: 256)")
    parser.add_argument("--min-len", type=int, default=100,
                        help="shortest prompt and output, in tokens (default: 100)")
    parser.add_argument("--max-len", type=int, default=1024,
                        help="longest prompt and output, in tokens (default: 1024)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the lengths and prompts (default: 0)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                        metavar="SYSTEM",
                        help=f"systems to run, in this order: {', '.join(SYSTEMS)} "
                             "(default: all; transformers-cb is skipped, with the reason, "
                             "where the installed transformers lacks it)")
    parser.add_argument("--minisgl-configs", nargs="+", choices=MINISGL_CONFIGS,
                        default=list(MINISGL_CONFIGS), metavar="CONFIG",
                        help=f"minisgl configurations: {', '.join(MINISGL_CONFIGS)} "
                             "(default: all four)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks for minisgl (chapter 17; default: 1). Its "
                             "decode floor is then per rank: each reads its share of the weights")
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="requests per padded transformers batch (default: all in one, "
                             "halved until a batch fits the GPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the header, workload and results here as JSON")
    ablation = parser.add_argument_group(
        "ablations: one switch at a time, against the base engine (CUDA graphs, fused "
        "kernels, radix cache and overlap on, chunked prefill off)")
    ablation.add_argument("--ablations", nargs="+", choices=(*ABLATIONS, "all"), default=None,
                          metavar="NAME",
                          help=f"run these instead of the throughput comparison: "
                               f"{', '.join(ABLATIONS)} or all; transformers runs alongside "
                               "the throughput ones when --systems names it")
    ablation.add_argument("--num-prefixes", type=int, default=4,
                          help="prefix-cache: system prompts (default: %(default)s)")
    ablation.add_argument("--prefix-len", type=int, default=2048,
                          help="prefix-cache: tokens per system prompt (default: %(default)s)")
    ablation.add_argument("--short-requests", type=int, default=32,
                          help="chunked-prefill: requests decoding when the long prompts "
                               "arrive (default: %(default)s)")
    ablation.add_argument("--long-requests", type=int, default=4,
                          help="chunked-prefill: long prompts (default: %(default)s)")
    ablation.add_argument("--long-len", type=int, default=8192,
                          help="chunked-prefill: tokens per long prompt (default: %(default)s)")
    ablation.add_argument("--chunk-size", type=int, default=2048,
                          help="chunked-prefill: the prefill token budget of both arms "
                               "(default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (one line per system is still printed)")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_requests < 1:
        parser.error(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if not 1 <= args.min_len <= args.max_len:
        parser.error(f"need 1 <= --min-len <= --max-len, got {args.min_len} and {args.max_len}")
    for flag in ("num_prefixes", "prefix_len", "short_requests", "long_requests", "long_len",
                 "chunk_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.ablations and args.num_prefixes > args.num_requests:
        parser.error(f"--num-prefixes ({args.num_prefixes}) must not exceed --num-requests "
                     f"({args.num_requests})")
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        parser.error(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")


def main(argv: Sequence[str] | None = None) -> Report | AblationReport:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        import minisgl  # noqa: F401
    except ImportError:  # run from a checkout that was not pip-installed
        sys.path.insert(0, str(ROOT))
    from minisgl.utils.hf import load_hf_config, resolve_model_path
    from minisgl.utils.torch_utils import resolve_dtype

    model_path = Path(resolve_model_path(args.model))
    args.model = str(model_path)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    config = load_hf_config(model_path)
    if args.ablations:
        return ablation_main(args, model_path, config, device, dtype)
    workload = make_workload(args.num_requests, args.min_len, args.max_len, args.seed,
                             config["vocab_size"])

    report = Report(header=header_info(model_path, config, device, dtype), workload={
        "num_requests": workload.num_requests, "min_len": args.min_len,
        "max_len": args.max_len, "seed": args.seed, "input_lens": workload.input_lens,
        "output_lens": workload.output_lens, "output_tokens": workload.output_tokens})
    h = report.header
    print(f"device: {h['device']}; model: {h['model']} ({h['architecture']}), {h['dtype']}")
    print(f"versions: python {h['python']}, torch {h['torch']}, transformers "
          f"{h['transformers']}, flashinfer {h['flashinfer'] or 'not installed'}")
    print(f"workload: {workload.num_requests} requests, prompt and output lengths uniform in "
          f"[{args.min_len}, {args.max_len}] (seed {args.seed}): {sum(workload.input_lens)} "
          f"prompt tokens, {workload.output_tokens} output tokens (longest "
          f"{max(workload.output_lens)}); greedy, end-of-sequence ignored")
    bandwidth = None
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device)
        report.header["copy_bandwidth_bytes_per_s"] = bandwidth
        print(f"device copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + written); the HBM "
              "floor of a decode step is the weights plus every request's KV read once at it")
    print(flush=True)

    def emit(result: SystemResult) -> None:
        report.results.append(result)
        report.update_speedups()
        print(describe(result), flush=True)
        save(report, args.out)

    if "minisgl" in args.systems:
        run_minisgl(args, workload, args.minisgl_configs, bandwidth, emit)
    hf_systems = [s for s in args.systems if s.startswith("transformers")]
    if hf_systems:
        model = load_hf_model(model_path, device, dtype)
        if "transformers" in hf_systems:
            run_transformers(args, workload, model, emit)
            free_device_memory(device)  # its KV cache, cached by PyTorch, out of the next's way
        if "transformers-cb" in hf_systems:
            reason = cb_unavailable_reason(model)
            if reason is None:
                try:
                    run_transformers_cb(args, workload, model, emit)
                except Exception as exc:  # noqa: BLE001 (a failing baseline must not lose the rest)
                    reason = f"it failed: {type(exc).__name__}: {exc}"
            if reason is not None:
                report.skipped["transformers-cb"] = reason
                print(f"transformers-cb: skipped ({reason})", flush=True)
                save(report, args.out)
        del model
        free_device_memory(device, say="transformers freed")

    print()
    print(format_table(report))
    if report.baseline() is None:
        print("(speed-up is relative to transformers, which did not run)")
    save(report, args.out)
    return report


def save(report: Report, path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(report.to_json(), indent=1) + "\n")


if __name__ == "__main__":
    main()
