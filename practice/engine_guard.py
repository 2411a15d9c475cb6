"""A pytest plugin the judge loads: the learner's file may not use the engine's own answer.

Every exercise names, in its `exercise.toml`, the engine symbol that already does what the
learner is asked to write (`engine_answer`). Importing it and handing it back would pass every
test that compares with the engine, so the judge loads this plugin, which

- replaces each such symbol (a function, a method, or a class's constructor) by a guard that
  refuses to run while the learner's file is on the call stack, however it was reached (a direct
  import, a module attribute, a lambda, another engine function that calls it); the tests
  themselves still call the engine freely to get their expected values;
- fails every test, before it runs, when a name of the learner's module *is* the engine's
  symbol (or a subclass of the engine's class), since then no learner code runs at all.

The judge passes the learner's file and the answers in two environment variables.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

LEARNER_FILE_VAR = "JUDGE_LEARNER_FILE"
ANSWERS_VAR = "JUDGE_ENGINE_ANSWERS"


class EngineAnswerUsed(AssertionError):
    """The learner's code ran the engine's own answer instead of its own."""


def _resolve(spec: str) -> tuple[Any, str, Any]:
    """``"pkg.module:Class.method"`` -> (owner of the last name, the last name, the object)."""
    module_name, _, qualname = spec.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"engine_answer {spec!r} is not of the form 'package.module:name'")
    owner: Any = importlib.import_module(module_name)
    *parents, name = qualname.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name, getattr(owner, name)


class _Guard:
    def __init__(self, learner_file: str, answers: dict[str, str]) -> None:
        self.learner_file = os.path.realpath(learner_file)
        self.learner_module = os.path.splitext(os.path.basename(learner_file))[0]
        self.answers = answers  # the learner's name -> the engine symbol it must not be
        self.originals: dict[str, Any] = {}  # engine symbol -> the object before guarding
        self.guards: dict[str, Any] = {}  # engine symbol -> the guard that replaced it
        self._real: dict[str, str] = {}

    def _learner_on_stack(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            real = self._real.get(path)
            if real is None:
                real = self._real[path] = os.path.realpath(path)
            if real == self.learner_file:
                return True
            frame = frame.f_back
        return False

    def _refusal(self, spec: str) -> EngineAnswerUsed:
        return EngineAnswerUsed(
            f"{self.learner_module}.py runs the engine's own {spec}: the exercise is to write "
            f"it yourself (the tests call the engine only to get the expected values)")

    def _guarded(self, spec: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def guard(*args: Any, **kwargs: Any) -> Any:
            if self._learner_on_stack():
                raise self._refusal(spec)
            return function(*args, **kwargs)
        return guard

    def install(self) -> None:
        for spec in sorted(set(self.answers.values())):
            try:
                owner, name, original = _resolve(spec)
            except ImportError:  # not importable here (no torch in the browser): not usable either
                continue
            self.originals[spec] = original
            if isinstance(original, type):
                init = original.__init__
                original.__init__ = self._guarded(spec, init)  # type: ignore[misc]
                self.guards[spec] = original
                continue
            guard = self._guarded(spec, original)
            self.guards[spec] = guard
            static = inspect.getattr_static(owner, name)
            if isinstance(static, staticmethod):
                setattr(owner, name, staticmethod(guard))
            elif isinstance(static, classmethod):
                self.guards[spec] = guard = self._guarded(spec, static.__func__)
                setattr(owner, name, classmethod(guard))
            else:
                setattr(owner, name, guard)
            # a package that re-exports the function holds the unguarded object too
            for module in list(sys.modules.values()):
                if getattr(module, "__name__", "").startswith("minisgl") \
                        and getattr(module, name, None) is original:
                    setattr(module, name, guard)

    def aliases(self) -> list[str]:
        """The learner's names that are the engine's answer itself, each with a sentence."""
        module = sys.modules.get(self.learner_module)
        if module is None:
            return []
        found = []
        for learner_name, spec in sorted(self.answers.items()):
            if spec not in self.originals:  # could not be imported, so cannot be the answer
                continue
            value = getattr(module, learner_name, None)
            original = self.originals[spec]
            same = value is not None and (value is original or value is self.guards[spec])
            derived = isinstance(value, type) and isinstance(original, type) \
                and issubclass(value, original)
            if same or derived:
                how = "is" if same else "subclasses"
                found.append(f"{self.learner_module}.{learner_name} {how} the engine's own "
                             f"{spec}: write it yourself instead of importing it")
        return found


_guard: _Guard | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _guard
    learner_file = os.environ.get(LEARNER_FILE_VAR)
    if not learner_file:
        return
    _guard = _Guard(learner_file, json.loads(os.environ.get(ANSWERS_VAR, "{}")))
    _guard.install()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _guard is not None:
        found = _guard.aliases()
        if found:
            raise EngineAnswerUsed("; ".join(found))
