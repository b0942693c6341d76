"""`scalerl recipe ...`: outputs, JSON shape, one-line errors with exit code 2."""

import json
import os
import subprocess
import sys

import pytest

from megatron_scalerl.commands import main


def test_show_json_is_exactly_one_object(capsys):
    assert main(["recipe", "show", "scalerl", "--json", "--set", "trainer.lr=1e-6"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    data = json.loads(out)
    assert data["trainer"]["lr"] == 1e-6 and data["algorithm"]["loss"] == {"type": "cispo", "eps_max": 4.0}


def test_show_yaml_with_model_preset(capsys):
    assert main(["recipe", "show", "scalerl", "--model", "tiny_moe"]) == 0
    out = capsys.readouterr().out
    assert "arch: llama4" in out and "name: scalerl+tiny_moe" in out


def test_diff_scalerl_vs_leave_one_out(capsys):
    assert main(["recipe", "diff", "scalerl", "loo_ppo_off_policy", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["differences"] == [{"path": "rollout.off_policy", "a": "pipeline", "b": "ppo"}]
    assert main(["recipe", "diff", "scalerl", "loo_no_fp32_head"]) == 0
    assert "trainer.fp32_lm_head  True  ->  False" in capsys.readouterr().out


def test_validate_file(tmp_path, capsys):
    good = tmp_path / "r.yaml"
    good.write_text("base: scalerl\nmodel_preset: tiny_dense\n")
    assert main(["recipe", "validate", str(good)]) == 0
    assert capsys.readouterr().out.startswith("ok: r (llama3")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["recipe", "show", "nosuch"], "unknown preset 'nosuch'"),
        (["recipe", "show", "scalerl", "--set", "trainer.lr"], "bad override 'trainer.lr'"),
        (["recipe", "validate", "/nonexistent/r.yaml"], "recipe file not found"),
        (["recipe", "show", "scalerl", "--set", "parallelism.tp=3"], "parallelism.tp: tp=3"),
        (["recipe", "frobnicate"], "invalid choice"),
        (["nosuchcommand"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err


def test_console_script_never_prints_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: scalerl\ntrainer: {lr: fast}\n")
    exe = os.path.join(os.path.dirname(sys.executable), "scalerl")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "megatron_scalerl.commands"]
    proc = subprocess.run(cmd + ["recipe", "validate", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: {bad}: trainer.lr: Input should be a valid number (got 'fast')"


# The scalerl recipe's lengths cut to fit a tiny model's 2048 positions.
FITS_2048 = ["rollout.max_prompt_tokens=256", "rollout.max_new_tokens=512", "parallelism.micro_batch_size=2",
             "algorithm.length_control.think_budget_min=128", "algorithm.length_control.think_budget_max=192",
             "algorithm.length_control.answer_budget=64"]


def test_model_from_an_hf_checkpoint_config(tmp_path, capsys):
    from megatron_scalerl.families import hf_config_dict
    from megatron_scalerl.recipe import load_recipe

    moe = load_recipe("scalerl", model_preset="tiny_moe").model
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(moe)))
    recipe = load_recipe("scalerl", FITS_2048, model_preset=f"hf:{tmp_path}")
    assert recipe.model == moe and recipe.trainer.init_from == str(tmp_path.resolve())
    assert recipe.parallelism.micro_batch_size == 2  # the base's layout and the overrides stay
    assert main(["recipe", "show", "scalerl", "--model", f"hf:{tmp_path / 'missing'}"]) == 2
    err = capsys.readouterr().err
    assert "model_preset" in err and "no config.json" in err


@pytest.mark.parametrize("preset", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_model_from_a_qwen3_checkpoint(preset, tmp_path, capsys):
    """`--model hf:DIR` and a recipe file's `model_preset: hf:DIR` on a Qwen3 / Qwen3-MoE checkpoint directory that
    transformers wrote (its own config.json spelling: rope_parameters, num_local_experts) give the preset's model."""
    from megatron_scalerl.models.hf_io import save_random_hf_model
    from megatron_scalerl.recipe import load_recipe

    model = load_recipe("scalerl", model_preset=preset).model
    hf_dir = save_random_hf_model(model, tmp_path / "hf", seed=0)
    sets = [arg for fit in FITS_2048 for arg in ("--set", fit)]
    assert main(["recipe", "show", "scalerl", "--model", f"hf:{hf_dir}", "--json", *sets]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["model"] == model.model_dump(mode="json")
    assert shown["trainer"]["init_from"] == str(hf_dir.resolve())
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        f"base: scalerl\nmodel_preset: hf:{hf_dir}\nrollout: {{max_prompt_tokens: 256, max_new_tokens: 512}}\n"
        "algorithm: {length_control: {think_budget_min: 128, think_budget_max: 192, answer_budget: 64}}\n"
    )
    assert main(["recipe", "validate", str(recipe_file)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: r ({model.arch}")
    assert load_recipe(str(recipe_file)).model == model
