"""Verifiers: the functions that decide whether an answer is right, by name.

A verifier is a top-level function called in a grader worker process (`rewards.RewardGrader`) with the answer part of a
completion (the thinking already stripped; a source without thinking: the whole reply) in one of three forms:

  - with the gold answer string: `fn(answer: str, gold: str) -> bool`  (the default; the built-in "math"). The
    answer is first read in the source's `answer_format` (tasks/answers.py: the whole answer part by default, or
    the last `\boxed{}`, `#### N`, the last number, a pattern's group); a reply without one is "no_answer".
  - with the whole problem row, when the function is marked with `@takes_problem(...)`:
    `fn(answer: str, problem: dict) -> bool | Verdict`, the dict holding "key", "problem", "answer", "tests",
    "answer_format", "data_source" and "extra_info" (the built-in "code" runs the row's tests).
  - verl's reward form, recognised by its parameter names: `compute_score(data_source, solution_str, ground_truth,
    extra_info=None) -> float | dict`, called by keyword with the row's `data_source` (default: the source's
    domain), the answer part, the gold answer and the row's `extra_info` (default {}). It returns a score, or a dict
    with "score" whose other numeric keys are logged as metrics (`rollout/reward/<key>`). Pass: score >= 1.0; the
    reward is reward_incorrect + score x (reward_correct - reward_incorrect) (`rewards.reward_of`).

The first two return a bool or a `Verdict` (which also carries the fraction of tests passed and the kind of
failure). A verifier is named in a recipe (`data.train[].verifier`) or on a command line either by a registered name
(`known_verifiers()`: the built-ins, and any registered with `@register_verifier("name")` in a module imported first)
or by its import path "package.module:function". Workers import it by that path, so it must be a top-level function
of an importable module.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_scalerl.errors import UserError
from megatron_scalerl.tasks.answers import extract_answer, gold_answer

Verifier = Callable[[str, Any], "bool | Verdict"]

# Kinds of `Verdict.failure` every verifier may give; the code verifier adds its own (code_verifier.FAILURE_KINDS).
NO_ANSWER = "no_answer"  # the completion never closed its thinking, so has no answer part
WRONG_ANSWER = "wrong_answer"


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement. `fraction`: the share of the problem's tests passed, in [0, 1] (a verifier without
    tests: 1.0 when correct, else 0.0); `failure`: why it is not correct, as a short kind ("wrong_answer", "timeout",
    "memory", ...), None when correct; `score`, `metrics`: a verl-form reward's score and its other figures."""

    correct: bool
    fraction: float
    failure: str | None = None
    score: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)

    @staticmethod
    def of(result: bool | Verdict) -> Verdict:
        """A verifier's return value as a Verdict (a bool: all or nothing, a wrong one is "wrong_answer")."""
        if isinstance(result, Verdict):
            return result
        return Verdict(True, 1.0) if result else Verdict(False, 0.0, WRONG_ANSWER)


class VerifierError(UserError):
    """A verifier name does not resolve to a function; the message lists the known names."""


def takes_problem(check: Callable[[Mapping[str, Any]], None] | None = None) -> Callable[[Verifier], Verifier]:
    """Decorator: the verifier takes the problem row (a dict) instead of the gold string. `check(row)` raises
    ValueError on a row the verifier cannot grade (say, malformed tests); the data loader calls it on every row of
    a source using this verifier, so a bad row is reported with its file and line before the run starts."""

    def mark(fn: Verifier) -> Verifier:
        fn.takes_problem = True  # type: ignore[attr-defined]
        fn.check_problem = check  # type: ignore[attr-defined]
        return fn

    return mark


# ---- the registry: name -> "module:function", so a worker process can import the function ----

_REGISTRY: dict[str, str] = {
    "math": "megatron_scalerl.tasks.verifiers:verify_math",
    "code": "megatron_scalerl.tasks.code_verifier:verify_code",
}


def register_verifier(name: str) -> Callable[[Verifier], Verifier]:
    """Decorator: register a top-level verifier function under `name` (see the module docstring for its forms).

    The registry stores the function's import path; functions that cannot be imported by path (nested, lambdas) are
    refused."""

    def decorate(fn: Verifier) -> Verifier:
        if "<" in fn.__qualname__ or "." in fn.__qualname__:
            raise VerifierError(f"verifier {name!r}: {fn.__qualname__} is not a top-level function; "
                                "worker processes import verifiers by module path")
        _REGISTRY[name] = f"{fn.__module__}:{fn.__qualname__}"
        return fn

    return decorate


