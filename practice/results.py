"""One test's outcome, read from pytest's JUnit XML report and the judge's failure report.

Shared by the local judge (`practice/judge.py`) and the in-browser runner
(`practice/browser_run.py`), so both show the same verdict, message and values for a test.
"""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

MESSAGE_CHARS = 300
MESSAGE_LINES = 8


@dataclass(frozen=True)
class TestResult:
    name: str
    outcome: str  # "passed", "failed" or "skipped"
    message: str  # a failure's message (several lines where the test gave them), or a skip's
    values: dict[str, str] = field(default_factory=dict)  # the test's locals when it failed

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


def read_results(report: Path, failures: Path | None = None) -> list[TestResult]:
    """Every test case of the JUnit report; a failure takes its message and the test's values
    from `failures` (written by the judge's failure_report plugin) where that file has them."""
    details = {}
    if failures is not None and failures.exists():
        details = json.loads(failures.read_text(encoding="utf-8"))
    results = []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "?")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            detail = details.get(name, {})
            message = "\n".join(detail.get("message", [])) \
                or first_lines(bad.get("message") or bad.text or "")
            results.append(TestResult(name, "failed", message, detail.get("locals", {})))
        elif skipped is not None:
            reason = first_lines(skipped.get("message") or "", 1)
            results.append(TestResult(name, "skipped", reason))
        else:
            results.append(TestResult(name, "passed", ""))
    return results


def first_lines(text: str, limit: int = MESSAGE_LINES) -> str:
    lines = [line[:MESSAGE_CHARS] for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:limit])
