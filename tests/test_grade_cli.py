"""`scalerl grade`: the real command on math and code problems, its table and JSON lines, and its errors."""

import json
import subprocess
import sys

PROBLEMS_MATH = [{"id": "m1", "problem": "What is 3 + 4?", "answer": "7"},
                 {"id": "m2", "problem": "What is half of 1?", "answer": "\\frac{1}{2}"}]
PROBLEMS_CODE = [{"id": "c1", "problem": "Write f(x) returning x + 1.",
                  "tests": {"asserts": ["assert f(1) == 2", "assert f(5) == 6", "assert f(-1) == 0"]}},
                 {"id": "c2", "problem": "Print the sum of two integers.",
                  "tests": {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]}}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _grade(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", "grade", *args], capture_output=True,
                          text=True, timeout=120)


def _fence(code: str) -> str:
    return f"I will write it.</think>\n```python\n{code}\n```"


def test_math_completions_as_json_lines(tmp_path):
    problems = _jsonl(tmp_path / "p.jsonl", PROBLEMS_MATH)
    completions = _jsonl(tmp_path / "c.jsonl", [
        {"id": "m1", "completion": "3 plus 4</think>\\boxed{7}"},
        {"id": "m1", "completion": "3 plus 4</think>\\boxed{8}"},
        {"id": "m2", "completion": "thinking that never ends: 0.5"},
        {"id": "m2", "completion": "</think>0.5"}])
    out = _grade("--verifier", "math", "--problems", problems, "--completions", completions, "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["id"], r["correct"], r["fraction"], r["failure"]) for r in rows] == [
        ("m1", True, 1.0, None), ("m1", False, 0.0, "wrong_answer"), ("m2", False, 0.0, "no_answer"),
        ("m2", True, 1.0, None)]
    assert all(r["timed_out"] is False for r in rows)
    whole = _grade("--verifier", "math", "--problems", problems, "--completions", completions, "--json",
                   "--no-thinking")  # the third completion's text is now its answer: 0.5 is right
    assert [json.loads(line)["correct"] for line in whole.stdout.splitlines()][2] is True


def test_code_completions_table_and_summary(tmp_path):
    problems = _jsonl(tmp_path / "p.jsonl", PROBLEMS_CODE)
    completions = _jsonl(tmp_path / "c.jsonl", [
        {"id": "c1", "completion": _fence("def f(x):\n    return x + 1")},
        {"id": "c1", "completion": _fence("def f(x):\n    return abs(x) + 1")},  # 2 of 3 asserts
        {"id": "c2", "completion": _fence("a, b = map(int, input().split())\nprint(a + b)")},
        {"id": "c2", "completion": _fence("while True:\n    pass")},
        {"id": "c2", "completion": "no code at all</think> sorry"}])
    out = _grade("--verifier", "code", "--problems", problems, "--completions", completions)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["id", "correct", "fraction", "failure"]
    table = [line.split() for line in lines[1:6]]
    assert table[0] == ["c1", "yes", "1.00"] and table[2] == ["c2", "yes", "1.00"]
    assert table[1] == ["c1", "no", "0.67", "wrong_answer"]
    assert table[3] == ["c2", "no", "0.00", "timeout"] and table[4] == ["c2", "no", "0.00", "no_code"]
    assert "graded 5 completions of 2 of 2 problems with verifier 'code'" in out.stdout
    assert "pass rate 0.400" in out.stdout and "sandbox: " in out.stdout


def test_bad_input_is_named_by_file_and_line(tmp_path):
    problems = _jsonl(tmp_path / "p.jsonl", PROBLEMS_CODE)
    stray = _jsonl(tmp_path / "c.jsonl", [{"id": "c1", "completion": "x"}, {"id": "c9", "completion": "y"}])
    out = _grade("--verifier", "code", "--problems", problems, "--completions", stray)
    assert out.returncode == 2 and f"{stray}:2: id 'c9' is not in the problems file" in out.stderr
    bad = _jsonl(tmp_path / "bad.jsonl", [PROBLEMS_CODE[0], {"id": "c2", "problem": "p", "tests": {"inputs": ["1"]}}])
    out = _grade("--verifier", "code", "--problems", bad, "--completions", stray)
    assert out.returncode == 2 and f"{bad}:2: " in out.stderr and "(verifier 'code')" in out.stderr
    out = _grade("--verifier", "nope", "--problems", problems, "--completions", stray)
    assert out.returncode == 2 and "unknown verifier 'nope'; known: code, math" in out.stderr
