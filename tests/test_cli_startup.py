"""`scalerl` imports only the command it runs (megatron_scalerl/commands/__init__.py: a static table of every command,
each command's module imported when chosen): `scalerl --help` imports no command module and nothing heavy, and
`scalerl recipe ...` (run on submit hosts and to read recipes) starts without torch, megatron-core, vLLM, scipy or
matplotlib."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_scalerl.commands import COMMANDS, build_parser

HEAVY = ("torch", "megatron.core", "vllm", "transformers", "scipy", "matplotlib")


def _loaded_after(code: str) -> list[str]:
    """Which of HEAVY and of the command modules `code` (run in a fresh interpreter) leaves imported."""
    watched = HEAVY + tuple(module for module, _ in COMMANDS.values())
    probe = f"import sys\n{code}\nprint('loaded:' + ','.join(m for m in {watched!r} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    line = next(line for line in loaded.stdout.splitlines() if line.startswith("loaded:"))
    return [m for m in line.removeprefix("loaded:").split(",") if m]


def test_scalerl_help_lists_every_command_and_imports_none_of_them():
    loaded = _loaded_after("from megatron_scalerl.commands import main\n"
                           "try:\n    main(['--help'])\nexcept SystemExit:\n    pass")
    assert loaded == [], f"`scalerl --help` imported {loaded}"
    help_text = build_parser([]).format_help()
    assert all(name in help_text and help.split()[0] in help_text for name, (_, help) in COMMANDS.items())


def test_a_recipe_command_imports_its_own_module_and_nothing_heavy():
    loaded = _loaded_after("from megatron_scalerl.commands import main\nmain(['recipe', 'validate', 'scalerl'])")
    assert loaded == ["megatron_scalerl.commands.recipe"], f"`scalerl recipe validate` imported {loaded}"


def test_serve_imports_nothing_heavy_on_a_cpu_build_of_torch():
    """`scalerl serve` is the wrapper of every generator (it starts vLLM's API process, then watches it): on a
    machine whose torch is a CPU build it imports no torch (3 s of CPU per server start on 2 AVX2 cores)."""
    code = ("from megatron_scalerl.commands import build_parser\nbuild_parser(['serve'])\n"
            "from megatron_scalerl.inference.vllm_server import VLLMServerConfig, cuda_available\n"
            "VLLMServerConfig(model='m', port=8000).environment({})\nassert cuda_available() is False")
    loaded = _loaded_after(code)
    assert loaded == ["megatron_scalerl.commands.serve"], f"`scalerl serve` imported {loaded}"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_module_registers_its_arguments(name):
    parser = build_parser([name])
    chosen = parser._subparsers._group_actions[0].choices[name]
    assert chosen._actions[1:], f"`scalerl {name}` has no arguments: its module's register() added none"


def test_python_dash_m_the_package_is_the_scalerl_command():
    """`python -m megatron_scalerl ...` starts the `scalerl` command (the console script's `commands.main`): the same
    program, the same flags."""
    def usage(*command: str) -> str:
        return subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=300, check=True).stdout

    scalerl = str(Path(sys.executable).with_name("scalerl"))
    assert usage(sys.executable, "-m", "megatron_scalerl") == usage(scalerl)
