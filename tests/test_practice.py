"""The practice judge: every exercise refuses the engine's own answer; failures explain themselves.

For each exercise under practice/ (found from the directory, so a new one is covered the day it
lands) the test hands the judge the "import the engine's function" shortcut, the reference
solution with its answer replaced by an import of the engine's symbol, and checks that every
test fails with the guard's refusal rather than for some other reason.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from conftest import ROOT, load_repo_script

judge = load_repo_script("practice/judge.py")
EXERCISES = judge.load_exercises()
IDS = [exercise.id for exercise in EXERCISES]


def test_exercises_are_found_from_the_directory() -> None:
    folders = sorted(p.parent.name for p in (ROOT / "practice").glob("*/exercise.toml"))
    assert IDS == folders


@pytest.mark.parametrize("exercise", EXERCISES, ids=IDS)
def test_each_exercise_names_an_engine_answer_that_exists(exercise) -> None:
    assert exercise.engine_answer, (f"{exercise.id}/exercise.toml has no [engine_answer]: name the "
                                    f"engine symbol the learner might import instead of writing")
    starter_names = judge.top_level_names(exercise.starter.read_text(encoding="utf-8"))
    for name, spec in exercise.engine_answer.items():
        assert name in starter_names, f"{exercise.id}: {name} is not defined by the starter"
        module_name, _, qualname = spec.partition(":")
        target = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
        assert callable(target), f"{exercise.id}: {spec} is not a function or class"


# An answer a later chapter writes (chapter 15's SSE parser lives in chapter 19's benchmark)
# cannot be imported at the exercise's chapter, so there is no shortcut to refuse.
REFUSABLE = [e for e in EXERCISES if judge.importable_answers(e)]


def test_only_answers_outside_the_chapters_tree_have_no_shortcut() -> None:
    for exercise in EXERCISES:
        if exercise not in REFUSABLE:
            tree = judge.steps.checkpoint_files(judge.steps.load_manifest(ROOT), exercise.chapter)
            for spec in exercise.engine_answer.values():
                module = spec.partition(":")[0].replace(".", "/")
                assert f"{module}.py" not in tree, f"{exercise.id}: {spec} is in the tree"


@pytest.mark.slow
@pytest.mark.parametrize("exercise", REFUSABLE, ids=[e.id for e in REFUSABLE])
def test_importing_the_engine_answer_is_refused(exercise) -> None:
    source = judge.shortcut_source(exercise)
    for spec in judge.importable_answers(exercise).values():
        assert f"from {spec.partition(':')[0]} import" in source
    results = judge.judge_shortcut(exercise)
    passed = [r.name for r in results if r.passed]
    assert not passed, f"{exercise.id}: the shortcut passes {passed}"
    not_refused = [f"{r.name}: {r.message}" for r in results if judge.REFUSAL not in r.message]
    assert not not_refused, f"{exercise.id}: failed, but not by the guard: {not_refused[:3]}"


def _ch01() -> object:
    return next(e for e in EXERCISES if e.id == "ch01_kv_budget")


@pytest.mark.slow
def test_calling_the_engine_inside_a_function_is_refused(tmp_path: Path) -> None:
    """Not an alias: the learner's own function reaches the engine's method through its module."""
    exercise = _ch01()
    solution = exercise.solution.read_text(encoding="utf-8")
    start = solution.index("def kv_bytes_per_token")
    end = solution.index("\ndef ", start + 1)
    wrapper = ("def kv_bytes_per_token(config, dtype):\n"
               "    import minisgl.models.config as engine\n"
               "    return engine.ModelConfig.kv_bytes_per_token(config, dtype)\n\n")
    learner = tmp_path / exercise.file
    learner.write_text(solution[:start] + wrapper + solution[end:], encoding="utf-8")
    results = {r.name: r for r in judge.judge(exercise, learner)}
    failed = [r for r in results.values() if not r.passed]
    assert not results["test_query_heads_do_not_count"].passed
    assert failed and all(judge.REFUSAL in r.message for r in failed), [r.message for r in failed]


@pytest.mark.slow
def test_a_failure_shows_input_expected_and_actual(tmp_path: Path) -> None:
    exercise = _ch01()
    solution = exercise.solution.read_text(encoding="utf-8")
    wrong = solution.replace("2 * config.num_kv_heads", "2 * config.num_qo_heads")
    assert wrong != solution
    learner = tmp_path / exercise.file
    learner.write_text(wrong, encoding="utf-8")
    results = {r.name: r for r in judge.judge(exercise, learner)}
    failed = results["test_kv_bytes_per_token_matches_the_engine[qwen3-0.6b-bfloat16]"]
    assert not failed.passed
    assert "expected 114,688" in failed.message and "got 229,376" in failed.message
    assert failed.values["name"] == "'qwen3-0.6b'" and failed.values["dtype"] == "'bfloat16'"
    assert failed.values["got"] == "229376" and failed.values["expected"] == "114688"
