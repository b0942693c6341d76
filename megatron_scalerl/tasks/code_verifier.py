"""The "code" verifier: run the answer's last fenced Python block against the problem's tests, in a sandbox.

The program is the answer's LAST fenced code block: ```python, ```py, ```python3 or a bare ``` (blocks in other
languages, and a block left unclosed, are skipped). It runs with the standard library only (`python -I -S`). A
problem row's "tests" (an object: the data loader, tasks/problems.py, has parsed a JSON string already) holds one
of two formats, as common datasets ship them:

  - stdin/stdout: {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}: one run per case with its input on stdin,
    each in a fresh sandbox. A case passes when the run exits 0 and its stdout equals the expected output up to
    spaces, tabs and "\\r" at the ends of lines ("\\n" alone ends a line) and empty lines at the end.
  - function asserts: {"asserts": ["assert f(1) == 2", ...], "setup": "code run before the asserts (optional)"}: one
    sandboxed run of the program as module "solution" (so its `if __name__ == "__main__":` block does not run), which
    only answers calls: the setup and the asserts run in the sandbox's trusted judge, on the plain-data values the
    program's functions return (tasks/judge/asserts.py). A value that is not plain data (an object that claims to
    equal anything, say) never equals anything there.

Verdict: correct when every test passes; `fraction`: tests passed / tests; `failure`: None when correct, else the
kind of the first failing test: "wrong_answer" (it ran, but the output differs or the assert is false), one of the
sandbox's kinds ("timeout", "memory", "output_limit", "processes", "filesystem", "runtime_error", "syntax_error",
"sandbox_error"; observed by the sandbox, see tasks/sandbox.py), "no_code" (no code block) or "no_answer" (an empty
answer).
`FAILURE_KINDS` lists them all. A program that does not compile fails every test as "syntax_error" without a run.

Limits: each run gets `LIMITS` (2 CPU seconds, 4 s wall, 512 MiB address space per process, 32 tasks, 1 MiB of
output, 16 MiB files); the answer as a whole gets `ANSWER_DEADLINE_S` (8 s, below the grader's 10 s per answer): no
run outlasts it, and tests not started by then fail as "timeout". The sandbox is bubblewrap; the weaker rlimits one
runs only where the recipe names it (`data.code_sandbox`; `sandbox.sandbox_kind()`; docs/code_verifier.md).

Nothing the program prints or does can forge a pass: outputs are compared here, asserts evaluated by the judge, and
neither the expected outputs nor the judge's memory, fds or channel are within the program's reach (tasks/sandbox.py).
"""

from __future__ import annotations

import dataclasses
import textwrap
import time
from collections.abc import Mapping
from typing import Any

from megatron_scalerl.tasks import sandbox
from megatron_scalerl.tasks.verifiers import NO_ANSWER, WRONG_ANSWER, Verdict, takes_problem

LIMITS = sandbox.Limits()
ANSWER_DEADLINE_S = 8.0  # wall seconds for all of an answer's runs
NO_CODE = "no_code"
SYNTAX_ERROR = "syntax_error"
FAILURE_KINDS = (NO_ANSWER, NO_CODE, WRONG_ANSWER, *sandbox.FAILURE_KINDS)
_PYTHON_FENCES = ("", "python", "py", "python3")
_TEST_FIELDS = ("inputs", "outputs", "asserts", "setup")

def final_code_block(answer: str) -> str | None:
    """The answer's last closed fenced Python code block (see the module docstring), None if it has none."""
    blocks, fence, lines = [], None, []
    for line in answer.splitlines():
        stripped = line.strip()
        if fence is None:
            if stripped.startswith("```"):
                fence, lines = stripped[3:].strip().lower(), []
        elif stripped.startswith("```") and not stripped.strip("`"):
            if fence in _PYTHON_FENCES:
                blocks.append(textwrap.dedent("\n".join(lines)))
            fence = None
        else:
            lines.append(line)
    return blocks[-1] if blocks else None


def check_tests(problem: Mapping[str, Any]) -> None:
    """Raise ValueError, naming the field, when `problem["tests"]` is not one of the two formats."""
    tests = _tests_of(problem)
    unknown = sorted(set(tests) - set(_TEST_FIELDS))
    if unknown:
        raise ValueError(f"tests: unknown field {unknown[0]!r} (known: {', '.join(_TEST_FIELDS)})")
    io = [name for name in ("inputs", "outputs") if name in tests]
    if io and "asserts" in tests:
        raise ValueError("tests: has both 'inputs'/'outputs' and 'asserts'; give one format")
    if io:
        if io == ["inputs"]:
            raise ValueError("tests: has 'inputs' but not 'outputs'")
        if io == ["outputs"]:
            raise ValueError("tests: has 'outputs' but not 'inputs'")
        if "setup" in tests:
            raise ValueError("tests.setup: only for 'asserts'; stdin/stdout tests have none")
        inputs, outputs = _strings(tests, "inputs"), _strings(tests, "outputs")
        if len(inputs) != len(outputs):
            raise ValueError(f"tests: 'inputs' and 'outputs' differ in length ({len(inputs)} vs {len(outputs)})")
    elif "asserts" in tests:
        for i, test in enumerate(_strings(tests, "asserts")):
            _check_python(test, f"tests.asserts[{i}]")
        setup = tests.get("setup", "")
        if not isinstance(setup, str):
            raise ValueError(f"tests.setup: expected a string of Python code, got {type(setup).__name__}")
        _check_python(setup, "tests.setup")
    else:
        raise ValueError("tests: expected {'inputs': [...], 'outputs': [...]} or {'asserts': [...]}, got neither")


