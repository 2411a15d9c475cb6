"""The figures a chapter derives from a recorded output, recomputed from the recording.

A page reads its example's recording (`docs/recorded/*.txt`) and states figures derived from it:
a ratio, a sum, a quotient. When the example is recorded again those figures can go stale
without anyone noticing. Each test here recomputes one chapter's figures from the recording as
it is now and checks that the page states them.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def recording(name: str) -> dict[str, list[str]]:
    """A recording's lines, keyed by their label: the text before the first run of two or more
    spaces (or before `=`), with the values after it split on such runs.

    `"KV bytes per token, fp32      4,096      229,376"` -> `{"KV bytes per token, fp32":
    ["4,096", "229,376"]}`; `"  MINISGL_LOG_LEVEL = 'INFO'"` -> `{"MINISGL_LOG_LEVEL": ["'INFO'"]}`.
    The whole text is under the key `""`.
    """
    text = (ROOT / "docs" / "recorded" / f"{name}.txt").read_text(encoding="utf-8")
    lines: dict[str, list[str]] = {"": [text]}
    for line in text.splitlines():
        parts = [p for p in re.split(r"\s{2,}|\s=\s", line.strip()) if p]
        if len(parts) > 1:
            lines.setdefault(parts[0], parts[1:])
    return lines


def page(chapter: str) -> str:
    """A chapter page's text with every run of whitespace made one space, so that a figure
    broken across two lines of the source still matches."""
    path = next((ROOT / "chapters").glob(f"{chapter}_*.md"))
    return " ".join(path.read_text(encoding="utf-8").split())


def number(text: str) -> float:
    """`"4,096"`, `"16.0 MiB"`, `"1.79e-06"` -> the number at the start."""
    match = re.match(r"-?[\d,]*\.?\d+(?:e[+-]?\d+)?", text.strip())
    assert match, f"no number at the start of {text!r}"
    return float(match.group().replace(",", ""))


def test_ch01_kv_figures() -> None:
    rec = recording("ch01_config-cpu")
    text = page("ch01")
    tiny_fp32, qwen_fp32 = (int(number(v)) for v in rec["KV bytes per token, fp32"])
    tiny_bf16, qwen_bf16 = (int(number(v)) for v in rec["KV bytes per token, bf16"])
    assert (tiny_bf16, qwen_bf16) == (tiny_fp32 // 2, qwen_fp32 // 2)
    assert f"{tiny_fp32:,} and {qwen_fp32:,} bytes per token in float32" in text
    assert f"({tiny_bf16:,} and {qwen_bf16:,})" in text

    # the 4,096-token context, with and without GQA
    qwen_context = number(rec["4096-token context, bf16"][1])
    assert qwen_context == 4096 * qwen_bf16 / 2**20
    without_gqa = number(rec["without GQA, bf16"][1])
    assert without_gqa == 2 * qwen_context
    assert f"costs Qwen3-0.6B {qwen_context:.0f} MiB in bfloat16" in text
    assert f"the {without_gqa:.0f} MiB it would cost" in text

    # one sequence at the full trained length
    max_positions = int(number(rec["max positions"][1]))
    full = max_positions * qwen_bf16 / 2**30
    assert f"{max_positions:,} × {qwen_bf16:,} bytes = {full:g} GiB" in text

    # the default CPU budget in tiny-qwen3 tokens
    budget = int(number(rec["MINISGL_CPU_KV_MEMORY"][0]))
    tokens = budget // tiny_fp32
    assert f"holds {tokens:,} tokens of tiny-qwen3 in fp32" in rec[""][0]
    assert f"{budget:,} bytes divided by {tiny_fp32:,} bytes per token holds {tokens:,}" in text


def test_ch02_layer_differences() -> None:
    rec = recording("ch02_layers-cpu")
    text = page("ch02")
    diffs = {label: number(values[-1]) for label, values in rec.items()
             if values and re.fullmatch(r"\d\.\d\de[+-]\d\d", values[-1])}
    exact = [label for label, diff in diffs.items() if diff == 0]
    inexact = {label: diff for label, diff in diffs.items() if diff != 0}
    assert len(diffs) == 13, f"expected 13 comparisons, read {sorted(diffs)}"
    assert len(exact) == 12 and "thirteen comparisons" in text and "twelve come out bit" in text
    (label, diff), = inexact.items()
    assert label.startswith("RowParallelLinear, 2 ranks")
    assert f"reads {diff:.2e}" in text
    # "under four units in the last place" for outputs of about 5: float32 spacing in [4, 8)
    ulp = 2.0 ** (2 - 23)
    assert f"{ulp:.1e}".replace("e-0", "e-") in text and diff / ulp < 4


def test_ch03_logits_figures() -> None:
    rec = recording("ch03_qwen3-cpu")
    text = page("ch03")
    params = re.search(r"([\d,]+) parameters", rec[""][0]).group(1)
    assert f"**{params}**" in text, "the table's total is the recorded parameter count"
    rows, vocab = map(int, re.search(r"logits \((\d+), (\d+)\)", rec[""][0]).groups())
    prompt = re.search(r"-> (\d+) tokens", rec[""][0]).group(1)
    assert int(prompt) == rows and f"The prompt is {rows} tokens" in text
    assert f"the {rows * vocab:,} differences" in text
    absolute, relative = re.search(r"max abs diff (\S+), relative (\S+)", rec[""][0]).groups()
    assert f"is {absolute};" in text and f"that is {relative}," in text


def test_ch04_sampling_and_cache_figures() -> None:
    rec = recording("ch04_generate-cpu")
    text = page("ch04")
    whole = rec[""][0]
    first_step = {m.group(1).strip(): (int(m.group(2)), float(m.group(3)))
                  for m in re.finditer(r"^  (\S.*?)\s+kept\s+(\d+)\s+p\(top\) (\S+)", whole, re.M)}
    kept_t1, top_t1 = first_step["temperature 1.0"]
    assert f"keeps all {kept_t1:,} tokens, the best at {top_t1}" in text
    assert f"sharpens that best to {first_step['temperature 0.3'][1]}" in text
    kept_k, top_k = first_step["top-k 5"]
    assert f"{top_t1} / {top_k:.4f} ≈ {round(100 * top_t1 / top_k)}%" in text
    kept_p, top_p = first_step["top-p 0.5"]
    assert round(top_p / top_t1) == 2
    assert f"keeps {kept_p}, its best at {top_p}, twice {top_t1}" in text
    kept_min_p, _ = first_step["min-p 0.2"]
    assert f"keeps the {kept_min_p} tokens above 0.2 × {top_t1} = {0.2 * top_t1:.4f}" in text

    # the settings that share the seed part where a filter removed the token the noise favoured
    runs = [list(map(int, re.findall(r"\d+", m.group(1))))
            for m in re.finditer(r"ids \[([\d, ]+)\]", whole)]
    _greedy, t1, _t03, topk, topp = runs[:5]
    shared = next(i for i, (a, b) in enumerate(zip(t1, topp)) if a != b)
    assert shared == 5 and f"same five tokens ({', '.join(map(str, t1[:5]))})" in text
    assert f"the nucleus lacked {t1[5]}" in text
    assert topk[1] != t1[1] and f"where {t1[1]} was not among the five best" in text
    assert all(run[0] == t1[0] for run in runs[1:]) and f"starts with {t1[0]}" in text

    # token passes with and without the cache, and the measured speed-up
    prompt = int(re.search(r"-> (\d+) tokens", whole).group(1))
    new = int(re.search(r"greedy, (\d+) new tokens", whole).group(1))
    without = new * prompt + new * (new - 1) // 2
    with_cache = prompt + new - 1
    passes = f"**{without:,}** against **{with_cache:,}**, {without // with_cache} times fewer"
    assert passes in text
    slow = number(rec["no cache (re-run every token)"][0])
    fast = number(rec["contiguous KV cache"][0])
    assert f"speed-up: {fast / slow:.1f}x" in whole
    assert f"{fast / slow:.1f} times faster: {slow} tokens per second without, {fast} with" in text
