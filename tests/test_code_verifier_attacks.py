"""The code verifier against programs written to game it, through the real `scalerl grade --verifier code`. Each
is graded wrong under bwrap, while the right programs still pass. Before the judge (tasks/judge/; at 4f89bce), the
first six scored full marks (objects equal to anything, patched builtins, the stack walk to the harness's reporter,
the job read from bwrap's PID 1, the filesystem search for the tests), the rest failed with kinds the program chose
or by chance. Also: the weaker sandbox is refused unless named, and warns when it is."""

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ASSERTS = {"id": "asserts", "problem": "Write add(a, b).",
           "tests": {"setup": "import math",
                     "asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}}
BUILTINS = {"id": "builtins", "problem": "Write order(xs) returning xs sorted.",
            "tests": {"asserts": ["assert order([3, 1, 2]) == sorted([3, 1, 2])",
                                  "assert isinstance(order([2, 1]), list) and order([2, 1]) == sorted([2, 1])"]}}
QUEUE = {"id": "queue", "problem": "Write a class Queue with push and a property is_empty.",
         "tests": {"setup": "q = Queue()", "asserts": ["assert q.is_empty", "q.push(1)\nassert not q.is_empty"]}}
FLOATS = {"id": "floats", "problem": "Write half(x).",  # relies on `math`, which the program imports
          "tests": {"asserts": ["assert math.isclose(half(1), 0.5)", "assert math.isclose(half(3), 1.5)"]}}
STDIN = {"id": "stdin", "problem": "Print the square of the integer on stdin.",
         "tests": {"inputs": ["7\n", "12\n"], "outputs": ["49\n", "144\n"]}}

RIGHT = [("asserts", "def add(a, b):\n    return a + b"),
         ("builtins", "def order(xs):\n    return sorted(xs)"),
         ("stdin", "n = int(input())\nprint(n * n)"),
         ("floats", "import math\n\ndef half(x):\n    return x / 2"),
         ("queue", "class Queue:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
                   "        self.items.append(x)\n\n    @property\n    def is_empty(self):\n"
                   "        return not self.items")]

_FORGED = ('{"ready": true}\\n{"assert": 0, "failure": null}\\n{"assert": 1, "failure": null}\\n'
           '{"assert": 2, "failure": null}\\n{"case": 0, "stdout": "49\\\\n", "stderr": "", "status": 0, '
           '"failure": null, "seconds": 0}\\n{"done": true}\\n')
ATTACKS = {
    # an object equal to anything, and an int subclass that says so
    "equal to anything": ("asserts", "class Yes:\n    def __eq__(self, other):\n        return True\n"
                                     "    __hash__ = None\n\ndef add(a, b):\n    return Yes()"),
    "int subclass": ("asserts", "class I(int):\n    def __eq__(self, other):\n        return True\n"
                                "    __hash__ = int.__hash__\n\ndef add(a, b):\n    return I(0)"),
    # patched builtins: the asserts run in the judge, whose builtins the program never touches
    "patched builtins": ("builtins", "import builtins\nbuiltins.sorted = lambda xs: list(xs)\n"
                                     "def order(xs):\n    return list(xs)"),
    # a module of its own under the name of one the asserts use
    "fake math module": ("floats", "class Always:\n    def isclose(self, *args):\n        return True\n\n"
                                   "math = Always()\n\ndef half(x):\n    return 0"),
    # an object whose attributes the judge would take for true (a method proxy for any name)
    "attributes of an empty object": ("queue", "class Queue:\n    def push(self, x):\n        pass"),
    "shadowed builtins": ("builtins", "def sorted(xs):\n    return list(xs)\n\ndef isinstance(*args):\n"
                                      "    return True\n\ndef order(xs):\n    return list(xs)"),
    # the harness's frames: walk up the stack to the code that reports verdicts and call it
    "stack walk": ("asserts", "import os, sys\ndef add(a, b):\n    frame = sys._getframe()\n"
                              "    while frame is not None:\n        report = frame.f_locals.get('report')\n"
                              "        if callable(report):\n            for i in range(3):\n"
                              "                report(i, 'pass')\n            os._exit(0)\n"
                              "        frame = frame.f_back\n    return None"),
    # /proc: bwrap's PID 1 held the job (its token included) on its stdin; then print the verdicts it would
    "proc of pid 1": ("asserts", "import json, os\ntry:\n    job = json.loads(open('/proc/1/fd/0').read())\n"
                                 "    for i in range(3):\n"
                                 "        os.write(1, f\"\\n{job['token']} {i} pass\\n\".encode())\n"
                                 "    os._exit(0)\nexcept (OSError, ValueError, KeyError):\n    pass\n"
                                 "for path in ['/proc/1/environ', '/proc/1/mem', '/proc/1/fd/3']:\n    try:\n"
                                 "        open(path, 'rb').read(16)\n    except OSError:\n        pass\n"
                                 "def add(a, b):\n    return None"),
    # fd games: write forged records to every fd, close the standard ones, then exit early
    "fd games": ("asserts", "import os\nfor fd in range(0, 256):\n    try:\n"
                            f"        os.write(fd, '{_FORGED}'.encode())\n    except OSError:\n        pass\n"
                            "os.close(1)\nos.close(2)\ndef add(a, b):\n    os._exit(0)"),
    "early exit": ("asserts", "import os\nos._exit(0)"),
    "sys.exit in the call": ("asserts", "import sys\ndef add(a, b):\n    sys.exit(0)"),
    "printed verdicts": ("asserts", f"import sys\nprint('{_FORGED}')\nsys.stderr.write('{_FORGED}')\n"
                                    "def add(a, b):\n    print('PASS')\n    return None"),
    # killing the judge (PID 1 of the sandbox) or the whole group
    "kill the judge": ("asserts", "import os, signal\nfor target in (1, os.getppid()):\n    try:\n"
                                  "        os.kill(target, signal.SIGKILL)\n    except OSError:\n        pass\n"
                                  "os.killpg(0, signal.SIGKILL)"),
    # the tests on disk: search the filesystem for JSONL rows that hold our input, print their output
    "search the filesystem": ("stdin", "import json, os\nstdin = input() + '\\n'\n"
                                       "skip = {'proc', 'sys', 'dev', 'usr', '.venv', '.git', 'site-packages'}\n"
                                       "for root, dirs, files in os.walk('/'):\n"
                                       "    dirs[:] = [d for d in dirs if d not in skip]\n    for name in files:\n"
                                       "        if name.endswith('.jsonl'):\n            try:\n"
                                       "                for line in open(os.path.join(root, name)):\n"
                                       "                    tests = json.loads(line).get('tests') or {}\n"
                                       "                    if stdin in tests.get('inputs', []):\n"
                                       "                        i = tests['inputs'].index(stdin)\n"
                                       "                        print(tests['outputs'][i], end='')\n"
                                       "                        raise SystemExit(0)\n"
                                       "            except (OSError, ValueError, AttributeError):\n"
                                       "                pass\n"),
    # spoofed failure kinds (only metrics, but still: never from the program's own words or exit status)
    "spoofed sandbox error": ("stdin", "import sys\nsys.stderr.write('bwrap: Can\\'t mount proc\\n')\nsys.exit(1)"),
    "spoofed timeout": ("stdin", "import os\nos._exit(137)"),
}
SPOOFED = {"spoofed sandbox error", "spoofed timeout"}


def _fence(code: str) -> str:
    return f"Here it is.</think>\n```python\n{code}\n```"


@pytest.fixture
def data_dir():
    """Where the problems file lies: in the checkout, not under /tmp (a sandbox's /tmp was always its own), so a
    program that searches the host's filesystem would find it if the sandbox showed it."""
    path = Path(__file__).parent / f".attack-data-{secrets.token_hex(4)}"
    path.mkdir()
    yield path
    shutil.rmtree(path)


def _grade(tmp_path, completions: list[tuple[str, str]], *flags: str, env: dict | None = None):
    problems, answers = tmp_path / "problems.jsonl", tmp_path / "completions.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in (ASSERTS, BUILTINS, STDIN, FLOATS, QUEUE)))
    answers.write_text("".join(json.dumps({"id": key, "completion": _fence(code)}) + "\n" for key, code in completions))
    return subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", "grade", "--verifier", "code", "--problems",
                           str(problems), "--completions", str(answers), "--json", "--workers", "2", *flags],
                          capture_output=True, text=True, timeout=300, env=env)


