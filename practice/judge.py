#!/usr/bin/env python3
"""Judge the practice exercises.

Each exercise lives in `practice/<id>/` (for example `practice/ch04_top_p/`):

    exercise.toml     title, chapter, the learner's file name, a one-line summary
    README.md         the statement
    <file>            the starter: the function(s) you write
    solution/<file>   the reference solution
    test_exercise.py  the tests, which are the specification

The judge copies your file next to the tests inside a checkpoint of the exercise's chapter (the
`minisgl` tree as it stands after that chapter, built by tools/steps.py) and runs the tests,
printing one line per test.

    python practice/judge.py --list            # every exercise
    python practice/judge.py ch04_top_p        # judge your work on one exercise
    python practice/judge.py ch04              # ... on every exercise of chapter 4
    python practice/judge.py                   # ... on all of them
    python practice/judge.py --solutions       # check the reference solutions pass and the
                                               # untouched starters fail
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PRACTICE = Path(__file__).resolve().parent
ROOT = PRACTICE.parent


def _load_steps():
    spec = importlib.util.spec_from_file_location("steps", ROOT / "tools" / "steps.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["steps"] = module
    spec.loader.exec_module(module)
    return module


steps = _load_steps()


@dataclass(frozen=True)
class Exercise:
    id: str
    title: str
    chapter: str
    file: str
    summary: str
    folder: Path

    @property
    def starter(self) -> Path:
        return self.folder / self.file

    @property
    def solution(self) -> Path:
        return self.folder / "solution" / self.file


@dataclass(frozen=True)
class TestResult:
    name: str
    passed: bool
    message: str


def load_exercises(practice: Path = PRACTICE) -> list[Exercise]:
    exercises = []
    for toml in sorted(practice.glob("*/exercise.toml")):
        data = tomllib.loads(toml.read_text(encoding="utf-8"))
        missing = {"title", "chapter", "file", "summary"} - data.keys()
        if missing:
            raise SystemExit(f"{toml}: missing keys {sorted(missing)}")
        exercises.append(Exercise(toml.parent.name, data["title"], data["chapter"], data["file"],
                                  data["summary"], toml.parent))
    return exercises


def select(exercises: list[Exercise], wanted: str | None) -> list[Exercise]:
    if wanted is None:
        return exercises
    chosen = [e for e in exercises if e.id == wanted or e.id.startswith(wanted.rstrip("_") + "_")]
    if not chosen:
        known = ", ".join(e.id for e in exercises)
        raise SystemExit(f"no exercise matches {wanted!r}; the exercises are: {known}")
    return chosen


def judge(exercise: Exercise, learner_file: Path) -> list[TestResult]:
    """Run the exercise's tests against `learner_file` in a checkpoint of its chapter."""
    manifest = steps.load_manifest(ROOT)
    with tempfile.TemporaryDirectory(prefix=f"judge-{exercise.id}-") as tmp:
        workdir = Path(tmp)
        steps.build_checkpoint(manifest, exercise.chapter, workdir)
        here = workdir / "exercise"
        here.mkdir()
        shutil.copy2(learner_file, here / exercise.file)
        shutil.copy2(exercise.folder / "test_exercise.py", here / "test_exercise.py")
        if (workdir / "tests" / "conftest.py").exists():
            shutil.copy2(workdir / "tests" / "conftest.py", here / "conftest.py")
        env = steps.checkpoint_env(workdir, gpu=False)
        env["PYTHONPATH"] = os.pathsep.join([str(here), str(workdir)])
        report = workdir / "report.xml"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--tb=line", "-p", "no:cacheprovider",
             f"--junitxml={report}", "test_exercise.py"],
            cwd=here, env=env, capture_output=True, text=True, timeout=steps.TESTS_TIMEOUT_S,
        )
        if not report.exists() or not list(ET.parse(report).getroot().iter("testcase")):
            return [TestResult("collecting the tests", False, (proc.stdout + proc.stderr)[-2000:])]
        results = []
        for case in ET.parse(report).getroot().iter("testcase"):
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            message = "" if bad is None else _first_line(bad.get("message") or bad.text or "")
            results.append(TestResult(case.get("name", "?"), bad is None, message))
        return results


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def report(label: str, results: list[TestResult]) -> int:
    """Print one line per test and return the number that passed."""
    print(label)
    for r in results:
        mark = "PASS" if r.passed else "FAIL"
        print(f"  {mark}  {r.name}" + (f"\n        {r.message}" if r.message else ""))
    passed = sum(r.passed for r in results)
    print(f"  {passed}/{len(results)} tests passed")
    return passed


def judge_learner(exercises: list[Exercise]) -> int:
    all_passed = True
    for ex in exercises:
        results = judge(ex, ex.starter)
        passed = report(f"{ex.id}: {ex.title}  ({ex.starter.relative_to(ROOT)})", results)
        all_passed &= passed == len(results)
    print("all passed" if all_passed else "not yet: read the failures above, then try again")
    return 0 if all_passed else 1


def judge_solutions(exercises: list[Exercise]) -> int:
    """The reference solutions must pass every test; the untouched starters must fail one."""
    problems = []
    for ex in exercises:
        solution = judge(ex, ex.solution)
        passed = report(f"{ex.id}: reference solution", solution)
        if passed != len(solution):
            problems.append(f"{ex.id}: the reference solution fails {len(solution) - passed} test(s)")
        starter = judge(ex, ex.starter)
        starter_passed = sum(r.passed for r in starter)
        print(f"  starter: {starter_passed}/{len(starter)} tests pass"
              + (" (as it should, it fails)" if starter_passed < len(starter) else ""))
        if starter_passed == len(starter):
            problems.append(f"{ex.id}: the untouched starter passes every test")
    for p in problems:
        print(f"problem: {p}")
    print(f"{len(exercises)} exercises, {len(problems)} problems")
    return 1 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python practice/judge.py",
                                     description="Judge the practice exercises.")
    parser.add_argument("exercise", nargs="?",
                        help="an exercise id (ch04_top_p) or a chapter prefix (ch04); default: all")
    parser.add_argument("--solutions", action="store_true",
                        help="check the reference solutions instead (and that starters fail)")
    parser.add_argument("--list", action="store_true", help="list the exercises and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    exercises = select(load_exercises(), args.exercise)
    if args.list:
        for ex in exercises:
            print(f"{ex.id:<24} {ex.title} — {ex.summary}")
        return 0
    return judge_solutions(exercises) if args.solutions else judge_learner(exercises)


if __name__ == "__main__":
    sys.exit(main())
