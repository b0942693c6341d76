"""Benchmark: the CPU a process spends ending, with Python's usual exit against `process_exit.exit_with`.

For each set of imports (`--imports`, the ones our processes carry: torch alone; transformers and dynamo, as a trainer
rank and the orchestrator have them; vLLM's server and engine core), two kinds of process, one after the other, each
`--repeats` times, one at a time:
  usual       `python -c "IMPORTS; main returns 0"`, ended as `sys.exit(main())` ends it (the interpreter's teardown);
  exit_with   the same ended by `exit_with(main)` (threads joined, exit callbacks run, no teardown);
plus `imports`: the same imports ended by `os._exit(0)` at once, the floor. Reported: the CPU seconds (user + system)
of each process, median over repeats, each one's time beyond the floor (its exit) and exit_with's CPU as a ratio of
the usual one's.

    python bench/process_exit.py [--imports torch transformers vllm] [--repeats 3]
Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys

import torch

from megatron_scalerl.platform.precision import cpu_bf16_support

IMPORTS = {
    "torch": "import torch",
    "transformers": "import torch, torch._dynamo, transformers",
    "vllm": "import vllm, vllm.v1.engine.core",
}
ENDINGS = {
    "imports": "import os; os._exit(0)",
    "usual": "import sys; sys.exit(main())",
    "exit_with": "from megatron_scalerl.process_exit import exit_with; exit_with(main)",
}


def cpu_seconds(imports: str, ending: str) -> float:
    """User + system CPU seconds of one `python -c` that imports `imports`, defines a `main` and ends by `ending`."""
    code = f"{imports}\ndef main():\n    return 0\n{ending}\n"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                   timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the children waited for: this one alone
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--imports", nargs="+", choices=list(IMPORTS), default=list(IMPORTS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    figures = {}
    print(f"{'imports':<13} {'floor s':>8} {'usual s':>8} {'exit_with s':>11} {'exit: usual':>11} "
          f"{'exit_with':>9} {'cpu ratio':>9}")
    for name in args.imports:
        medians = {ending: statistics.median(cpu_seconds(IMPORTS[name], code) for _ in range(args.repeats))
                   for ending, code in ENDINGS.items()}
        floor = medians["imports"]
        figures[name] = {"floor_cpu_s": round(floor, 3), "usual_cpu_s": round(medians["usual"], 3),
                         "exit_with_cpu_s": round(medians["exit_with"], 3),
                         "usual_exit_s": round(medians["usual"] - floor, 3),
                         "exit_with_exit_s": round(medians["exit_with"] - floor, 3),
                         "exit_with_vs_usual": round(medians["exit_with"] / medians["usual"], 3)}
        row = figures[name]
        print(f"{name:<13} {floor:8.2f} {medians['usual']:8.2f} {medians['exit_with']:11.2f} "
              f"{row['usual_exit_s']:11.2f} {row['exit_with_exit_s']:9.2f} {row['exit_with_vs_usual']:9.2f}")
    capability, bf16_native = torch.backends.cpu.get_cpu_capability(), cpu_bf16_support()[0]
    print(f"cpu capability {capability}, bf16 native {bf16_native}")
    print(json.dumps({"repeats": args.repeats, "cpu_capability": capability, "bf16_native": bf16_native,
                      "imports": figures}))


if __name__ == "__main__":
    sys.exit(main())
