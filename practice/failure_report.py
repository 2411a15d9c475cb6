"""A pytest plugin the judge loads: for a failed test, what went in, was expected, came out.

An assertion's message says what the test expected; pytest's rewritten assertion adds the
values it compared. To show the *input* as well, this plugin keeps the local variables of the
test function at the moment it failed (the parameters, the arguments it built, the values it
got back) and writes everything to the JSON file named by `JUDGE_FAILURE_REPORT`, which the
judge prints under the failing test.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPORT_VAR = "JUDGE_FAILURE_REPORT"
MAX_MESSAGE_LINES = 8
MAX_REPR = 160

_failures: dict[str, dict[str, Any]] = {}


def _short_repr(value: Any) -> str:
    text = repr(value)
    if "\n" in text:
        text = " ".join(part.strip() for part in text.splitlines())
    return text if len(text) <= MAX_REPR else text[: MAX_REPR - 3] + "..."


def _worth_showing(name: str, value: Any) -> bool:
    """Values a learner reasons about; not modules, functions, classes or pytest's fixtures."""
    if name.startswith(("_", "@")) or name in {"request", "monkeypatch", "capsys", "tmp_path"}:
        return False
    if isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                          types.MethodType, type)):
        return False
    return not type(value).__module__.startswith(("_pytest", "pytest"))


def _test_locals(excinfo: pytest.ExceptionInfo[BaseException], test_file: Path) -> dict[str, str]:
    """The locals of the innermost frame of the test file on the failing traceback."""
    frame_locals: dict[str, Any] = {}
    for entry in excinfo.traceback:
        if Path(str(entry.path)).resolve() == test_file:
            frame_locals = entry.locals
    return {name: _short_repr(value) for name, value in frame_locals.items()
            if _worth_showing(name, value)}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.passed or call.excinfo is None or item.name in _failures:
        return
    lines = [line for line in call.excinfo.exconly().splitlines() if line.strip()]
    if len(lines) > MAX_MESSAGE_LINES:
        lines = lines[:MAX_MESSAGE_LINES] + ["..."]
    _failures[item.name] = {
        "message": lines,
        "locals": _test_locals(call.excinfo, Path(str(item.path)).resolve()),
    }


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(REPORT_VAR)
    if path:
        Path(path).write_text(json.dumps(_failures, indent=1), encoding="utf-8")
