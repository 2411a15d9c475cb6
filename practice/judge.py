#!/usr/bin/env python3
"""Judge the practice exercises.

Each exercise lives in `practice/<id>/` (for example `practice/ch04_seeded_sampling/`):

    exercise.toml     title, chapter, the learner's file name, a one-line summary, and
                      engine_answer: the engine symbol(s) that already do the work, which
                      the learner's file may not use (the judge refuses them)
    README.md         the statement
    <file>            the starter: the function(s) you write
    solution/<file>   the reference solution
    test_exercise.py  the tests, which are the specification

The judge copies your file next to the tests inside a checkpoint of the exercise's chapter (the
`minisgl` tree as it stands after that chapter, built by tools/steps.py) and runs the tests,
printing one line per test; under a failed one, the test's message and the values it held
(its input, what it expected, what your code returned). Two pytest plugins beside this file do
the work inside the run: `engine_guard.py` refuses the engine's own answer, `failure_report.py`
collects those values.

    python practice/judge.py --list            # every exercise
    python practice/judge.py ch04_seeded_sampling   # judge your work on one exercise
    python practice/judge.py ch04              # ... on every exercise of chapter 4
    python practice/judge.py                   # ... on all of them
    python practice/judge.py --solutions       # check the reference solutions pass, and that
                                               # the untouched starters and the "import the
                                               # engine's answer" shortcuts fail
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PRACTICE = Path(__file__).resolve().parent
ROOT = PRACTICE.parent
PLUGINS = ("engine_guard", "failure_report")  # pytest plugins beside this file, loaded in every run


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
    engine_answer: dict[str, str]  # the learner's name -> "minisgl.module:qualname" it may not be

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
    message: str  # the failure's message, several lines where the test gave them
    values: dict[str, str] = field(default_factory=dict)  # the test's locals when it failed


def load_exercises(practice: Path = PRACTICE) -> list[Exercise]:
    exercises = []
    for toml in sorted(practice.glob("*/exercise.toml")):
        data = tomllib.loads(toml.read_text(encoding="utf-8"))
        missing = {"title", "chapter", "file", "summary"} - data.keys()
        if missing:
            raise SystemExit(f"{toml}: missing keys {sorted(missing)}")
        answer = engine_answers(toml, data)
        exercises.append(Exercise(toml.parent.name, data["title"], data["chapter"], data["file"],
                                  data["summary"], toml.parent, answer))
    return exercises


def top_level_names(source: str) -> list[str]:
    """The functions and classes a Python file defines at its top level, in order."""
    return [node.name for node in ast.parse(source).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def engine_answers(toml: Path, data: dict) -> dict[str, str]:
    """Read `engine_answer`: a table {learner's name = "module:qualname"}, or one such string.

    A single string belongs to the starter's name that matches its last part, else to the
    starter's first function or class. No entry means nothing is guarded (and the repository's
    tests report it).
    """
    raw = data.get("engine_answer")
    if raw is None:
        return {}
    if isinstance(raw, str):
        names = top_level_names((toml.parent / data["file"]).read_text(encoding="utf-8"))
        last = raw.rpartition(":")[2].rpartition(".")[2]
        if not names:
            raise SystemExit(f"{toml}: engine_answer given, but {data['file']} defines nothing")
        raw = {last if last in names else names[0]: raw}
    if not isinstance(raw, dict) or not all(isinstance(v, str) and ":" in v for v in raw.values()):
        raise SystemExit(f"{toml}: engine_answer must be \"package.module:name\" or a table of "
                         f"them keyed by the starter's names, got {raw!r}")
    return dict(raw)


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
        plugins = workdir / "judge_plugins"
        plugins.mkdir()
        for plugin in PLUGINS:
            shutil.copy2(PRACTICE / f"{plugin}.py", plugins / f"{plugin}.py")
        env = steps.checkpoint_env(workdir, gpu=False)
        env["PYTHONPATH"] = os.pathsep.join([str(here), str(workdir), str(plugins)])
        failures = workdir / "failures.json"
        env["JUDGE_LEARNER_FILE"] = str(here / exercise.file)
        env["JUDGE_ENGINE_ANSWERS"] = json.dumps(exercise.engine_answer)
        env["JUDGE_FAILURE_REPORT"] = str(failures)
        report = workdir / "report.xml"
        plugin_args = [arg for plugin in PLUGINS for arg in ("-p", plugin)]
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--tb=line", "-p", "no:cacheprovider",
             *plugin_args, f"--junitxml={report}", "test_exercise.py"],
            cwd=here, env=env, capture_output=True, text=True, timeout=steps.TESTS_TIMEOUT_S,
        )
        if not report.exists() or not list(ET.parse(report).getroot().iter("testcase")):
            return [TestResult("collecting the tests", False, (proc.stdout + proc.stderr)[-2000:])]
        details = json.loads(failures.read_text(encoding="utf-8")) if failures.exists() else {}
        results = []
        for case in ET.parse(report).getroot().iter("testcase"):
            name = case.get("name", "?")
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            if bad is None:
                results.append(TestResult(name, True, ""))
                continue
            detail = details.get(name, {})
            message = "\n".join(detail.get("message", [])) \
                or _first_lines(bad.get("message") or bad.text or "")
            results.append(TestResult(name, False, message, detail.get("locals", {})))
        return results


def _first_lines(text: str, limit: int = 8) -> str:
    lines = [line[:300] for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:limit])


def report(label: str, results: list[TestResult]) -> int:
    """Print one line per test and return the number that passed."""
    print(label)
    for r in results:
        print(f"  {'PASS' if r.passed else 'FAIL'}  {r.name}")
        for line in r.message.splitlines():
            print(f"        {line}")
        if r.values:
            print("        the test's values when it failed (its input, expected, actual):")
            for name, value in r.values.items():
                print(f"          {name} = {value}")
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


def shortcut_source(exercise: Exercise) -> str:
    """The reference solution with each answer replaced by an import of the engine's own.

    What a learner who copies instead of writing would hand in: everything else is the working
    solution, so the judge can only fail it by refusing the engine's symbol.
    """
    source = exercise.solution.read_text(encoding="utf-8")
    lines = source.splitlines()
    spans = {node.name: (min([node.lineno] + [d.lineno for d in node.decorator_list]),
                         node.end_lineno)
             for node in ast.parse(source).body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    imports: dict[str, list[str]] = {}
    for name, spec in exercise.engine_answer.items():
        module, _, qualname = spec.partition(":")
        top, *rest = qualname.split(".")
        if rest:
            imports[name] = [f"from {module} import {top} as _engine_{name}",
                             f"{name} = _engine_{name}.{'.'.join(rest)}"]
        else:
            imports[name] = [f"from {module} import {top} as {name}"]
    for name in sorted(imports, key=lambda n: spans.get(n, (len(lines) + 1,))[0], reverse=True):
        start, end = spans.get(name, (len(lines) + 1, len(lines)))
        lines[start - 1:end] = imports[name]
    return "\n".join(lines) + "\n"


def judge_shortcut(exercise: Exercise) -> list[TestResult]:
    """Judge the "import the engine's answer" shortcut of `exercise` (it must fail)."""
    with tempfile.TemporaryDirectory(prefix=f"shortcut-{exercise.id}-") as tmp:
        shortcut = Path(tmp) / exercise.file
        shortcut.write_text(shortcut_source(exercise), encoding="utf-8")
        return judge(exercise, shortcut)


REFUSAL = "the engine's own"  # how engine_guard's messages name the refused symbol


def judge_solutions(exercises: list[Exercise]) -> int:
    """The reference solutions must pass every test; the untouched starters must fail one, and
    so must the shortcut that imports the engine's answer, refused by the guard."""
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
        if not ex.engine_answer:
            problems.append(f"{ex.id}: exercise.toml names no engine_answer to refuse")
            continue
        shortcut = judge_shortcut(ex)
        refused = sum(not r.passed and REFUSAL in r.message for r in shortcut)
        print(f"  importing the engine's answer ({', '.join(ex.engine_answer.values())}): "
              f"{refused}/{len(shortcut)} tests refuse it")
        if refused == 0 or any(r.passed for r in shortcut):
            problems.append(f"{ex.id}: the shortcut importing the engine's answer is not refused "
                            f"by every test")
    for p in problems:
        print(f"problem: {p}")
    print(f"{len(exercises)} exercises, {len(problems)} problems")
    return 1 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python practice/judge.py",
                                     description="Judge the practice exercises.")
    parser.add_argument("exercise", nargs="?",
                        help="an exercise id (ch04_seeded_sampling) or a chapter prefix (ch04); "
                             "default: all")
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
