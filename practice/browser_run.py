"""Run an exercise's tests inside the reader's browser (Pyodide, in a Web Worker).

The practice page's worker writes the exercise's bundle (the layout `practice/judge.py`'s
`stage` makes: the chapter's `minisgl` tree at the root, the tests and the learner's file in
`exercise/`) into Pyodide's file system, then calls `run` with the code from the editor. The
tests run in-process with pytest, which writes the same JUnit report the local judge reads,
through the same `results.read_results`, with the judge's plugins (the guard against the
engine's own answer, the failure report); so a test passes, fails or skips here as it does there.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# Modules a run imports from the bundle: dropped before the next run, so edits take effect and
# the judge's plugins start with no state from the last run.
BUNDLE_MODULES = ("minisgl", "conftest", "test_exercise", "engine_guard", "failure_report")


def forget_modules(learner_module: str) -> None:
    for name in list(sys.modules):
        if name.partition(".")[0] in (*BUNDLE_MODULES, learner_module):
            del sys.modules[name]


def run(root: str, learner_file: str, code: str, engine_answer: dict[str, str]) -> str:
    """Write `code` as the learner's file, run the tests with the judge's plugins, and return
    the results as JSON: a list of {"name", "outcome", "message", "values"}."""
    import pytest  # here, not at import: the worker installs pytest before it calls run

    from results import read_results

    top = Path(root)
    here = top / "exercise"
    learner = here / learner_file
    learner.write_text(code, encoding="utf-8")
    forget_modules(learner.stem)
    for path in (str(top), str(top / "judge_plugins"), str(here)):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
    import engine_guard
    import failure_report

    report, failures = top / "report.xml", top / "failures.json"
    for old in (report, failures):
        old.unlink(missing_ok=True)
    os.environ.update({
        engine_guard.LEARNER_FILE_VAR: str(learner),
        engine_guard.ANSWERS_VAR: json.dumps(engine_answer),
        failure_report.REPORT_VAR: str(failures),
        "MSGPACK_PUREPYTHON": "1",  # msgpack's C extension does not exist here
    })
    previous = os.getcwd()
    os.chdir(here)
    try:
        pytest.main(["-q", "--tb=line", "-p", "no:cacheprovider", "-p", "engine_guard",
                     "-p", "failure_report", f"--junitxml={report}", "test_exercise.py"])
    finally:
        os.chdir(previous)
    found = read_results(report, failures) if report.exists() else []
    if not found:
        return json.dumps([{"name": "collecting the tests", "outcome": "failed",
                            "message": "pytest collected no test: see its output below",
                            "values": {}}])
    return json.dumps([{"name": r.name, "outcome": r.outcome, "message": r.message,
                        "values": r.values} for r in found])
