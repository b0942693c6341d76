"""The code verifier against the second audit's five classes of holes, through the real `scalerl grade --verifier
code` under bwrap: for each class, several programs written to get a wrong answer graded correct (each graded not
correct), and right programs for the same rows (graded correct). Before the fix (at aa85da9), 19 of the 24 attacks
here scored full marks: a star import handed the program the test's names; a counter survived from one case to the
next in /dev/shm, SysV shared memory and semaphores, a POSIX message queue, the user's keyring and the PID
namespace's next pid (only /tmp, which the judge emptied, and a daemon, which it killed, did not); `str.splitlines()`
took other characters for line breaks and stripped Unicode spaces. And the right big-int answer was graded wrong
(ints past 4096 bits were refused). Also: a grader's memory while every case floods its output."""

import json
import subprocess
import sys
import textwrap

from megatron_scalerl.tasks import code_verifier, sandbox

ROWS = {
    # 1. star imports: the test's names (builtins, standard modules, its own imports) are never the program's
    "star abs": {"setup": "from solution import *",
                 "asserts": ["assert abs(dist(1, 4) - 3) < 1e-9", "assert round(dist(0, 2.5), 1) == 2.5"]},
    "star sorted": {"asserts": ["from solution import *\nassert sorted(order([3, 1, 2])) == [1, 2, 3]",
                                "from solution import *\nassert len(order([5, 4])) == 2 and order([5, 4]) == [4, 5]"]},
    "star math": {"setup": "import math\nfrom solution import *",
                  "asserts": ["assert math.isclose(half(1), 0.5)", "assert math.isclose(half(3), 1.5)"]},
    "star own import": {"setup": "from math import isclose\nfrom solution import *",
                        "asserts": ["assert isclose(area(1), 3.14159, rel_tol=1e-3)"]},
    # 2. state from one case to the next: the same input must get the same answer
    "state": {"inputs": ["x\n", "x\n"], "outputs": ["A\n", "B\n"]},
    # 3. only "\n" (and "\r\n") ends a line; only spaces, tabs and "\r" are stripped
    "lines": {"inputs": ["3 4\n", "7 8\n"], "outputs": ["3\n4\n", "7\n8\n"]},
    # 5. integers past the int/str digit limit, compared exactly
    "big ints": {"setup": "import math",
                 "asserts": ["assert fact(1000) == math.factorial(1000)", "assert fact(3000) == math.factorial(3000)",
                             "assert neg_pow(9000) == -(3 ** 9000)"]},
}

RIGHT = [
    ("star abs", "def dist(a, b):\n    return abs(b - a)"),
    ("star sorted", "def order(xs):\n    return sorted(xs)"),
    ("star math", "def half(x):\n    return x / 2"),
    ("star own import", "import math\n\ndef area(r):\n    return math.pi * r * r"),
    ("lines", "a, b = input().split()\nprint(a)\nprint(b)"),
    ("lines", "import sys\na, b = input().split()\nsys.stdout.write(f'{a}  \\r\\n{b}\\t\\r\\n\\n\\n')"),  # CRLF, blanks
    ("big ints", "import math\n\ndef fact(n):\n    return math.factorial(n)\n\ndef neg_pow(n):\n    return -(3 ** n)"),
]

_SHM_COUNTER = ("import os\npath = '{where}/runs'\nruns = int(open(path).read()) if os.path.exists(path) else 0\n"
                "open(path, 'w').write(str(runs + 1))\ninput()\nprint('AB'[min(runs, 1)])")
ATTACKS = {
    "star abs": [
        "def abs(x):\n    return 0\n\ndef round(x, n=0):\n    return 2.5\n\ndef dist(a, b):\n    return 0",
        "import builtins\nabs = lambda x: 0\nround = lambda *a: 2.5\ndef dist(a, b):\n    return -7",
    ],
    "star sorted": [
        "def sorted(xs):\n    return [1, 2, 3]\n\ndef len(xs):\n    return 2\n\ndef order(xs):\n    return [4, 5]",
        "class Sorter:\n    def __call__(self, xs):\n        return [1, 2, 3]\n\nsorted = Sorter()\n"
        "len = lambda xs: 2\ndef order(xs):\n    return [4, 5]",
    ],
    "star math": [
        "class FakeMath:\n    def isclose(self, *args, **kwargs):\n        return True\n\nmath = FakeMath()\n"
        "def half(x):\n    return 0",
        "import types\nmath = types.SimpleNamespace(isclose=lambda *a, **k: True)\ndef half(x):\n    return 0",
    ],
    "star own import": [
        "def isclose(*args, **kwargs):\n    return True\n\ndef area(r):\n    return 0",
        "class Close:\n    def __call__(self, *args, **kwargs):\n        return True\n\nisclose = Close()\n"
        "def area(r):\n    return 1.0",
    ],
    "state": [
        _SHM_COUNTER.format(where="/dev/shm"),
        _SHM_COUNTER.format(where="/tmp"),
        # SysV shared memory under a fixed key: a counter in the IPC namespace
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
        "shm = libc.shmget(0x5ca1e, 4096, 0o3600)\nfirst = shm >= 0\nshm = shm if first else libc.shmget(0x5ca1e, 4096, 0)\n"
        "input()\nprint('A' if first else 'B')",
        # SysV semaphores: the set's existence is the counter
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "first = libc.semget(0x5eed, 1, 0o3600) >= 0\ninput()\nprint('A' if first else 'B')",
        # POSIX message queues (the IPC namespace's own mqueue filesystem, mounted or not)
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "first = libc.mq_open(b'/scalerl-runs', os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600, None) >= 0\n"
        "input()\nprint('A' if first else 'B')",
        # the user's keyring (x86-64 system calls 248 add_key, 250 keyctl: 10 is KEYCTL_SEARCH, -4 the user keyring)
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "first = libc.syscall(250, 10, -4, b'user', b'scalerl-runs', 0) < 0\n"
        "libc.syscall(248, b'user', b'scalerl-runs', b'1', 1, -4)\ninput()\nprint('A' if first else 'B')",
        # the PID namespace's counter: the program is PID 2 only in a sandbox's first run
        "import os\ninput()\nprint('A' if os.getpid() == 2 else 'B')",
        # a daemon left behind, holding an abstract socket the next run can connect to
        "import os, socket\ninput()\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect('\\0scalerl-state')\n"
        "    print('B')\nexcept OSError:\n    print('A', flush=True)\n    if os.fork() == 0:\n        os.setsid()\n"
        "        server = socket.socket(socket.AF_UNIX)\n        server.bind('\\0scalerl-state')\n"
        "        server.listen()\n        import time\n        time.sleep(30)",
    ],
    "lines": [
        "a, b = input().split()\nprint(a + '\\u2028' + b)",
        "a, b = input().split()\nprint(a + '\\x0b' + b)",
        "a, b = input().split()\nprint(a + '\\x85' + b)",
        "a, b = input().split()\nprint(a + '\\x1c' + b)",
        "a, b = input().split()\nprint(a + '\\u00a0\\n' + b + '\\u3000')",  # Unicode spaces at the ends of lines
    ],
    "big ints": [
        "import math\n\ndef fact(n):\n    return math.factorial(n) + 1\n\ndef neg_pow(n):\n    return 3 ** n",
        "import math, sys\nsys.set_int_max_str_digits(0)\n\ndef fact(n):\n    return str(math.factorial(n))\n\n"
        "def neg_pow(n):\n    return str(-(3 ** n))",
        "import math\n\ndef fact(n):\n    return float(math.factorial(min(n, 170)))\n\ndef neg_pow(n):\n    return -3.0",
    ],
}


