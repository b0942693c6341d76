"""Every `scalerl` command builds the whole parser (megatron_scalerl/cli.py imports each command module), so the
command modules defer their heavy imports into the command functions: `scalerl --help`, `scalerl recipe show` and
the others start without torch, megatron-core, vLLM, scipy or matplotlib."""

import subprocess
import sys

HEAVY = ("torch", "megatron.core", "vllm", "transformers", "scipy", "matplotlib")


def test_building_the_scalerl_parser_imports_nothing_heavy():
    probe = ("import sys; from megatron_scalerl.cli import build_parser; build_parser(); "
             f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert loaded.stdout.strip() == "", f"building the parser imported {loaded.stdout.strip()}"
