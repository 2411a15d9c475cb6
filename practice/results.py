"""One test's outcome, read from pytest's JUnit XML report.

Shared by the local judge (`practice/judge.py`) and the in-browser runner
(`practice/browser_run.py`), so both print the same verdict and message for the same test.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

MESSAGE_CHARS = 300


@dataclass(frozen=True)
class TestResult:
    name: str
    outcome: str  # "passed", "failed" or "skipped"
    message: str

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


def read_junit(report: Path) -> list[TestResult]:
    """Every test case of a JUnit XML report; a failure or error keeps its first line."""
    results = []
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            outcome, message = "failed", first_line(bad.get("message") or bad.text or "")
        elif skipped is not None:
            outcome, message = "skipped", first_line(skipped.get("message") or "")
        else:
            outcome, message = "passed", ""
        results.append(TestResult(case.get("name", "?"), outcome, message))
    return results


def first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0][:MESSAGE_CHARS] if lines else ""
