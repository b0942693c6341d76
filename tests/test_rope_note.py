"""Scout-style RoPE scaling (low_freq_factor == high_freq_factor): transformers' warning is said once per run by the
launcher, dropped in the run's processes (ours as they start, vLLM's through its general-plugin entry point), and
left alone everywhere else. The oracle is transformers itself, reading a real config in a fresh process."""

import json
import os
import subprocess
import sys

import pytest

from megatron_scalerl.families import hf_config_dict
from megatron_scalerl.families.llama4.rope_note import MESSAGE_START, SAID_ENV, degenerate, note_once
from megatron_scalerl.recipe import load_recipe

SCOUT_ROPE = "model.rope_scaling={factor: 16.0, low_freq_factor: 1.0, high_freq_factor: 1.0, " \
             "original_max_position_embeddings: 256}"
LOAD = "from transformers import AutoConfig; AutoConfig.from_pretrained({dir!r})"


@pytest.fixture(scope="module")
def scout_style_config(tmp_path_factory):
    """A tiny Llama-4 config.json with Scout's degenerate rope_scaling."""
    recipe = load_recipe("demo", [SCOUT_ROPE])
    assert degenerate(recipe.model.rope_scaling)
    out = tmp_path_factory.mktemp("scout_rope")
    (out / "config.json").write_text(json.dumps(hf_config_dict(recipe.model)))
    return str(out)


def _stderr_of(code: str, said: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != SAID_ENV}
    if said:
        env[SAID_ENV] = "1"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


def test_outside_a_run_transformers_warns_as_usual(scout_style_config):
    code = f"import megatron_scalerl; {LOAD.format(dir=scout_style_config)}"
    assert MESSAGE_START in _stderr_of(code, said=False)


def test_in_a_run_our_processes_drop_only_that_message(scout_style_config):
    """Our processes drop it as they start: the `scalerl` command here (a command run first, as `scalerl serve` or
    `scalerl eval` in a run); the trainer's and the orchestrator's `__main__` call the same `quiet_if_said`."""
    code = "\n".join(["import contextlib, io, logging",
                      "from megatron_scalerl.commands import main",
                      "with contextlib.redirect_stdout(io.StringIO()):",
                      "    assert main(['recipe', 'show', 'demo']) == 0",
                      LOAD.format(dir=scout_style_config),
                      "logging.getLogger('transformers.modeling_rope_utils').warning('another rope warning')"])
    err = _stderr_of(code, said=True)
    assert MESSAGE_START not in err and "another rope warning" in err


@pytest.mark.slow  # an end-to-end run of its own (make test-fast stays under 10 minutes)
def test_in_a_run_vllms_processes_drop_it_through_the_plugin(scout_style_config):
    """What vLLM's API server and engine core call at start (`load_general_plugins`), without importing us."""
    code = f"from vllm.plugins import load_general_plugins; load_general_plugins(); {LOAD.format(dir=scout_style_config)}"
    assert MESSAGE_START not in _stderr_of(code, said=True)
    assert MESSAGE_START in _stderr_of(code, said=False)


def test_the_launcher_says_it_once_and_only_for_degenerate_scaling():
    env: dict[str, str] = {}
    assert note_once(load_recipe("demo").model.rope_scaling, env) is None and env == {}  # the demo's is regular
    scout = load_recipe("scalerl", model_preset="llama4_scout_17b_16e").model.rope_scaling
    first = note_once(scout, env)
    assert first.startswith("note: the model's rope_scaling has high_freq_factor 1.0 = low_freq_factor 1.0")
    assert env == {SAID_ENV: "1"} and note_once(scout, env) is None
