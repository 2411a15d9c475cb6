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
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PRACTICE = Path(__file__).resolve().parent
ROOT = PRACTICE.parent


def _load(name: str, path: Path):
    """Import a file of the repository by path (tools/ and practice/ are not packages)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


steps = _load("steps", ROOT / "tools" / "steps.py")
_results = _load("judge_results", PRACTICE / "results.py")
TestResult, read_junit = _results.TestResult, _results.read_junit


@dataclass(frozen=True)
class Exercise:
    id: str
    title: str
    chapter: str
    file: str
    summary: str
    folder: Path
    in_browser: bool = False  # `browser = true`: its tests need no torch (see docs/hooks/browser.py)

    @property
    def starter(self) -> Path:
        return self.folder / self.file

    @property
    def solution(self) -> Path:
        return self.folder / "solution" / self.file


def load_exercises(practice: Path = PRACTICE) -> list[Exercise]:
    exercises = []
    for toml in sorted(practice.glob("*/exercise.toml")):
        data = tomllib.loads(toml.read_text(encoding="utf-8"))
        missing = {"title", "chapter", "file", "summary"} - data.keys()
        if missing:
            raise SystemExit(f"{toml}: missing keys {sorted(missing)}")
        exercises.append(Exercise(toml.parent.name, data["title"], data["chapter"], data["file"],
                                  data["summary"], toml.parent, bool(data.get("browser", False))))
    return exercises


def select(exercises: list[Exercise], wanted: str | None) -> list[Exercise]:
    if wanted is None:
        return exercises
    chosen = [e for e in exercises if e.id == wanted or e.id.startswith(wanted.rstrip("_") + "_")]
    if not chosen:
        known = ", ".join(e.id for e in exercises)
        raise SystemExit(f"no exercise matches {wanted!r}; the exercises are: {known}")
    return chosen


def stage(exercise: Exercise, learner_file: Path, workdir: Path) -> Path:
    """Lay out one run of the exercise in `workdir`: its chapter's checkpoint, and in
    `exercise/` the learner's file, the tests and the checkpoint's conftest. Returns `exercise/`.
    The in-browser runner ships the same layout (docs/hooks/browser.py)."""
    steps.build_checkpoint(steps.load_manifest(ROOT), exercise.chapter, workdir)
    here = workdir / "exercise"
    here.mkdir()
    shutil.copy2(learner_file, here / exercise.file)
    shutil.copy2(exercise.folder / "test_exercise.py", here / "test_exercise.py")
    if (workdir / "tests" / "conftest.py").exists():
        shutil.copy2(workdir / "tests" / "conftest.py", here / "conftest.py")
    return here


def judge(exercise: Exercise, learner_file: Path) -> list[TestResult]:
    """Run the exercise's tests against `learner_file` in a checkpoint of its chapter."""
    with tempfile.TemporaryDirectory(prefix=f"judge-{exercise.id}-") as tmp:
        workdir = Path(tmp)
        here = stage(exercise, learner_file, workdir)
        env = steps.checkpoint_env(workdir, gpu=False)
        env["PYTHONPATH"] = os.pathsep.join([str(here), str(workdir)])
        report = workdir / "report.xml"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--tb=line", "-p", "no:cacheprovider",
             f"--junitxml={report}", "test_exercise.py"],
            cwd=here, env=env, capture_output=True, text=True, timeout=steps.TESTS_TIMEOUT_S,
        )
        found = read_junit(report) if report.exists() else []
        if not found:
            return [TestResult("collecting the tests", "failed", (proc.stdout + proc.stderr)[-2000:])]
        return found


def report(label: str, results: list[TestResult]) -> int:
    """Print one line per test and return the number that failed."""
    print(label)
    for r in results:
        mark = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[r.outcome]
        print(f"  {mark}  {r.name}" + (f"\n        {r.message}" if r.message else ""))
    failed = sum(r.outcome == "failed" for r in results)
    skipped = sum(r.outcome == "skipped" for r in results)
    print(f"  {len(results) - failed - skipped}/{len(results)} tests passed"
          + (f", {skipped} skipped" if skipped else ""))
    return failed


def judge_learner(exercises: list[Exercise]) -> int:
    all_passed = True
    for ex in exercises:
        failed = report(f"{ex.id}: {ex.title}  ({ex.starter.relative_to(ROOT)})",
                        judge(ex, ex.starter))
        all_passed &= failed == 0
    print("all passed" if all_passed else "not yet: read the failures above, then try again")
    return 0 if all_passed else 1


def judge_solutions(exercises: list[Exercise]) -> int:
    """The reference solutions must pass every test; the untouched starters must fail one."""
    problems = []
    for ex in exercises:
        failed = report(f"{ex.id}: reference solution", judge(ex, ex.solution))
        if failed:
            problems.append(f"{ex.id}: the reference solution fails {failed} test(s)")
        starter = judge(ex, ex.starter)
        starter_failed = sum(r.outcome == "failed" for r in starter)
        print(f"  starter: {starter_failed}/{len(starter)} tests fail"
              + (" (as it should)" if starter_failed else ""))
        if not starter_failed:
            problems.append(f"{ex.id}: the untouched starter fails no test")
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
