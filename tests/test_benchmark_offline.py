"""The offline benchmark (``benchmark/offline.py``): its own numbers must add up.

One small run on the CPU with the tiny model: every system must produce exactly the output
lengths the seeded workload drew, the throughputs must be tokens over seconds, and the speed-ups
the ratios of the throughputs it printed. The workload itself is checked without a model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmark" / "offline.py"
NUM_REQUESTS, MIN_LEN, MAX_LEN = 8, 8, 32


@pytest.fixture(scope="module")
def offline(repo_script: Callable[[str], ModuleType]) -> ModuleType:
    return repo_script("benchmark/offline.py")


def test_the_workload_is_reproducible_and_within_bounds(offline: ModuleType) -> None:
    first = offline.make_workload(64, 100, 1024, seed=0, vocab_size=151936)
    again = offline.make_workload(64, 100, 1024, seed=0, vocab_size=151936)
    other = offline.make_workload(64, 100, 1024, seed=1, vocab_size=151936)
    assert first.prompts == again.prompts and first.output_lens == again.output_lens
    assert first.output_lens != other.output_lens, "another seed must draw other lengths"
    for n in first.input_lens + first.output_lens:
        assert 100 <= n <= 1024
    assert all(0 <= t < 151936 for prompt in first.prompts for t in prompt)
    assert first.output_tokens == sum(first.output_lens)


def test_the_hbm_floor_counts_weights_and_every_context_once_per_step(
        offline: ModuleType) -> None:
    """Two requests (prompts 10 and 4): a prefill, two decode steps with both, one with the
    first alone, and an overlapped drain step (it waits for the last decode batch). Decode step
    k of a request reads its prompt plus k tokens of KV."""
    log = offline.StepLog(seconds=[0.5, 1.0, 1.0, 2.0, 0.25],
                          phases=["prefill", "decode", "decode", "decode", None],
                          uids=[(0, 1), (0, 1), (0, 1), (0,), ()], prompt_lens={0: 10, 1: 4})
    stats = offline.decode_stats(log, weight_bytes=100, kv_bytes_per_token=2, bandwidth=50.0)
    assert (stats.steps, stats.prefill_steps) == (3, 1)
    assert (stats.seconds, stats.prefill_seconds) == (4.25, 0.5)
    assert stats.mean_batch == pytest.approx(5 / 3)
    contexts = (11 + 5) + (12 + 6) + 13
    assert stats.floor_seconds == pytest.approx((3 * 100 + 2 * contexts) / 50.0)
    assert stats.floor_fraction == pytest.approx(stats.floor_seconds / 4.25)
    no_gpu = offline.decode_stats(log, 100, 2, bandwidth=None)
    assert no_gpu.floor_seconds is None and no_gpu.floor_fraction is None


def test_transformers_batches_halve_until_they_fit_unless_a_size_was_asked_for(
        offline: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in ``generate`` runs out of memory above 3 rows: a run of 7 requests in one
    batch starts over in batches of 4, then 2, and counts only that last run's tokens."""
    import torch

    calls: list[int] = []

    def generate(model: object, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
        calls.append(len(prompts))
        if len(prompts) > 3:
            raise torch.OutOfMemoryError("stand-in: too many rows")
        return torch.zeros(len(prompts), max_new_tokens, dtype=torch.int64)

    monkeypatch.setattr(offline, "hf_generate", generate)
    model = type("Model", (), {"device": torch.device("cpu")})()
    prompts, lens = [[1, 2]] * 7, [5, 1, 2, 3, 4, 6, 7]
    run = offline.generate_padded(model, prompts, lens, size=None)  # none asked for: all 7
    assert calls == [2, 7, 4, 2, 2, 2, 1]  # warm-up, 7 fails, 4 fails, then 2 + 2 + 2 + 1
    assert (run.batch_size, run.useful, run.ok) == (2, sum(lens), True)
    assert run.computed == 2 * 5 + 2 * 3 + 2 * 6 + 1 * 7  # each batch to its longest output
    with pytest.raises(RuntimeError, match="smaller --hf-batch-size"):
        offline.generate_padded(model, prompts, lens, size=4)


@pytest.fixture(scope="module")
def cpu_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench") / "results.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--device", "cpu",
         "--num-requests", str(NUM_REQUESTS), "--min-len", str(MIN_LEN),
         "--max-len", str(MAX_LEN), "--no-progress", "--out", str(out)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_every_system_produces_exactly_the_drawn_lengths(cpu_run: tuple[dict, str],
                                                         offline: ModuleType) -> None:
    report, _ = cpu_run
    workload = report["workload"]
    vocab_size = json.loads((ROOT / "models/tiny-qwen3/config.json").read_text())["vocab_size"]
    drawn = offline.make_workload(NUM_REQUESTS, MIN_LEN, MAX_LEN, seed=0, vocab_size=vocab_size)
    assert workload["input_lens"] == drawn.input_lens, "the prompts are not the seed's"
    assert workload["output_lens"] == drawn.output_lens, "the lengths are not the seed's"
    assert all(MIN_LEN <= n <= MAX_LEN for n in workload["input_lens"] + workload["output_lens"])
    ran = {(r["system"], r["config"]) for r in report["results"]}
    assert {c for s, c in ran if s == "minisgl"} == {
        "overlap, radix", "sync, radix", "overlap, naive", "sync, naive"}
    assert ("transformers", f"padded batches of {NUM_REQUESTS}") in ran
    assert "transformers-cb" in {s for s, _ in ran} | set(report["skipped"]), \
        "transformers-cb must run or say why it was skipped"
    for r in report["results"]:
        assert r["num_requests"] == NUM_REQUESTS
        assert r["output_tokens"] == sum(drawn.output_lens), r["system"]
        assert r["output_lens_ok"], f"{r['system']} ({r['config']}): other output lengths"
        if r["system"] == "transformers":  # one padded batch: every row to the longest
            assert r["computed_tokens"] == NUM_REQUESTS * max(drawn.output_lens)
        else:
            assert r["computed_tokens"] == r["output_tokens"]
        if r["system"] == "minisgl":
            decode = r["decode"]
            assert decode["steps"] >= max(drawn.output_lens) - 1
            assert 1 <= decode["mean_batch"] <= NUM_REQUESTS
            assert decode["floor_fraction"] is None, "no HBM floor without a GPU"


@pytest.mark.slow
def test_throughputs_and_speedups_are_what_was_printed(cpu_run: tuple[dict, str]) -> None:
    report, stdout = cpu_run
    results = report["results"]
    base = next(r for r in results if r["system"] == "transformers")
    table = {}
    for line in stdout.splitlines():
        match = re.match(r"^(\S.*\))\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+(\S+)$",
                         line)
        if match:
            table[match[1]] = [float(x) for x in match.groups()[1:6]]
    for r in results:
        label = f"{r['system']} ({r['config']})"
        assert r["tok_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["speedup"] == pytest.approx(r["tok_per_s"] / base["tok_per_s"])
        requests, tokens, wall, tok_s, speedup = table[label]
        assert (requests, tokens) == (r["num_requests"], r["output_tokens"])
        assert wall == pytest.approx(r["wall_s"], abs=0.006)
        assert tok_s == pytest.approx(r["tok_per_s"], abs=0.06)
        printed_ratio = tok_s / table[f"transformers (padded batches of {NUM_REQUESTS})"][3]
        assert speedup == pytest.approx(printed_ratio, abs=0.006 + 0.01 * printed_ratio), \
            f"{label}: the printed speed-up is not the ratio of the printed throughputs"