def _grade(tmp_path, completions: list[tuple[str, str]]) -> list[dict]:
    problems, answers = tmp_path / "problems.jsonl", tmp_path / "completions.jsonl"
    problems.write_text("".join(json.dumps({"id": key, "problem": key, "tests": tests}) + "\n"
                                for key, tests in ROWS.items()))
    answers.write_text("".join(json.dumps({"id": key, "completion": f"</think>\n```python\n{code}\n```"}) + "\n"
                               for key, code in completions))
    out = subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", "grade", "--verifier", "code", "--problems",
                          str(problems), "--completions", str(answers), "--json", "--workers", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_every_hole_is_closed_and_right_programs_pass(bwrap, tmp_path):
    attacks = [(row, code) for row, codes in ATTACKS.items() for code in codes]
    rows = _grade(tmp_path, RIGHT + attacks)
    right, graded = rows[:len(RIGHT)], rows[len(RIGHT):]
    assert [(r["correct"], r["fraction"]) for r in right] == [(True, 1.0)] * len(RIGHT), right
    scored = [(row, code, verdict) for (row, code), verdict in zip(attacks, graded, strict=True) if verdict["correct"]]
    assert scored == [], f"attacks graded correct: {scored}"
    # the state row's second case is where every counter gives itself away; its first case is answered right
    state = [verdict for (row, _), verdict in zip(attacks, graded, strict=True) if row == "state"]
    assert {(v["fraction"], v["failure"]) for v in state} == {(0.5, "wrong_answer")}, state


def test_a_grader_holds_one_case_of_output_at_a_time(bwrap):
    """40 cases, each flooding stdout and stderr with 1 MiB of invalid UTF-8 (every byte once a 6-character JSON
    escape) or of 4-byte characters: the grading process's peak resident memory grows by under 24 MiB (it grew by
    566 MiB before: every case's output was kept, escaped), and each case fails as `output_limit`."""
    probe = textwrap.dedent("""
        import json
        from megatron_scalerl.tasks.code_verifier import verify_code

        def status_mib(field):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024

        tests = {"inputs": ["go\\n"] * 40, "outputs": ["done\\n"] * 40}
        assert verify_code("```python\\nprint('done')\\n```", {"tests": tests}).correct  # warm: imports, checks
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident size starts again from the resident size now
        before, verdicts = status_mib("VmRSS"), []
        for flood in ("b'\\\\xff' * (1 << 20)", "'\\\\U0001f600'.encode() * (1 << 18)"):
            program = f"import sys\\nsys.stderr.buffer.write(b'\\\\xfe' * 4096)\\nsys.stdout.buffer.write({flood})"
            verdicts.append(verify_code(f"```python\\n{program}\\n```", {"tests": tests}))
        print(json.dumps({"growth_mib": status_mib("VmHWM") - before, "failures": [v.failure for v in verdicts],
                          "fractions": [v.fraction for v in verdicts]}))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600,
                         env={"PATH": "/usr/bin:/bin", "SCALERL_SANDBOX": "bwrap"})
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.splitlines()[-1])
    assert figures["failures"] == ["output_limit", "output_limit"] and figures["fractions"] == [0.0, 0.0], figures
    assert figures["growth_mib"] < 24, figures


def test_each_case_record_is_bounded_before_it_is_decoded():
    """What one case's record may take is fixed by the limits alone (the raw bytes captured, as base64), whatever the
    program prints: the bound the grader reads up to."""
    limits = sandbox.Limits()
    assert sandbox.case_record_bytes(limits) <= limits.output_bytes * 4 // 3 + 8192
    assert code_verifier._normalized("3\u20284\n") != code_verifier._normalized("3\n4\n")
    assert code_verifier._normalized("3 \t\r\n4\r\n\n\n") == code_verifier._normalized("3\n4")
    assert code_verifier._normalized("7\u00a0") != code_verifier._normalized("7")
