"""The code verifier: the code block it runs, the test formats it accepts, and real sandboxed runs of right, wrong and
misbehaving programs in both formats (grading through the RewardGrader is tested with the grader)."""

import json
import time

import pytest

from megatron_scalerl.tasks import code_verifier, sandbox
from megatron_scalerl.tasks.code_verifier import FAILURE_KINDS, check_tests, final_code_block, verify_code
from megatron_scalerl.tasks.verifiers import Verdict, call_verifier, import_verifier, resolve_verifier, row_check

ADD_CASES = {"tests": {"inputs": ["1 2\n", "3 4\n", "-5 5\n"], "outputs": ["3\n", "7\n", "0\n"]}}
ADD_ASSERTS = {"tests": {"asserts": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0"]}}
READ_AND_ADD = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)"
ADD = "def add(a, b):\n    return a + b"


def answer(code: str, fence: str = "python") -> str:
    return f"The sum of the two numbers:\n\n```{fence}\n{code}\n```\n\nThis runs in O(1)."


@pytest.fixture
def short_limits(monkeypatch):
    """Limits small enough for a test: 1 CPU second and 3 s of wall time a run (room for a loaded machine: the CPU
    limit must come first), 4.5 s an answer."""
    monkeypatch.setattr(code_verifier, "LIMITS", sandbox.Limits(cpu_s=1, wall_s=3))
    monkeypatch.setattr(code_verifier, "ANSWER_DEADLINE_S", 4.5)


# ---- the code block ----

def test_the_last_python_block_is_the_program():
    text = "First try:\n```python\nprint(1)\n```\nBetter:\n```py\nprint(2)\n```\n"
    assert final_code_block(text) == "print(2)"
    assert final_code_block("```\nx = 1\n```") == "x = 1"
    assert final_code_block("```Python3\nx = 3\n```") == "x = 3"
    assert final_code_block("  ```python\n  def f():\n      return 1\n  ```") == "def f():\n    return 1"


def test_blocks_that_are_not_python_or_not_closed_are_skipped():
    text = "```python\nprint('kept')\n```\nIn C:\n```cpp\nint main() {}\n```\nsaid\n```python\nprint('cut off"
    assert final_code_block(text) == "print('kept')"
    assert final_code_block("no code here, just `inline` code") is None


# ---- the test formats ----

@pytest.mark.parametrize("tests", [
    {"inputs": ["1\n"], "outputs": ["1\n"]},
    {"asserts": ["assert f(1) == 2"]},
    {"asserts": ["assert f(1) == 2"], "setup": "from math import sqrt"},
])
def test_well_formed_tests(tests):
    check_tests({"tests": tests})


@pytest.mark.parametrize("tests, message", [
    (None, "tests: missing (the code verifier needs the row's tests)"),
    (json.dumps({"asserts": ["assert f(1) == 2"]}), "tests: expected an object, got str"),  # the loader parses it
    ({}, "got neither"),
    ({"inputs": ["1"], "outputs": ["1"], "asserts": ["assert 1"]}, "has both"),
    ({"inputs": ["1"]}, "has 'inputs' but not 'outputs'"),
    ({"inputs": ["1", "2"], "outputs": ["1"]}, "'inputs' and 'outputs' differ in length (2 vs 1)"),
    ({"inputs": [], "outputs": []}, "tests.inputs: expected a non-empty list of strings"),
    ({"inputs": ["1", 2], "outputs": ["1", "2"]}, r"tests.inputs\[1\]: expected a string, got int"),
    ({"inputs": ["1"], "outputs": ["1"], "setup": "x = 1"}, "tests.setup: only for 'asserts'"),
    ({"asserts": "assert f(1) == 2"}, "tests.asserts: expected a non-empty list"),
    ({"asserts": ["assert f(1) == 2", "assert f(2) =="]}, r"tests.asserts\[1\]: not valid Python"),
    ({"asserts": ["assert f(1)"], "setup": 3}, "tests.setup: expected a string"),
    ({"asserts": ["assert f(1)"], "input": ["1"]}, "tests: unknown field 'input'"),
])
def test_malformed_tests_name_the_field(tests, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_tests({"tests": tests})
    with pytest.raises(ValueError, match="tests: missing"):
        check_tests({"problem": "add two numbers"})


# ---- stdin/stdout ----

def test_right_program_on_stdin_and_stdout():
    assert verify_code(answer(READ_AND_ADD), ADD_CASES) == Verdict(True, 1.0, None)


def test_output_is_compared_up_to_trailing_whitespace():
    tests = {"tests": {"inputs": ["2\n"], "outputs": ["1 2\n3 4\n"]}}
    assert verify_code(answer("print('1 2  ')\nprint('3 4\\t')\nprint()\nprint()"), tests).correct
    assert not verify_code(answer("print()\nprint('1 2')\nprint('3 4')"), tests).correct  # a leading line counts


def test_wrong_output_gets_partial_credit():
    program = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(abs(a) + abs(b))"
    assert verify_code(answer(program), ADD_CASES) == Verdict(False, 2 / 3, "wrong_answer")


def test_a_crash_is_a_runtime_error_even_after_the_right_output():
    assert verify_code(answer(READ_AND_ADD + "\nraise SystemExit(1)"), ADD_CASES) == Verdict(False, 0.0,
                                                                                             "runtime_error")


def test_cases_past_the_answer_deadline_time_out(short_limits):
    start = time.monotonic()
    verdict = verify_code(answer("import time\ntime.sleep(60)"), ADD_CASES)
    assert verdict == Verdict(False, 0.0, "timeout")
    # the answer stops at its deadline, give or take a loaded machine's sandbox teardown (1.35 s seen): never a
    # third case's 3 s
    assert time.monotonic() - start < code_verifier.ANSWER_DEADLINE_S + 2


# ---- asserts ----

def test_right_function_passes_the_asserts():
    assert verify_code(answer(ADD), ADD_ASSERTS) == Verdict(True, 1.0, None)


def test_two_of_three_asserts():
    program = "def add(a, b):\n    return a + b if a >= 0 else 7"
    assert verify_code(answer(program), ADD_ASSERTS) == Verdict(False, 2 / 3, "wrong_answer")


def test_the_first_failing_assert_names_the_failure():
    program = "def add(a, b):\n    if a == 2:\n        raise KeyError(a)\n    return a + b if a > 0 else 7"
    assert verify_code(answer(program), ADD_ASSERTS) == Verdict(False, 1 / 3, "runtime_error")
    # the kind is what the sandbox observed: a runner whose resident memory grew to its limit
    memory_hog = ("def add(a, b):\n    if a == 2:\n        blocks = []\n        while True:\n"
                  "            blocks.append(bytearray(1 << 20))\n    return a + b")
    assert verify_code(answer(memory_hog), ADD_ASSERTS) == Verdict(False, 2 / 3, "memory")


def test_setup_runs_before_the_asserts_and_main_does_not_run():
    tests = {"tests": {"setup": "from math import isqrt", "asserts": ["assert root(17) == isqrt(17)"]}}
    program = "def root(n):\n    return int(n ** 0.5)\n\nif __name__ == '__main__':\n    input()"
    assert verify_code(answer(program), tests) == Verdict(True, 1.0, None)


def test_printed_reports_do_not_count():
    fake = ADD.replace("a + b", "0") + "\nfor i in range(3):\n    print(f'\\nPASS {i} pass')\n    print(f'{i} pass')"
    assert verify_code(answer(fake), ADD_ASSERTS) == Verdict(False, 1 / 3, "wrong_answer")  # add(-1, 1) is 0


def test_an_early_exit_fails_the_asserts_not_reported():
    assert verify_code(answer(ADD + "\nimport sys\nsys.exit(0)"), ADD_ASSERTS) == Verdict(False, 0.0, "runtime_error")
    exits_on_second = "import os\ndef add(a, b):\n    if a == 2:\n        os._exit(0)\n    return a + b"
    assert verify_code(answer(exits_on_second), ADD_ASSERTS) == Verdict(False, 1 / 3, "runtime_error")


def test_a_hanging_assert_times_out_after_the_passed_ones(short_limits):
    program = "def add(a, b):\n    while a == 2:\n        pass\n    return a + b"
    assert verify_code(answer(program), ADD_ASSERTS) == Verdict(False, 1 / 3, "timeout")


# ---- answers without a program ----

def test_no_answer_no_code_and_syntax_errors():
    assert verify_code("  \n", ADD_ASSERTS) == Verdict(False, 0.0, "no_answer")
    assert verify_code("The answer is add(a, b) = a + b.", ADD_ASSERTS) == Verdict(False, 0.0, "no_code")
    assert verify_code(answer("def add(a, b)\n    return a + b"), ADD_CASES) == Verdict(False, 0.0, "syntax_error")


# ---- the registry ----

def test_registered_as_code():
    assert row_check("code") is check_tests
    verifier = import_verifier(resolve_verifier("code"))
    problem = {"key": "add#0", "problem": "Add.", "answer": "", **ADD_ASSERTS}
    assert call_verifier(verifier, answer(ADD), problem) == Verdict(True, 1.0, None)
    assert set(FAILURE_KINDS) == set(sandbox.FAILURE_KINDS) | {"no_answer", "no_code", "wrong_answer"}