def known_verifiers() -> list[str]:
    return sorted(_REGISTRY)  # names; any top-level function also works as "package.module:function"


def import_verifier(path: str) -> Verifier:
    """The function at "module:function"."""
    module, _, attr = path.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise TypeError(f"{path} is not callable")
    return fn


def resolve_verifier(name: str) -> str:
    """The import path ("module:function") of a verifier given by registered name or by path; checked here, in the
    caller's process, so a typo fails at once rather than as an error grade per answer."""
    path = _REGISTRY.get(name, name)
    if ":" not in path:
        raise VerifierError(f"unknown verifier {name!r}; known: {', '.join(known_verifiers())} "
                            "(or name a top-level function as 'package.module:function')")
    try:
        import_verifier(path)
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        raise VerifierError(f"verifier {name!r}: cannot import {path}: {e}") from e
    return path


def takes_problem_row(fn: Verifier) -> bool:
    return bool(getattr(fn, "takes_problem", False))


VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth")  # and, optionally, extra_info


@functools.cache
def _parameter_names(fn: Verifier) -> frozenset[str]:
    """`fn`'s parameter names, read once per function (the grader calls it per answer); none for a builtin."""
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return frozenset()


def takes_verl_arguments(fn: Verifier) -> bool:
    """Whether `fn` is a reward in verl's form: it has parameters named `data_source`, `solution_str` and
    `ground_truth` (and maybe `extra_info`)."""
    return all(name in _parameter_names(fn) for name in VERL_PARAMETERS)


def reads_gold_answer(fn: Verifier) -> bool:
    """Whether `fn` compares an extracted answer with the gold string (so a source's `answer_format` applies)."""
    return not takes_problem_row(fn) and not takes_verl_arguments(fn)


def _verl_verdict(result: Any) -> Verdict:
    """A verl-form reward's return value (a score, or a dict with "score" and other figures) as a Verdict."""
    metrics: dict[str, float] = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            raise TypeError(f"the reward returned a dict without 'score' (keys: {', '.join(map(str, result))})")
        metrics = {str(k): float(v) for k, v in result.items() if k != "score" and isinstance(v, int | float)}
        result = result["score"]
    if not isinstance(result, int | float) or not math.isfinite(result):
        raise TypeError(f"the reward returned {result!r}: a finite number (or a dict with 'score') is needed")
    score = float(result)
    correct = score >= 1.0
    return Verdict(correct, 1.0 if correct else 0.0, None if correct else WRONG_ANSWER, score=score, metrics=metrics)


def row_check(name: str) -> Callable[[Mapping[str, Any]], None] | None:
    """The row check of verifier `name` (see `takes_problem`), or None."""
    return getattr(import_verifier(resolve_verifier(name)), "check_problem", None)


def call_verifier(fn: Verifier, answer: str, problem: Mapping[str, Any]) -> Verdict:
    """Run `fn` on `answer` in the form it takes (module docstring: the gold string, the problem row or verl's
    keywords); its result as a Verdict."""
    if takes_verl_arguments(fn):
        keywords = {"data_source": problem.get("data_source", "math"), "solution_str": answer,
                    "ground_truth": problem["answer"]}
        if "extra_info" in _parameter_names(fn):
            keywords["extra_info"] = problem.get("extra_info") or {}
        return _verl_verdict(fn(**keywords))
    if takes_problem_row(fn):
        return Verdict.of(fn(answer, problem))
    answer_format = problem.get("answer_format", "math_verify")
    extracted = extract_answer(answer, answer_format)
    if extracted is None:
        return Verdict(False, 0.0, NO_ANSWER)
    return Verdict.of(fn(extracted, gold_answer(problem["answer"], answer_format)))


# ---- the built-in "math" verifier ----

def _gold_latex(gold: str) -> str:
    """A bare gold ("33", "\\frac{1}{2}") wrapped in $...$ so math-verify's LaTeX extraction sees it."""
    gold = gold.strip()
    if "$" in gold or "\\boxed" in gold or "\\(" in gold or "\\[" in gold:
        return gold
    return f"${gold}$"


def verify_math(answer: str, gold: str) -> bool:
    """math-verify: gold first (`verify(gold, pred)` is not symmetric). 33 == 033, 1/2 == 0.5 == \\frac{1}{2}."""
    from math_verify import parse, verify  # deferred: math-verify imports sympy (~1 s); only grader workers need it

    return bool(verify(parse(_gold_latex(gold)), parse(answer)))
