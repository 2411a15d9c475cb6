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
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PRACTICE = Path(__file__).resolve().parent
ROOT = PRACTICE.parent
PLUGINS = ("engine_guard", "failure_report")  # pytest plugins beside this file, loaded in every run
PLUGIN_DIR = "judge_plugins"  # where a run's copy of them lies, beside the checkpoint


def _load(name: str, path: Path):
    """Import a file of the repository by path (tools/ and practice/ are not packages)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


steps = _load("steps", ROOT / "tools" / "steps.py")
_results = _load("judge_results", PRACTICE / "results.py")
TestResult, read_results = _results.TestResult, _results.read_results


@dataclass(frozen=True)
class Exercise:
    id: str
    title: str
    chapter: str
    file: str
    summary: str
    folder: Path
    engine_answer: dict[str, str]  # the learner's name -> "minisgl.module:qualname" it may not be
    in_browser: bool = False  # `browser = true`: no torch needed (see docs/hooks/browser.py)

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
        answer = engine_answers(toml, data)
        exercises.append(Exercise(toml.parent.name, data["title"], data["chapter"], data["file"],
                                  data["summary"], toml.parent, answer,
                                  bool(data.get("browser", False))))
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


def stage(exercise: Exercise, learner_file: Path, workdir: Path) -> Path:
    """Lay out one run of the exercise in `workdir`: its chapter's checkpoint, the judge's
    plugins in `judge_plugins/`, and in `exercise/` the learner's file, the tests and the
    checkpoint's conftest. Returns `exercise/`. The in-browser runner ships this same layout
    (docs/hooks/browser.py)."""
    steps.build_checkpoint(steps.load_manifest(ROOT), exercise.chapter, workdir)
    here = workdir / "exercise"
    here.mkdir()
    shutil.copy2(learner_file, here / exercise.file)
    shutil.copy2(exercise.folder / "test_exercise.py", here / "test_exercise.py")
    if (workdir / "tests" / "conftest.py").exists():
        shutil.copy2(workdir / "tests" / "conftest.py", here / "conftest.py")
    plugins = workdir / PLUGIN_DIR
    plugins.mkdir()
    for plugin in PLUGINS:
        shutil.copy2(PRACTICE / f"{plugin}.py", plugins / f"{plugin}.py")
    return here


def judge(exercise: Exercise, learner_file: Path) -> list[TestResult]:
    """Run the exercise's tests against `learner_file` in a checkpoint of its chapter."""
    with tempfile.TemporaryDirectory(prefix=f"judge-{exercise.id}-") as tmp:
        workdir = Path(tmp)
        here = stage(exercise, learner_file, workdir)
        env = steps.checkpoint_env(workdir, gpu=False)
        env["PYTHONPATH"] = os.pathsep.join([str(here), str(workdir), str(workdir / PLUGIN_DIR)])
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
        found = read_results(report, failures) if report.exists() else []
        if not found:
            return [TestResult("collecting the tests", "failed",
                               (proc.stdout + proc.stderr)[-2000:])]
        return found


def report(label: str, results: list[TestResult]) -> int:
    """Print one line per test, with a failure's message and values; return how many failed."""
    print(label)
    for r in results:
        print(f"  {MARKS[r.outcome]}  {r.name}")
        for line in r.message.splitlines():
            print(f"        {line}")
        if r.values:
            print("        the test's values when it failed (its input, expected, actual):")
            for name, value in r.values.items():
                print(f"          {name} = {value}")
    failed = sum(r.outcome == "failed" for r in results)
    skipped = sum(r.outcome == "skipped" for r in results)
    print(f"  {len(results) - failed - skipped}/{len(results)} tests passed"
          + (f", {skipped} skipped" if skipped else ""))
    return failed


MARKS = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}


def judge_learner(exercises: list[Exercise]) -> int:
    all_passed = True
    for ex in exercises:
        failed = report(f"{ex.id}: {ex.title}  ({ex.starter.relative_to(ROOT)})",
                        judge(ex, ex.starter))
        all_passed &= failed == 0
    print("all passed" if all_passed else "not yet: read the failures above, then try again")
    return 0 if all_passed else 1


def importable_answers(exercise: Exercise) -> dict[str, str]:
    """The exercise's engine answers a learner could import at its chapter: those whose module
    is in the chapter's tree (an answer a later chapter writes cannot be imported yet)."""
    tree = steps.checkpoint_files(steps.load_manifest(ROOT), exercise.chapter)

    def in_tree(spec: str) -> bool:
        path = spec.partition(":")[0].replace(".", "/")
        return f"{path}.py" in tree or f"{path}/__init__.py" in tree

    return {name: spec for name, spec in exercise.engine_answer.items() if in_tree(spec)}


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
    for name, spec in importable_answers(exercise).items():
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
        failed = report(f"{ex.id}: reference solution", judge(ex, ex.solution))
        if failed:
            problems.append(f"{ex.id}: the reference solution fails {failed} test(s)")
        starter = judge(ex, ex.starter)
        starter_failed = sum(r.outcome == "failed" for r in starter)
        print(f"  starter: {starter_failed}/{len(starter)} tests fail"
              + (" (as it should)" if starter_failed else ""))
        if not starter_failed:
            problems.append(f"{ex.id}: the untouched starter fails no test")
        if not ex.engine_answer:
            problems.append(f"{ex.id}: exercise.toml names no engine_answer to refuse")
            continue
        answers = importable_answers(ex)
        if not answers:
            print(f"  the engine's answer ({', '.join(ex.engine_answer.values())}) is not in "
                  f"{ex.chapter}'s tree: there is nothing to import yet")
            continue
        shortcut = judge_shortcut(ex)
        refused = sum(r.outcome == "failed" and REFUSAL in r.message for r in shortcut)
        print(f"  importing the engine's answer ({', '.join(answers.values())}): "
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
