"""Our generated tasks, for small end-to-end runs (the CPU demo): problems with tests, made from a seed.

    rows = generate("code_functions", size=2000, seed=0)   # [{"problem": ..., "tests": {"asserts": [...]}}]

`code_functions`: "Write a Python function f(x) that returns x times 3 plus 4." with asserts on seeded inputs, for the
code verifier. Its 270 distinct functions (six forms, constants 1-9) are few enough for a 4-layer model to learn in
minutes and phrased in words, so writing the right expression is more than copying the prompt.
"""

from __future__ import annotations

import random

# (the words after "returns", the Python expression, its value), with {a} and {b} the constants
CODE_FORMS = [
    ("x plus {a}", "x + {a}", lambda x, a, b: x + a),
    ("x minus {a}", "x - {a}", lambda x, a, b: x - a),
    ("x times {a}", "x * {a}", lambda x, a, b: x * a),
    ("x times {a} plus {b}", "x * {a} + {b}", lambda x, a, b: x * a + b),
    ("x times {a} minus {b}", "x * {a} - {b}", lambda x, a, b: x * a - b),
    ("x plus {a}, times {b}", "(x + {a}) * {b}", lambda x, a, b: (x + a) * b),
]
TEST_INPUTS = 3  # asserts per problem, on distinct x in [-9, 9]


def code_function(rng: random.Random) -> dict:
    """One code_functions row: the problem, a reference solution as its `answer` (the code verifier does not read
    it; the demo's warm start does), and its asserts."""
    words, expression, value = rng.choice(CODE_FORMS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    xs = rng.sample(range(-9, 10), TEST_INPUTS)
    return {"problem": f"Write a Python function f(x) that returns {words.format(a=a, b=b)}.",
            "answer": f"def f(x):\n    return {expression.format(a=a, b=b)}",
            "tests": {"asserts": [f"assert f({x}) == {value(x, a, b)}" for x in xs]}}


TASKS = {"code_functions": code_function}


def generate(task: str, *, size: int, seed: int) -> list[dict]:
    """`size` rows of `task`, the same for the same seed; ValueError for an unknown task."""
    if task not in TASKS:
        raise ValueError(f"unknown task; known: {', '.join(sorted(TASKS))}")
    rng = random.Random(f"synthetic/{task}/{seed}")
    return [TASKS[task](rng) for _ in range(size)]
