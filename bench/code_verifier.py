"""Benchmark: the code verifier's cost per test case, against the floor of starting a bare interpreter per case.

Three ways to run the same tests of one right answer, in this process, one after the other:
  bare      `python -I -S` on the program, one process per stdin/stdout case, no sandbox and no judge: the floor;
  cases     `verify_code` on the stdin/stdout tests (a bwrap sandbox and its judge per case, each running the program);
  asserts   `verify_code` on function asserts (the judge evaluates each assert on the program's values).
Reported: wall milliseconds per case (median over --repeats answers) and each one's ratio to `bare`.

    python bench/code_verifier.py [--cases 8] [--repeats 5] [--sandbox bwrap|rlimits]
Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from megatron_scalerl.platform.precision import cpu_bf16_support
from megatron_scalerl.tasks import code_verifier, sandbox

PROGRAM = "def square(n):\n    return n * n\n\nif __name__ == '__main__':\n    print(square(int(input())))"


def _bare(inputs: list[str]) -> None:
    for stdin in inputs:
        subprocess.run([sandbox.interpreter(), "-I", "-S", "-c", PROGRAM], input=stdin, capture_output=True,
                       text=True, check=True, timeout=30)


def _verify(tests: dict) -> None:
    verdict = code_verifier.verify_code(f"```python\n{PROGRAM}\n```", {"tests": tests})
    if not verdict.correct:
        raise SystemExit(f"the right answer was graded wrong: {verdict}")


def _per_case_ms(run, cases: int, repeats: int) -> float:
    run()  # warm: the sandbox's one-time checks
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000 / cases)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sandbox", choices=sandbox.SANDBOXES, default="bwrap")
    args = parser.parse_args()
    os.environ["SCALERL_SANDBOX"] = args.sandbox
    inputs = [f"{n}\n" for n in range(args.cases)]
    io_tests = {"inputs": inputs, "outputs": [f"{n * n}\n" for n in range(args.cases)]}
    assert_tests = {"asserts": [f"assert square({n}) == {n * n}" for n in range(args.cases)]}
    bare = _per_case_ms(lambda: _bare(inputs), args.cases, args.repeats)
    cases = _per_case_ms(lambda: _verify(io_tests), args.cases, args.repeats)
    asserts = _per_case_ms(lambda: _verify(assert_tests), args.cases, args.repeats)
    print(f"{'way':<8} {'ms/case':>8} {'vs bare':>8}")
    for name, ms in (("bare", bare), ("cases", cases), ("asserts", asserts)):
        print(f"{name:<8} {ms:8.1f} {ms / bare:8.2f}")
    capability, bf16_native = torch.backends.cpu.get_cpu_capability(), cpu_bf16_support()[0]
    print(f"sandbox {sandbox.sandbox_kind(args.sandbox)}; cpu capability {capability}, bf16 native {bf16_native}")
    print(json.dumps({"sandbox": args.sandbox, "cases": args.cases, "cpu_capability": capability,
                      "bf16_native": bf16_native, "bare_ms_per_case": round(bare, 2),
                      "cases_ms_per_case": round(cases, 2), "asserts_ms_per_case": round(asserts, 2),
                      "cases_vs_bare": round(cases / bare, 3), "asserts_vs_bare": round(asserts / bare, 3)}))


if __name__ == "__main__":
    sys.exit(main())
