"""The practice judge: every exercise refuses the engine's own answer; failures explain themselves.

For each exercise under practice/ (found from the directory, so a new one is covered the day it
lands) the test hands the judge the "import the engine's function" shortcut, the reference
solution with its answer replaced by an import of the engine's symbol, and checks that every
test fails with the guard's refusal rather than for some other reason. And for each exercise
whose chapter page includes the engine's answer, the page's code, pasted in place of the
learner's function, must be rejected by the exercise's own tests: an exercise asks for more
than the page prints.
"""
from __future__ import annotations

import ast
import importlib
import re
import textwrap
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
    # A test skipped here (one that needs a GPU, on a machine without) runs no code to refuse.
    ran = [r for r in results if r.outcome != "skipped"]
    not_refused = [f"{r.name}: {r.message}" for r in ran if judge.REFUSAL not in r.message]
    assert ran and not not_refused, (f"{exercise.id}: failed, but not by the guard: "
                                     f"{not_refused[:3]}")


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
    wrong = solution.replace('config.get("num_key_value_heads") or heads', "heads")  # query heads
    assert wrong != solution
    learner = tmp_path / exercise.file
    learner.write_text(wrong, encoding="utf-8")
    results = {r.name: r for r in judge.judge(exercise, learner)}
    failed = results["test_kv_bytes_per_token_matches_the_engine[qwen3-0.6b-bfloat16]"]
    assert not failed.passed
    assert "expected 114,688" in failed.message and "got 229,376" in failed.message
    assert failed.values["name"] == "'qwen3-0.6b'" and failed.values["dtype"] == "'bfloat16'"
    assert failed.values["got"] == "229376" and failed.values["expected"] == "114688"


# ------------------------------------------------------------ the page's code is not an answer
# A chapter page shows the engine's code, included by name. An exercise whose answer is that
# code, retyped, practises typing: for every exercise, the code its page includes of the engine
# answer is pasted into the reference solution in place of the learner's function (with the
# engine module's names in scope, and an adapter where the learner's signature differs only in
# form), and the exercise's own tests must reject it.
INCLUDE = re.compile(r'--8<-- "([^"]+)"')
UNWRAPPED = {"staticmethod", "classmethod", "property"}


def chapter_page(exercise) -> Path | None:
    """The exercise's chapter page; None while the chapter is coming (it has no page yet)."""
    pages = list((ROOT / "chapters").glob(f"{exercise.chapter}_*.md"))
    if not pages:
        return None
    (page,) = pages
    return page


SNAPSHOT = re.compile(r"^tools/versions/(ch\d\d)/(.+)$")


def page_pieces(exercise, spec: str) -> list[tuple[str, str]]:
    """The pieces the exercise's chapter page includes of `spec`, as (file as the page names it,
    qualified name): the symbol itself, or what it holds (a class's methods), or what holds it
    (a method's class). A page that shows an earlier version of the module
    (`tools/versions/chNN/<module path>`) shows the answer all the same."""
    page = chapter_page(exercise)
    if page is None:
        return []
    module, _, qualname = spec.partition(":")
    path = module.replace(".", "/") + ".py"
    found = []
    for include in INCLUDE.findall(page.read_text(encoding="utf-8")):
        file, _, names = include.partition("::")
        snapshot = SNAPSHOT.match(file)
        if file == path or (snapshot and snapshot.group(2) == path):
            found += [(file, n) for n in names.split() if not n.startswith("-")
                      and (n == qualname or n.startswith(qualname + ".")
                           or qualname.startswith(n + "."))]
    # A method shown with its whole class is shown all the same; a piece inside another
    # included piece comes with it.
    found = [(f, qualname if qualname.startswith(n + ".") else n) for f, n in found]
    return [(f, n) for f, n in dict.fromkeys(found)
            if not any(n.startswith(other + ".") for _, other in found)]


def page_source(file: str) -> str:
    """The text of a file a page includes: the final one, or an earlier version rebuilt."""
    snapshot = SNAPSHOT.match(file)
    if snapshot is None:
        return (ROOT / file).read_text(encoding="utf-8")
    manifest = judge.steps.load_manifest(ROOT)
    return judge.steps.snapshots.earlier_version(manifest, snapshot.group(2), snapshot.group(1))


def pasted_name(qualname: str) -> str:
    return "_page_" + qualname.replace(".", "_")


