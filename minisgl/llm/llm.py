"""``LLM``: offline batch generation on the scheduler, in the calling process.

Tokenize the prompts, hand them all to a :class:`~minisgl.scheduler.scheduler.Scheduler`, step
it until every request has finished, detokenize: the scheduler admits what the KV cache holds
and batches continuously, so a thousand prompts need no more memory than the pool. The server
puts the same scheduler in a process of its own. ``LLM(path, overlap=False)`` runs the
synchronous loop; ``LLM(path, tp=2)`` makes this process rank 0 of two and starts the other
(:mod:`minisgl.scheduler.tp`), which :meth:`LLM.close` stops. Chapter 9 tells the story.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from typing import Any

from tqdm import tqdm

from minisgl.core import Req, SamplingParams
from minisgl.distributed.peers import watching_started_ranks
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.tp import TPLaunch, check_tp, run_tp_follower, start_leader
from minisgl.tokenizer.tokenize import load_tokenizer
from minisgl.utils.checks import is_int
from minisgl.utils.heap import frozen_heap
from minisgl.utils.hf import resolve_model_path
from minisgl.utils.processes import (WorkerFailed, new_ready_queue, start_process, stop_processes,
                                     wait_ready)
from minisgl.utils.torch_utils import configure_cpu_threads

# How long a failed start waits for the other ranks' own reports before it gives its own.
RANK_REPORT_WAIT_S = 2.0
# A progress bar is worth its lines on stderr only for batches that take a while.
PROGRESS_MIN_PROMPTS = 32

Prompt = str | Sequence[int]
Completion = dict[str, Any]  # {"text": str, "token_ids": list[int], "finish_reason": str}


class LLM:
    """A model ready to complete prompts, offline.

    Args:
        model: a checkpoint directory, or a Hugging Face hub id (downloaded once).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``bfloat16`` or
            ``float16``.
        tp: tensor-parallel ranks (on CPU with gloo; on CUDA rank r uses GPU r).
        **engine_options: any other field of :class:`~minisgl.scheduler.config.SchedulerConfig`
            (``page_size``, ``num_pages``, ``max_running_reqs``, ``max_prefill_tokens``,
            ``prefix_cache``, ``overlap``, ...).

    Attributes:
        scheduler: the scheduler the requests run on (and through it, ``scheduler.engine``).
        tokenizer: the checkpoint's tokenizer (a ``transformers`` tokenizer).
    """

    def __init__(self, model: str | os.PathLike[str], device: str = "auto", dtype: str = "auto",
                 tp: int = 1, **engine_options: Any) -> None:
        _check_engine_options(engine_options)
        path = resolve_model_path(model)
        configure_cpu_threads("model", processes=tp)  # this process runs the model (rank 0)
        config = SchedulerConfig(path, device=device, dtype=dtype, **engine_options)
        check_tp(path, tp)
        self._followers: list[BaseProcess] = []
        self.scheduler = Scheduler(config) if tp == 1 else self._start_tp(config, tp)
        self.tokenizer = load_tokenizer(path)
        self._uids = itertools.count()  # uids stay unique across generate() calls

    def _start_tp(self, config: SchedulerConfig, tp: int) -> Scheduler:
        """Start ranks 1..tp-1, become rank 0, and wait until every rank has loaded.

        A rank that fails or exits on the way ends the wait at once: it aborts the group
        (``watching_started_ranks``), and its own error is raised, not rank 0's.
        """
        launch = TPLaunch.new(tp)
        ready = new_ready_queue()
        scheduler = None
        try:
            for rank in range(1, tp):
                self._followers.append(start_process(
                    run_tp_follower, f"minisgl-scheduler-rank{rank}",
                    args=(config, launch, rank, ready)))
            with watching_started_ranks(self._followers):
                scheduler = start_leader(config, launch)  # once every rank joined
                wait_ready(ready, self._followers)  # as long as a large model takes to load
        except BaseException as exc:
            # Rank 0's error (not a worker's report, not Ctrl-C) is often only the echo of
            # another rank's (a collective whose peer died): that rank's own report, if there
            # is one, says what went wrong.
            try:
                if isinstance(exc, Exception) and not isinstance(exc, WorkerFailed):
                    # a failed or exited rank reports within a moment
                    wait_ready(ready, self._followers, timeout_s=RANK_REPORT_WAIT_S)
            except WorkerFailed as report:
                raise report from exc
            except RuntimeError:  # none failed or exited within the wait
                pass
            finally:
                stop_processes(self._followers)
                if scheduler is not None:
                    scheduler.close()
            raise
        return scheduler

    def close(self) -> None:
        """Stop the other ranks (tensor parallelism) and leave their group; idempotent."""
        if self._followers:
            stop_processes(self._followers)
            self._followers = []
            self.scheduler.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def engine(self):  # the Engine: for its device, dtype and KV budget
        return self.scheduler.engine

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, progress: bool | None = None) -> list[Completion]:
        """Complete every prompt; the results come back in the order of ``prompts``.

        Args:
            prompts: strings (tokenized with the checkpoint's tokenizer) or lists of token ids,
                mixed freely. A single string is one prompt.
            sampling_params: one :class:`SamplingParams` for every prompt, a list with one per
                prompt, or None for the defaults.
            progress: show a progress bar on stderr; None shows one for batches of
                ``PROGRESS_MIN_PROMPTS`` prompts or more.

        Returns:
            One dict per prompt: ``token_ids`` (every generated token, including the one that
            stopped generation, as ``transformers.generate`` returns them), ``text`` (those
            tokens decoded, without an end-of-sequence or stop token that ended the request)
            and ``finish_reason`` (``"stop"`` or ``"length"``).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        prompt_ids = [self._encode(i, prompt) for i, prompt in enumerate(_as_list(prompts))]
        params = _params_per_prompt(sampling_params, len(prompt_ids))
        reqs = [Req(next(self._uids), ids, p) for ids, p in zip(prompt_ids, params)]
        show = len(reqs) >= PROGRESS_MIN_PROMPTS if progress is None else progress
        self._run(reqs, show)
        return [self._completion(req) for req in reqs]

    def _run(self, reqs: list[Req], show_progress: bool) -> None:
        """Add every request, then step the scheduler until all of them have finished."""
        pending = {req.uid for req in reqs}
        try:
            for req in reqs:
                self.scheduler.add(req)
            # The start-up heap is never garbage: no full collection pauses the loop over it.
            with frozen_heap(), tqdm(total=len(reqs), desc="generate", unit="req",
                                     disable=not show_progress) as bar:
                while pending:
                    result = self.scheduler.step()
                    # An overlapped step may launch nothing and only read the last batch's
                    # tokens: idle, yet some requests finished.
                    assert result.phase is not None or result.finished, \
                        "requests pending, yet the scheduler had no work"
                    pending.difference_update(req.uid for req in result.finished)
                    bar.update(len(result.finished))
        finally:  # an error or Ctrl-C: drop what is left, so that no page stays taken
            for uid in pending:
                self.scheduler.abort(uid)

    def _completion(self, req: Req) -> Completion:
        assert req.finish_reason is not None, req
        # an EOS or stop token is a signal, not text
        text_ids = req.output_ids[:-1] if req.finish_reason == "stop" else req.output_ids
        return {"text": self.tokenizer.decode(text_ids), "token_ids": list(req.output_ids),
                "finish_reason": req.finish_reason}

    def _encode(self, index: int, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(is_int(t) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise TypeError(f"prompt {index} must be a string or a list of token ids, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"prompt {index} is empty: a prompt needs at least one token")
        return ids

    def __repr__(self) -> str:
        return f"LLM({self.scheduler.engine!r})"


def _as_list(prompts: Sequence[Prompt]) -> list[Prompt]:
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of strings or of token-id lists, "
                        f"got {type(prompts).__name__}")
    if prompts and all(is_int(p) for p in prompts):
        raise TypeError("prompts is a flat list of integers; for one prompt given as token ids "
                        "pass a list holding that list: [[1, 2, 3]]")
    return list(prompts)


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                       num_prompts: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        params = [SamplingParams() if params is None else params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"sampling_params has {len(params)} entries for {num_prompts} prompts; "
                         "pass one SamplingParams for all, or one per prompt")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, "
                            f"got {type(p).__name__}")
        # Stop strings are matched on text, by the server's detokenizer; LLM decodes only
        # once a request has finished, so it could not stop there: say so, rather than return
        # text that runs past the stop string.
        if p.stop:
            raise ValueError(f"sampling_params[{i}].stop={p.stop!r}: stop strings are applied "
                             "by the server's detokenizer; LLM.generate supports "
                             "stop_token_ids (or cut the returned text yourself)")
    return params


def _check_engine_options(options: dict[str, Any]) -> None:
    allowed = sorted(f.name for f in dataclasses.fields(SchedulerConfig)
                     if f.name not in ("model_path", "device", "dtype"))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; "
                        f"the options are: {', '.join(allowed)}")

