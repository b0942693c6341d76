"""Running a bench/ script from a test: its last stdout line is the JSON object every bench ends with.

Every benchmark in bench/ runs to its JSON line at a tiny size (tests/test_benches.py, test_benches_vllm.py and
test_benches_runs.py, three files so that the two test workers share them), so that none of them rots between the
stops that measure with them (bench/weight_sync.py once did: its transport's API had changed under it). The figures
at these sizes mean nothing; what is checked is that each bench completes and reports the fields the tables of
docs/benchmarks.md quote, with the invariants that hold at any size."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ["--hidden", "256", "--layers", "2", "--vocab", "512"]


def run_bench(script: str, *args: str, timeout_s: float = 600) -> dict:
    """Run bench/`script` with `args`; its last stdout line, parsed as the JSON object every bench ends with."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.stderr[-4000:]}"
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict)
    return figures


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0