def engine_definition(file: str, qualname: str) -> str:
    """The source of `qualname` in `file` as the page shows it, dedented, renamed to
    `pasted_name(qualname)`; a method becomes a function of `self`."""
    source = page_source(file)
    body = ast.parse(source).body
    node = None
    for part in qualname.split("."):
        node = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.ClassDef)) and n.name == part)
        body = node.body
    decorators = [d for d in node.decorator_list
                  if not (isinstance(d, ast.Name) and d.id in UNWRAPPED)]
    start = min([node.lineno] + [d.lineno for d in decorators])
    lines = source.splitlines()[start - 1:node.end_lineno]
    text = textwrap.dedent("\n".join(lines))
    text = "\n".join(line for line in text.splitlines()
                     if line.strip() not in {f"@{u}" for u in UNWRAPPED})
    return re.sub(rf"^((?:async\s+)?(?:def|class)\s+){node.name}\b", rf"\g<1>{pasted_name(qualname)}",
                  text, count=1, flags=re.M)


# How a learner would call the page's code under the exercise's names, where that takes more than
# a new name: `_page_<Qualified_name>` is the pasted code.
ADAPTERS: dict[str, dict[str, str]] = {
    "ch02_rmsnorm": {
        "rms_norm_heads": """
            def rms_norm_heads(x, weight, eps, head_dim):
                return _page_RMSNorm__normalize(SimpleNamespace(weight=weight, eps=eps), x)
            """,
        "add_rms_norm_": """
            def add_rms_norm_(x, residual, weight, eps):
                norm = SimpleNamespace(weight=weight, eps=eps)
                norm._normalize = lambda t: _page_RMSNorm__normalize(norm, t)
                return _page_RMSNorm_forward(norm, x, residual)
            """,
    },
    "ch03_qkv_merge": {
        "merged_target": """
            def merged_target(name):
                model = SimpleNamespace(merged_modules=BaseLLMModel.merged_modules)
                return _page_BaseLLMModel_checkpoint_to_param(model, name)
            """,
    },
    "ch04_seeded_sampling": {
        "gumbel_race": """
            def gumbel_race(logits, temperatures, generators):
                t = torch.tensor([max(t, 1e-6) for t in temperatures]).unsqueeze(1)
                probs = torch.softmax(logits / t, dim=-1)
                return _page_sample_from_probs(probs, generators)
            """,
    },
    "ch05_page_alloc": {
        "token_slots": """
            def token_slots(page_ids, rows, starts, ends, page_size):
                rows_, positions = [], []
                for row, start, end in zip(rows, starts, ends):
                    rows_ += [row] * (end - start)
                    positions += range(start, end)
                return torch.from_numpy(_page_slots_of(
                    page_ids.numpy(), np.array(rows_, dtype=np.int64),
                    np.array(positions, dtype=np.int64), page_size))
            """,
    },
    # Chapter 9's page shows the manager's loop and the budget's rule, from the chapter's own
    # version of the module: a learner would feed them plain numbers (the page's loop knows
    # nothing of overtaking, so it takes the two new arguments and ignores them).
    "ch09_admission": {
        "choose_admissions": """
            def choose_admissions(waiting, *, free_pages, free_rows, token_budget, page_size,
                                  overtaken, max_overtakes):
                from collections import deque
                budget = PrefillBudget(tokens=token_budget, pages=free_pages, rows=free_rows)
                empty = SimpleNamespace(num_tokens=0, pages=[])
                cache = SimpleNamespace(page_size=page_size, match=lambda req: empty,
                                        admit=lambda req, match: None)
                manager = SimpleNamespace(waiting=deque(waiting), cache=cache)
                manager._try_admit = lambda req, budget, is_first: (
                    _page_PrefillManager__try_admit(manager, req, budget, is_first))
                admitted = []
                while manager.waiting and manager._try_admit(manager.waiting[0], budget,
                                                             not admitted):
                    admitted.append(manager.waiting.popleft().uid)
                return admitted
            """,
    },
    # The page's loop steps a real Scheduler over real batches; the exercise's runs prompts
    # through a fake device, so the page's step is all a learner could paste.
    "ch12_token_pool": {"run_from_pool": "run_from_pool = _page_Scheduler__step\n"},
    "ch18_expert_routing": {
        "route": """
            def route(logits, top_k, renormalize, bias=None):
                import torch
                if not logits:
                    raise ValueError("no rows")
                r = _page_route_topk(torch.tensor(logits, dtype=torch.float64), top_k,
                                     renormalize)
                return [list(zip(e, w)) for e, w in zip(r.expert_ids.tolist(),
                                                        r.weights.tolist())]
            """,
    },
}


