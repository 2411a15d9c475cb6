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
    """`"4,096"`, `"16.0 MiB"`, `"0.0688"` -> the number at the start."""
    match = re.match(r"-?[\d,]*\.?\d+", text.strip())
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
