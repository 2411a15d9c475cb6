"""Run an exercise's tests inside the reader's browser (Pyodide, in a Web Worker).

The practice page's worker writes the exercise's bundle (the layout `practice/judge.py`'s
`stage` makes: the chapter's `minisgl` tree at the root, the tests and the learner's file in
`exercise/`) into Pyodide's file system, then calls `run` with the code from the editor. The
tests run in-process with pytest, which writes the same JUnit report the local judge reads,
through the same `results.read_junit`; so a test passes, fails or skips here as it does there.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# Modules a run imports from the bundle: dropped before the next run, so edits take effect.
BUNDLE_MODULES = ("minisgl", "conftest", "test_exercise")


def forget_modules(learner_module: str) -> None:
    for name in list(sys.modules):
        if name.partition(".")[0] in (*BUNDLE_MODULES, learner_module):
            del sys.modules[name]


def run(root: str, learner_file: str, code: str) -> str:
    """Write `code` as the learner's file, run the tests, return the results as JSON:
    a list of {"name", "outcome", "message"}."""
    import pytest  # here, not at import: the worker installs pytest before it calls run

    from results import read_junit

    top = Path(root)
    here = top / "exercise"
    (here / learner_file).write_text(code, encoding="utf-8")
    forget_modules(Path(learner_file).stem)
    for path in (str(top), str(here)):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
    os.environ["MSGPACK_PUREPYTHON"] = "1"  # msgpack's C extension does not exist here
    report = top / "report.xml"
    report.unlink(missing_ok=True)
    previous = os.getcwd()
    os.chdir(here)
    try:
        pytest.main(["-q", "--tb=line", "-p", "no:cacheprovider", f"--junitxml={report}",
                     "test_exercise.py"])
    finally:
        os.chdir(previous)
    found = read_junit(report) if report.exists() else []
    if not found:
        found_json = [{"name": "collecting the tests", "outcome": "failed",
                       "message": "pytest collected no test: see the output below"}]
        return json.dumps(found_json)
    return json.dumps([{"name": r.name, "outcome": r.outcome, "message": r.message}
                       for r in found])