def page_paste_source(exercise) -> str | None:
    """The reference solution with each engine answer the page shows replaced by the page's
    code; None when the page shows none of it."""
    solution = exercise.solution.read_text(encoding="utf-8")
    pasted, replaced = [], []
    adapters = ADAPTERS.get(exercise.id, {})
    for name, spec in exercise.engine_answer.items():
        pieces = page_pieces(exercise, spec)
        if not pieces:
            continue
        module, _, qualname = spec.partition(":")
        pasted += [engine_definition(file, piece) for file, piece in pieces]
        shown = [piece for _, piece in pieces]
        if name in adapters:
            pasted.append(textwrap.dedent(adapters[name]))
        else:
            assert qualname in shown, (
                f"{exercise.id}: the page shows only {shown} of {spec}; say in ADAPTERS how "
                f"a learner would call them as {name}")
            pasted.append(f"{name} = {pasted_name(qualname)}")
        replaced.append(name)
    if not replaced:
        return None
    lines = solution.splitlines()
    spans = sorted(((min([n.lineno] + [d.lineno for d in n.decorator_list]), n.end_lineno)
                    for n in ast.parse(solution).body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and n.name in replaced), reverse=True)
    for start, end in spans:
        del lines[start - 1:end]
    modules = sorted({spec.partition(":")[0] for spec in exercise.engine_answer.values()})
    header = ["import importlib as _importlib", "from types import SimpleNamespace"] + [
        f"globals().update({{k: v for k, v in vars(_importlib.import_module({m!r})).items() "
        f"if not k.startswith('__')}})" for m in modules]
    future = [line for line in lines if line.startswith("from __future__")]
    rest = [line for line in lines if not line.startswith("from __future__")]
    return "\n".join(future + header + rest + [""] + pasted) + "\n"


# The exercises whose chapter page includes none of the engine's answer: nothing to paste.
NOTHING_SHOWN = {"ch07_positions", "ch15_sse_client", "ch17_tp_lockstep"}
# An exercise of a coming chapter (no page yet) joins the others the day its page lands.
PASTABLE = [exercise for exercise in EXERCISES
            if exercise.id not in NOTHING_SHOWN and chapter_page(exercise) is not None]


def test_the_pages_said_to_show_no_answer_show_none() -> None:
    shown = [e.id for e in EXERCISES if e.id in NOTHING_SHOWN and page_paste_source(e)]
    assert not shown, f"these pages now include their exercise's answer: test them too: {shown}"


@pytest.mark.slow
@pytest.mark.parametrize("exercise", PASTABLE, ids=[e.id for e in PASTABLE])
def test_the_code_the_page_shows_does_not_pass_the_exercise(exercise, tmp_path: Path) -> None:
    source = page_paste_source(exercise)
    assert source is not None, (f"{exercise.chapter}'s page includes none of "
                                f"{exercise.engine_answer}: add {exercise.id} to NOTHING_SHOWN")
    learner = tmp_path / exercise.file
    learner.write_text(source, encoding="utf-8")
    results = judge.judge(exercise, learner)
    assert all(r.name != "collecting the tests" for r in results), (
        f"{exercise.id}: the pasted page code does not even import:\n{results[0].message}")
    passed = [r.name for r in results if r.passed]
    rejected = [r.name for r in results if not r.passed and judge.REFUSAL not in r.message]
    assert rejected, (f"{exercise.id}: the code its page shows, pasted as the answer, passes "
                      f"{len(passed)} of {len(results)} tests and no test rejects it: the "
                      f"exercise must ask for something the page does not print")


# ------------------------------------------------------------------ exercises run in the browser
# The browser has Pyodide and the judge's wheels, no PyTorch and no NumPy: an exercise marked
# `browser = true` may import them only inside a test that skips without them.
BROWSER_ABSENT = {"torch", "numpy", "transformers", "safetensors", "tokenizers"}


@pytest.mark.parametrize("exercise", [e for e in EXERCISES if e.in_browser],
                         ids=[e.id for e in EXERCISES if e.in_browser])
def test_a_browser_exercise_imports_nothing_the_browser_lacks(exercise) -> None:
    for path in (exercise.starter, exercise.solution, exercise.folder / "test_exercise.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            absent = {n.partition(".")[0] for n in names} & BROWSER_ABSENT
            assert not absent, (f"{path.relative_to(ROOT)} imports {sorted(absent)} at its top: "
                                f"not in the browser, where {exercise.id} runs")