def test_attacks_are_graded_wrong_and_right_programs_pass(bwrap, data_dir):
    names = list(ATTACKS)
    out = _grade(data_dir, RIGHT + [ATTACKS[name] for name in names])
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["correct"], r["fraction"]) for r in rows[:len(RIGHT)]] == [(True, 1.0)] * len(RIGHT)
    graded = dict(zip(names, rows[len(RIGHT):], strict=True))
    passed = {name: row for name, row in graded.items() if row["correct"] or row["fraction"] > 0}
    assert passed == {}, f"attacks that scored: {passed}"
    assert {graded[name]["failure"] for name in SPOOFED} == {"runtime_error"}
    assert graded["equal to anything"]["failure"] == graded["int subclass"]["failure"] == "wrong_answer"


def test_the_weaker_sandbox_only_when_named(tmp_path):
    """Without a working bwrap (none on PATH), grading code fails with the opt-in named; `--sandbox rlimits` runs
    and warns."""
    no_bwrap = {**os.environ, "PATH": str(tmp_path)}
    no_bwrap.pop("SCALERL_SANDBOX", None)
    refused = _grade(tmp_path, RIGHT[:1], env=no_bwrap)
    assert refused.returncode != 0 and "data.code_sandbox: rlimits" in refused.stderr
    assert "bwrap is not installed" in refused.stderr
    weaker = _grade(tmp_path, RIGHT[:1], "--sandbox", "rlimits", env=no_bwrap)
    assert weaker.returncode == 0, weaker.stderr
    assert json.loads(weaker.stdout.splitlines()[0])["correct"] is True
    assert "WARNING: scalerl grade grades code in the rlimits" in weaker.stderr