@takes_problem(check=check_tests)
def verify_code(answer: str, problem: dict) -> Verdict:
    """Run the answer's last code block against `problem["tests"]` (checked by `check_tests`); see the module
    docstring for the verdict."""
    if not answer.strip():
        return Verdict(False, 0.0, NO_ANSWER)
    program = final_code_block(answer)
    if program is None:
        return Verdict(False, 0.0, NO_CODE)
    tests = _tests_of(problem)
    count = len(tests["inputs"] if "inputs" in tests else tests["asserts"])
    if not _compiles(program):
        return _verdict([SYNTAX_ERROR] * count)
    deadline = time.monotonic() + ANSWER_DEADLINE_S
    if "inputs" in tests:
        return _verdict(_run_cases(program, tests["inputs"], tests["outputs"], deadline))
    return _verdict(_run_asserts(program, tests["asserts"], tests.get("setup", ""), deadline))


def _run_cases(program: str, inputs: list[str], outputs: list[str], deadline: float) -> list[str | None]:
    """Each stdin/stdout case's outcome: None (passed) or its failure kind. Each case is a fresh sandbox (no state of
    one run reaches the next); each run's output is compared as it ends and let go, so grading holds one run's output
    at a time (`sandbox.case_record_bytes`); cases not run by `deadline` (monotonic seconds) are timeouts."""
    left = deadline - time.monotonic()
    if left <= 0:
        return ["timeout"] * len(inputs)
    runs = sandbox.run_cases(program, inputs, LIMITS, deadline_s=left)
    return [run.failure or (None if _normalized(run.stdout) == _normalized(expected) else WRONG_ANSWER)
            for run, expected in zip(runs, outputs, strict=True)]


def _run_asserts(program: str, asserts: list[str], setup: str, deadline: float) -> list[str | None]:
    """Each assert's outcome: None (passed) or its failure kind (tasks/judge/asserts.py)."""
    limits = _limits_until(deadline)
    if limits is None:
        return ["timeout"] * len(asserts)
    return sandbox.run_asserts(program, setup, asserts, limits)


def _verdict(outcomes: list[str | None]) -> Verdict:
    """The verdict on the tests' outcomes (None: passed; else the failure kind), failing with the first failure."""
    failures = [kind for kind in outcomes if kind is not None]
    return Verdict(not failures, (len(outcomes) - len(failures)) / len(outcomes), failures[0] if failures else None)


def _limits_until(deadline: float) -> sandbox.Limits | None:
    """LIMITS with the wall time cut to what is left before `deadline` (monotonic seconds); None when nothing is."""
    left = deadline - time.monotonic()
    return dataclasses.replace(LIMITS, wall_s=min(LIMITS.wall_s, left)) if left > 0 else None


def _normalized(text: str) -> list[str]:
    """`text`'s lines without spaces, tabs and "\\r" at their ends, and without empty lines at its end. Lines end at
    "\\n" only ("\\r\\n" too, its "\\r" stripped): not at str.splitlines()' other breaks (\\x0b, \\x0c, \\x1c-\\x1e,
    \\x85, \\u2028, \\u2029), and no other whitespace is stripped, so "3\\u20284" is not "3\\n4"."""
    lines = [line.rstrip(" \t\r") for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _compiles(program: str) -> bool:
    try:
        compile(program, "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: null bytes; the others: too deep
        return False
    return True


def _tests_of(problem: Mapping[str, Any]) -> Mapping[str, Any]:
    """The row's "tests" object."""
    tests = problem.get("tests")
    if tests is None:
        raise ValueError("tests: missing (the code verifier needs the row's tests)")
    if not isinstance(tests, Mapping):
        raise ValueError(f"tests: expected an object, got {type(tests).__name__}")
    return tests


def _strings(tests: Mapping[str, Any], name: str) -> list[str]:
    """tests[name], checked to be a non-empty list of strings."""
    value = tests[name]
    if not isinstance(value, list) or not value:
        raise ValueError(f"tests.{name}: expected a non-empty list of strings, got {value!r:.80}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise ValueError(f"tests.{name}[{i}]: expected a string, got {type(item).__name__}")
    return value


def _check_python(source: str, field: str) -> None:
    try:
        compile(source, field, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        where = f", line {e.lineno}" if isinstance(e, SyntaxError) and e.lineno else ""
        raise ValueError(f"{field}: not valid Python ({getattr(e, 'msg', e)}{where})") from None
