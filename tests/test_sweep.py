"""`scalerl sweep` (megatron_scalerl/sweep/): the plan (variants laid onto a base, grids, seeds), the manifest and its
merges, when a run is done and how a finished one is extended, bad input, the report of runs made any other way; then
a real sweep of the tiny dense model on this machine, interrupted, then resumed and extended (a sweep through
SLURM: tests/test_slurm.py, on its local cluster).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_scalerl.commands import main
from megatron_scalerl.errors import RecipeError, UserError
from megatron_scalerl.recipe import apply_overrides, diff, flatten, load_recipe, preset_names, resolve_dict
from megatron_scalerl.run.directory import STOP_TIMEOUT_S, read_finished, write_finished
from megatron_scalerl.run.metrics_log import read_metrics
from megatron_scalerl.sweep.manifest import load_manifest, merge, ordered_runs, save_manifest
from megatron_scalerl.sweep.plan import BaseSpec, Variant, base_fields, grid_variants, preset_variant, variant_recipe
from megatron_scalerl.sweep.runs import Sweep, SweepRun, covers, not_done, refuse_live_launchers
from tests.launch_utils import SweepProcess

SCALERL = Path(sys.executable).with_name("scalerl")
LOO = [name for name in preset_names() if name.startswith("loo_")]
# The tiny models are untrained (pass rate ~0): every group trains (no zero-variance filter), small batches, a
# validation and a checkpoint at every step; one trainer rank and one generator (2 processes on 2 cores); PipelineRL-1,
# so that the orchestrator is never far ahead and a stop lands with steps still to train.
SETS = ["cluster.trainer_nodes=1", "parallelism.ep=1", "rollout.prompts_per_step=4", "rollout.generations_per_prompt=4",
        "rollout.k=1", "algorithm.zero_variance_filter=false", "data.validation_holdout=8", "data.validation_interval=1",
        "data.validation_generations=2", "trainer.checkpoint_interval=1", "logging.wandb_mode=disabled",
        "forecast.live=false", "forecast.resamples=20"]


def _spec(**fields) -> BaseSpec:
    return BaseSpec("demo", init_from="/models/shared", **fields)


# ------------------------------------------------------------------------------------------------ the plan


@pytest.mark.parametrize("name", LOO)
def test_a_loo_preset_on_demo_changes_only_what_it_names(name):
    """Every loo_* is written against scalerl (the 8B recipe); laid onto demo, it changes exactly the fields where
    it differs from scalerl, wherever demo does not already agree."""
    theirs, own = flatten(resolve_dict("scalerl")), flatten(resolve_dict(name))
    named = {k: v for k, v in own.items() if k != "name" and theirs.get(k) != v}
    demo = flatten(resolve_dict("demo"))
    laid = flatten(apply_overrides(resolve_dict("demo"), list(preset_variant(name).overrides)))
    assert {k: v for k, v in laid.items() if demo.get(k) != v} == {k: v for k, v in named.items() if demo.get(k) != v}
    assert named  # each preset names something
    spec = _spec()
    base = variant_recipe(spec, Variant("base", "base"), 0, "b")
    try:
        recipe = variant_recipe(spec, preset_variant(name), 0, "v")
    except RecipeError as exc:  # a field demo's sizes reject: said, naming the variant and the field
        assert name == "loo_length_penalty" and "variant loo_length_penalty on base demo" in str(exc), exc
        assert "algorithm.length_control.penalty_max_len" in str(exc)
        return
    # against the loaded base: a loss section holds its own alternative's fields (dapo's clip_low, not cispo's)
    loaded = flatten(base.to_dict())
    expected = {(k, a, b) for k, a, b in diff(load_recipe("scalerl"), load_recipe(name)) if loaded.get(k) != b}
    assert set(diff(base, recipe)) == expected
    assert recipe.model == base.model and recipe.trainer.init_from == "/models/shared"


def test_grid_gives_one_variant_per_point_and_checks_its_keys():
    base = resolve_dict("demo")
    grid = grid_variants(["trainer.lr=1e-6,5e-7", "rollout.k=2,4"], base)
    assert [v.name for v in grid] == ["lr-1e-6_k-2", "lr-1e-6_k-4", "lr-5e-7_k-2", "lr-5e-7_k-4"]
    recipe = variant_recipe(_spec(), grid[1], 0, "x")
    assert (recipe.trainer.lr, recipe.rollout.k) == (1e-6, 4)
    with pytest.raises(UserError, match=r"--grid lr: not a field of the base recipe \(did you mean trainer.lr\?\)"):
        grid_variants(["lr=1e-6"], base)
    with pytest.raises(UserError, match="a key given twice"):
        grid_variants(["rollout.k=2", "rollout.k=4"], base)


def test_seeds_steps_and_budget_reach_each_runs_recipe():
    spec = _spec(steps=7, budget=2.5)
    runs = [variant_recipe(spec, preset_variant("loo_dapo_loss"), i, f"r{i}") for i in range(2)]
    base_seed = load_recipe("demo").trainer.seed
    assert [r.trainer.seed for r in runs] == [base_seed, base_seed + 1]
    assert all(r.trainer.max_steps == 7 and r.trainer.max_gpu_hours == 2.5 and r.algorithm.loss.type == "dapo"
               for r in runs)
    assert variant_recipe(_spec(), Variant("base", "base"), 0, "b").trainer.max_steps == \
        load_recipe("demo").trainer.max_steps


def test_every_run_validates_on_the_base_seeds_prompts_and_draws_its_own_order():
    """data.seed pins the problems and the validation split to the base's seed (the prompts the demo's warm start held
    out) for every variant and seed; trainer.seed, base + i, still orders each run's training prompts its own way."""
    from megatron_scalerl.algo.resampling import NoPositiveResampling
    from megatron_scalerl.tasks.problems import load_sources
    from megatron_scalerl.tasks.prompts import PromptSampler, split_validation

    base_seed = load_recipe("demo").trainer.seed
    runs = [variant_recipe(_spec(), v, i, f"r{i}") for v in (Variant("base", "base"), preset_variant("loo_dapo_loss"))
            for i in range(2)]
    assert [r.data.seed for r in runs] == [base_seed] * 4 and [r.trainer.seed for r in runs][:2] == [base_seed,
                                                                                                     base_seed + 1]
    splits = [split_validation(load_sources(r.data.train, seed=r.data_seed), r.data.validation_holdout,
                               seed=r.data_seed) for r in runs]
    held_out = {tuple(p.key for p in validation) for _, validation in splits}
    assert len(held_out) == 1 and len(next(iter(held_out))) == runs[0].data.validation_holdout
    demo = load_recipe("demo")  # the warm start's own split: demo's recipe, data.seed unset, trainer.seed the base's
    assert demo.data.seed is None and demo.data_seed == base_seed
    samplers = [PromptSampler(train, seed=r.trainer.seed, resampling=NoPositiveResampling.from_config(
        r.algorithm.no_positive_resampling)) for r, (train, _) in zip(runs[:2], splits[:2], strict=True)]
    first, second = ([sampler.next().key for _ in range(5)] for sampler in samplers)
    assert first != second  # seeds 0 and 1 draw the same prompts in other orders
    own = variant_recipe(_spec(), Variant("d", "grid", ("data.seed=7",)), 1, "d")
    assert own.data_seed == 7  # a variant that sets the data seed keeps it


def test_the_manifest_merges_extensions_and_refuses_what_would_change_the_sweep(tmp_path):
    dapo = preset_variant("loo_dapo_loss")
    first = merge(tmp_path, None, base="demo", model=None, sets=["rollout.k=2"], tokenizer=None, steps=10, budget=None,
                  seeds=1, variants=[dapo])
    assert ordered_runs(first) == ["base/seed0", "loo_dapo_loss/seed0"]
    first["runs"]["base/seed0"]["state"] = "done"
    save_manifest(tmp_path, first)
    old = load_manifest(tmp_path)
    grown = merge(tmp_path, old, base=None, model=None, sets=[], tokenizer=None, steps=20, budget=None, seeds=2,
                  variants=[preset_variant("loo_ppo_off_policy")])
    assert ordered_runs(grown) == ["base/seed0", "loo_dapo_loss/seed0", "loo_ppo_off_policy/seed0", "base/seed1",
                                   "loo_dapo_loss/seed1", "loo_ppo_off_policy/seed1"]  # seed 0 of every variant first
    assert grown["runs"]["base/seed0"]["state"] == "done" and grown["steps"] == 20 and grown["set"] == ["rollout.k=2"]
    assert merge(tmp_path, old, base="demo", model=None, sets=[], tokenizer=None, steps=None, budget=None,
                 seeds=None, variants=[dapo]) == old  # the same sweep again: nothing changes
    for kwargs, message in [
        ({"base": "scalerl"}, r"sweep.json: field 'base' is \"demo\", and --base \"scalerl\" differs"),
        ({"sets": ["rollout.k=4"]}, r"field 'set' is \[\"rollout.k=2\"\], and --set \[\"rollout.k=4\"\] differs"),
        ({"steps": 5}, "field 'steps' is 10; --steps 5 would shrink it"),
        ({"slurm": True}, "field 'slurm' is false: this sweep runs its runs on this machine"),
        ({"variants": [replace(dapo, overrides=("algorithm.loss=\"gspo\"",))]},
         "field 'variants.loo_dapo_loss.overrides' is"),
    ]:
        request = {"base": None, "model": None, "sets": [], "tokenizer": None, "steps": None, "budget": None,
                   "seeds": None, "variants": [], **kwargs}
        with pytest.raises(UserError, match=message):
            merge(tmp_path, old, **request)


def _started_run(sweep_dir: Path, key: str, steps: int, finished: int | None) -> SweepRun:
    """A run directory as a launch leaves it (recipe.yaml, generators.json) that ended at `finished` steps."""
    recipe = variant_recipe(_spec(steps=steps), Variant("base", "base"), 0, "x")
    run = SweepRun(key, sweep_dir / key, recipe)
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "recipe.yaml").write_text(recipe.to_yaml())
    (run.run_dir / "generators.json").write_text("{}")
    if finished is not None:
        write_finished(run.run_dir, "max_steps", finished, 0.5)
    return run


def test_a_finished_run_is_done_until_the_sweep_asks_for_more_then_its_recipe_is_extended(tmp_path):
    manifest = merge(tmp_path, None, base="demo", model=None, sets=[], tokenizer=None, steps=3, budget=None, seeds=1,
                     variants=[preset_variant("loo_dapo_loss")])
    runs = {"base/seed0": _started_run(tmp_path, "base/seed0", 3, finished=3),
            "loo_dapo_loss/seed0": _started_run(tmp_path, "loo_dapo_loss/seed0", 3, finished=None)}
    sweep = Sweep(tmp_path, manifest, runs)
    assert sweep.done("base/seed0") and not sweep.done("loo_dapo_loss/seed0")
    assert load_manifest(tmp_path)["runs"]["base/seed0"]["finished"] == {"reason": "max_steps", "step": 3,
                                                                          "gpu_hours": 0.5}
    manifest["steps"] = 5  # extended
    assert not sweep.done("base/seed0")
    assert sweep.prepare("base/seed0") == "resume"  # continues with --resume ...
    assert load_recipe(tmp_path / "base/seed0/recipe.yaml").trainer.max_steps == 5  # ... to the new end
    write_finished(tmp_path / "base/seed0", "max_gpu_hours", 4, 0.5)  # a run that ended at its compute budget
    manifest["budget"] = 0.5
    assert sweep.done("base/seed0")
    manifest["budget"] = 0.75  # a larger budget: not done any more
    assert not sweep.done("base/seed0")
    # a first start cut short while `scalerl train` prepared the directory (no role ran): started anew
    (tmp_path / "loo_dapo_loss/seed0/generators.json").unlink()
    assert sweep.prepare("loo_dapo_loss/seed0") == "start" and not (tmp_path / "loo_dapo_loss/seed0").exists()
    assert load_recipe(tmp_path / "loo_dapo_loss/seed0.recipe.yaml").trainer.max_steps == 3


def test_a_slurm_run_is_submitted_with_the_sbatch_file_of_its_model_and_sizes_from_its_recipe(tmp_path, monkeypatch):
    from megatron_scalerl.sweep.slurm import CHECKOUT, SbatchFiles, job_name, sbatch_command

    for variable in ("SBATCH_PARTITION", "SBATCH_ACCOUNT", "SBATCH_TIMELIMIT"):
        monkeypatch.delenv(variable, raising=False)

    manifest = merge(tmp_path, None, base="demo", model=None, sets=[], tokenizer=None, steps=None, budget=None,
                     seeds=1, variants=[], slurm=True)
    recipes = {"base/seed0": load_recipe("demo", ["cluster.partition=gpu"]),
               "base/seed1": load_recipe("demo", model_preset="tiny_dense")}
    sweep = Sweep(tmp_path, manifest, {k: SweepRun(k, tmp_path / k, r) for k, r in recipes.items()})
    files = SbatchFiles()
    moe, dense = (sbatch_command(sweep, sweep.runs[k], files) for k in recipes)
    assert moe[-1] == str(CHECKOUT / "slurm" / "scalerl_moe.sbatch")
    assert dense[-1] == str(CHECKOUT / "slurm" / "scalerl_dense.sbatch")
    # the recipe's partition and time limit in each het component (sbatch does not carry them all over)
    assert moe[moe.index(":") - 4:moe.index(":") + 5] == [
        "--partition=gpu", "--time=00:30:00", "--nodes=2", "--gpus-per-node=1", ":", "--partition=gpu",
        "--time=00:30:00", "--nodes=1", "--gpus-per-node=1"]
    monkeypatch.setenv("SBATCH_TIMELIMIT", "2:00:00")  # the submitter's own choice wins
    assert not any(option.startswith("--time") for option in sbatch_command(sweep, sweep.runs["base/seed0"], files))
    assert f"--job-name={job_name(tmp_path, 'base/seed0')}" in moe and job_name(tmp_path, "base/seed0") != \
        job_name(tmp_path / "other", "base/seed0")
    exports = dict(item.split("=", 1) for item in moe[-2].removeprefix("--export=").split(",")[1:])
    assert exports["SCALERL_RUN_DIR"] == str(tmp_path / "base/seed0")
    assert exports["SCALERL_RECIPE"] == str(tmp_path / "base/seed0.recipe.yaml")
    assert exports["SCALERL_MODEL"] == exports["SCALERL_SET"] == ""  # the sbatch files' own defaults do not apply


def test_a_sweep_reads_each_sbatch_file_once(tmp_path, monkeypatch):
    """The `#SBATCH` lines of an sbatch file are read at the sweep's first run of its model, not again per run: a
    line added later reaches the next sweep only."""
    import shutil

    from megatron_scalerl.sweep import slurm

    monkeypatch.delenv("SBATCH_TIMELIMIT", raising=False)
    (tmp_path / "slurm").mkdir()
    script = tmp_path / "slurm" / "scalerl_moe.sbatch"
    shutil.copy(slurm.CHECKOUT / "slurm" / script.name, script)
    monkeypatch.setattr(slurm, "CHECKOUT", tmp_path)
    manifest = merge(tmp_path, None, **_request(base="demo", seeds=2), slurm=True)
    sweep = Sweep(tmp_path, manifest, {k: SweepRun(k, tmp_path / k, load_recipe("demo")) for k in ordered_runs(
        manifest)})
    files = slurm.SbatchFiles()
    first = slurm.sbatch_command(sweep, sweep.runs["base/seed0"], files)
    lines = script.read_text().splitlines()
    script.write_text("\n".join([lines[0], "#SBATCH --time=2:00:00", *lines[1:]]) + "\n")
    second = slurm.sbatch_command(sweep, sweep.runs["base/seed1"], files)
    assert "--time=00:30:00" in first and "--time=00:30:00" in second  # the file as the sweep first read it
    assert "--time=00:30:00" not in slurm.sbatch_command(sweep, sweep.runs["base/seed1"], slurm.SbatchFiles())


def test_progress_lines_count_the_runs_and_estimate_the_time_left():
    """One line per start and end: the run's place, how long it took, how many are done, and the time left from the
    mean of the runs finished so far, over the runs that go at once (2 here)."""
    from megatron_scalerl.sweep.progress import SweepProgress

    entries = {key: {"state": "planned"} for key in ("a/seed0", "a/seed1", "b/seed0", "b/seed1")}
    entries["b/seed1"]["state"] = "done"  # done before this sweep began
    now = [0.0]
    progress = SweepProgress(list(entries), entries, 2, clock=lambda: now[0])
    assert progress.start("a/seed0") == "sweep: run 1/4 a/seed0 started"
    now[0] = 10.0
    progress.start("a/seed1")
    now[0], entries["a/seed0"]["state"] = 252.0, "done"
    # left: a/seed1 has 252 - 242 s to go, b/seed0 252 s; two at once: 131 s
    assert progress.end("a/seed0", "exit 0") == \
        "sweep: run 1/4 a/seed0 finished in 4m12s (exit 0); 2 of 4 done, ~2m11s left"
    now[0], entries["a/seed1"]["state"] = 300.0, "failed"
    assert progress.end("a/seed1", "exit 1") == \
        "sweep: run 2/4 a/seed1 failed after 4m50s (exit 1); 2 of 4 done, 1 failed, ~4m12s left"
    progress.start("b/seed0")
    now[0], entries["b/seed0"]["state"] = 400.0, "done"
    assert progress.end("b/seed0", "job 7") == "sweep: run 3/4 b/seed0 finished in 1m40s (job 7); 3 of 4 done, 1 failed"


def test_parallel_runs_must_fit_the_cores_or_the_gpus(monkeypatch):
    from megatron_scalerl.sweep import local

    runs = [SweepRun("base/seed0", Path("r"), load_recipe("demo"))]  # 2 trainer ranks + 1 generator
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    local.check_room(runs, 1, cuda=False)  # one run at a time: as `scalerl train` would
    with pytest.raises(UserError, match=r"--parallel 2: 2 runs x 3 processes .* need 6 CPU cores .* gives 4"):
        local.check_room(runs, 2, cuda=False)
    monkeypatch.setattr(local, "visible_gpu_count", lambda: 6)
    local.check_room(runs, 2, cuda=True)
    with pytest.raises(UserError, match="need 9 visible GPUs"):
        local.check_room(runs, 3, cuda=True)
    # each run gets consecutive free GPUs, named as CUDA_VISIBLE_DEVICES names them (launch.local.cuda_devices)
    assert local._free_block({0, 1, 3, 4, 5}, 3, 6) == range(3, 6) and local._free_block({0, 2}, 2, 3) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,8,9")
    assert local.cuda_devices(range(3, 6)) == "7,8,9"
    # a generator server over 2 GPUs: 4 GPUs, but 3 busy processes (their CPU threads) and 3 roles to stop
    wide = SweepRun("v/seed0", Path("v"), load_recipe("demo", ["parallelism.generator_tp=2", "cluster.generator_nodes=2"]))
    assert (wide.gpus, wide.servers, wide.processes) == (4, 1, 3)
    assert local.stop_wait_s(wide) == local.stop_wait_s(runs[0]) == 3 * STOP_TIMEOUT_S + 60


@pytest.mark.parametrize("argv, message", [
    (["sweep"], "give --sweep-dir DIR"),
    (["sweep", "--sweep-dir", "{tmp}/s"], "holds no sweep yet (sweep.json): give --base"),
    (["sweep", "--sweep-dir", "{tmp}/s", "--base", "demo", "--variants", "no_such"], "unknown preset 'no_such'"),
    (["sweep", "--sweep-dir", "{tmp}/s", "--base", "demo", "--grid", "trainer.nope=1"],
     "--grid trainer.nope: not a field of the base recipe"),
    (["sweep", "--sweep-dir", "{tmp}/s", "--base", "demo", "--set", "trainer.init_from=/m"],
     "a sweep compares variants with its base: give --variants or --grid"),
    (["sweep", "--sweep-dir", "{tmp}/s", "--base", "scalerl", "--variants", "loo_dapo_loss"],
     "a sweep needs trainer.init_from (--set trainer.init_from=DIR) or --model hf:DIR"),
    (["sweep", "--sweep-dir", "{tmp}/s", "--base", "demo", "--variants", "loo_dapo_loss", "--slurm",
      "--parallel", "2"], "--parallel is for local runs"),
    (["sweep", "--sweep-dir", "{tmp}/s", "--base", "demo", "--variants", "loo_dapo_loss", "--steps", "0"],
     "--steps must be >= 1"),
    (["sweep", "--sweep-dir", "{tmp}/s", "--base", "demo", "--variants", "loo_dapo_loss", "--slurm", "--poll", "0"],
     "--poll must be > 0 seconds, got 0"),
    (["sweep", "--sweep-dir", "{tmp}/s", "--base", "demo", "--model", "tiny_dense", "--variants", "loo_dapo_loss"],
     "base demo: its model section differs from the demo preset's (model.arch"),
    (["sweep", "--sweep-dir", "{tmp}/old", "--base", "scalerl"], "field 'base' is \"demo\", and --base \"scalerl\""),
    (["sweep", "report"], "give a sweep directory, or --runs"),
    (["sweep", "report", "{tmp}"], "no sweep.json (not a sweep directory)"),
    (["sweep", "report", "{tmp}", "--power-trials", "0"], "--power-trials must be >= 1, got 0"),
])
def test_bad_input_is_refused_in_one_line(tmp_path, capsys, argv, message):
    save_manifest(tmp_path / "old", merge(tmp_path / "old", None, base="demo", model=None, sets=[], tokenizer=None,
                                          steps=None, budget=None, seeds=1, variants=[]))
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_report_of_runs_made_any_other_way_is_one_json_object(tmp_path, capsys):
    """`scalerl sweep report --runs BASE RUN ...` on run directories holding metrics.jsonl (synthetic curves of the
    paper's 8B run); a run too short to fit is left out and said, not fatal."""
    from megatron_scalerl.forecast.synthetic import PaperRun, simulate_run

    base = PaperRun("base", C_mid=2542, B=1.92, A=0.610, budget=16000)
    for name, run, seed, evaluations in (("a", base, 1, 41), ("b", replace(base, A=0.66), 2, 41), ("c", base, 3, 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(simulate_run(run, seed, num_evals=evaluations).curve.to_jsonl())
    runs = [str(tmp_path / n) for n in "abc"]
    assert main(["sweep", "report", "--runs", *runs, "--json", "--out", str(tmp_path / "out"),
                 "--power-design", "2x512"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)  # exactly one object: anything else on stdout would break this
    assert [(v["name"], v["verdict"]) for v in data["variants"]] == [("b", "ceiling")]
    # the power of this study and of one of 2 seeds per recipe: shares of simulated studies, over every verdict
    [variant] = data["variants"]
    assert data["options"]["power_designs"] == ["2x512"] and set(variant["power_designs"]) == {"2x512"}
    assert all(sum(p.values()) == pytest.approx(1) for p in (variant["power"], variant["power_designs"]["2x512"]))
    assert data["base"]["name"] == "a" and [e["variant"] for e in data["left_out"]] == ["c"]
    assert "c: left out" in err and "the fit needs at least 5" in err
    # beside the verdicts, each run's backtest: what `scalerl forecast backtest RUN --fit-until HALF` says of it
    assert [b["variant"] for b in data["backtests"]] == ["a", "b"]
    for backtest, run in zip(data["backtests"], runs, strict=False):
        assert main(["forecast", "backtest", run, "--fit-until", str(backtest["fit_until"]), "--json"]) == 0
        alone = json.loads(capsys.readouterr().out)["summary"]
        assert backtest == {"variant": backtest["variant"], "run": run, **alone}
        assert backtest["fit_until"] == 8000 and backtest["mean_abs_error"] < 0.02  # known curves, well forecast
    assert "## Forecast backtests" in (tmp_path / "out" / "report.md").read_text()
    assert main(["sweep", "report", "--runs", runs[0], runs[2]]) == 2  # nothing left to compare: said in one line
    assert "no ablation report: no run of any variant can be fitted" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ablation.json", "ablation.png", "report.html",
                                                                     "report.md"]


def _request(**kwargs) -> dict:
    """`merge`'s keyword arguments of an invocation that names nothing but `kwargs`."""
    return {"base": None, "model": None, "sets": [], "tokenizer": None, "steps": None, "budget": None, "seeds": None,
            "variants": [], **kwargs}


def test_done_is_one_definition_its_end_covers_the_sweep_and_its_last_launch_did_not_fail(tmp_path):
    at_steps = {"reason": "max_steps", "step": 3, "gpu_hours": 0.5}
    assert covers(at_steps, None, None) and covers(at_steps, 3, None) and not covers(at_steps, 4, None)
    assert covers(at_steps, 3, 9.0)  # trainer.max_steps is the cap: a larger budget changes nothing
    at_budget = {"reason": "max_gpu_hours", "step": 2, "gpu_hours": 0.5}
    assert covers(at_budget, 10, 0.5) and not covers(at_budget, None, 0.75)
    assert covers({"reason": "stop_at_fraction", "step": 1, "gpu_hours": 0.1}, 10, 9.0)  # final
    assert not_done({"exit_code": None}, None, 3, None) == "not finished"
    assert not_done({"exit_code": None}, at_steps, 4, None) == "not extended yet"
    assert not_done({"exit_code": 0}, at_steps, 3, None) is None
    # the orchestrator writes finished.json before the trainer has stopped: a launch that then failed is resumed
    manifest = merge(tmp_path, None, **_request(base="demo", steps=3, seeds=1))
    sweep = Sweep(tmp_path, manifest, {"base/seed0": _started_run(tmp_path, "base/seed0", 3, finished=3)})
    sweep.update("base/seed0", state="failed", exit_code=1)
    assert not_done(manifest["runs"]["base/seed0"], at_steps, 3, None).startswith("its last launch failed (exit 1)")
    assert not sweep.done("base/seed0") and sweep.prepare("base/seed0") == "resume"
    sweep.update("base/seed0", exit_code=0)
    assert sweep.done("base/seed0") and sweep.prepare("base/seed0") is None  # done: nothing to start


def test_a_sweep_never_shortens_its_runs_even_when_it_recorded_no_steps_or_budget(tmp_path):
    save_manifest(tmp_path, merge(tmp_path, None, **_request(base="demo", seeds=1), recipe_steps=150))
    old = load_manifest(tmp_path)
    with pytest.raises(UserError, match=r"field 'steps' is null \(the runs take the base recipe's trainer.max_steps, "
                                        r"150\); --steps 100 would shrink it"):
        merge(tmp_path, old, **_request(steps=100), recipe_steps=150)
    assert merge(tmp_path, old, **_request(steps=200), recipe_steps=150)["steps"] == 200
    assert merge(tmp_path, old, **_request(budget=1.0))["budget"] == 1.0  # no run has finished: a budget may come
    _started_run(tmp_path, "base/seed0", 150, finished=150)
    with pytest.raises(UserError, match=r"sweep.json: field 'budget' is null and 1 run\(s\) already finished without "
                                        r"one \(base/seed0\)"):
        merge(tmp_path, old, **_request(budget=1.0))


@pytest.mark.parametrize("damage, message", [
    (lambda m: m["runs"]["base/seed0"].update(state="bogus"), "field 'runs.base/seed0.state' is \"bogus\": expected"),
    (lambda m: m["runs"]["base/seed0"].update(run_dir="../elsewhere"), "field 'runs.base/seed0.run_dir' is"),
    (lambda m: m["runs"]["base/seed0"].pop("variant"), "field 'runs.base/seed0.variant' is missing"),
    (lambda m: m["runs"]["base/seed0"].update(seed_index="0"), "field 'runs.base/seed0.seed_index' is \"0\": expected int"),
    (lambda m: m["runs"]["base/seed0"].update(variant="gone"), "field 'runs.base/seed0.variant' is \"gone\": not one"),
    (lambda m: m["runs"].update({"base/seed0": []}), "field 'runs.base/seed0' must be an object"),
    (lambda m: m["variants"]["base"].update(overrides="x"), "field 'variants.base.overrides' is \"x\": expected list"),
    (lambda m: m.update(seeds=0), "field 'seeds' is 0: expected an integer >= 1"),
])
def test_a_damaged_manifest_is_refused_naming_the_field(tmp_path, damage, message):
    manifest = merge(tmp_path, None, **_request(base="demo", seeds=1))
    damage(manifest)
    save_manifest(tmp_path, manifest)
    with pytest.raises(UserError, match="sweep.json: " + message.replace("(", r"\(")):
        load_manifest(tmp_path)


@pytest.mark.parametrize("damage, message", [
    (lambda text: text.replace("max_steps: 2\n", "max_steps: many\n"), "trainer.max_steps: Input should be"),
    (lambda text: text + "trainer: {max_steps: [\n", "invalid YAML"),
])
def test_a_damaged_run_recipe_is_an_error_naming_the_file(tmp_path, damage, message):
    manifest = merge(tmp_path, None, **_request(base="demo", steps=3, seeds=1))
    sweep = Sweep(tmp_path, manifest, {"base/seed0": _started_run(tmp_path, "base/seed0", 2, finished=None)})
    recipe = tmp_path / "base/seed0/recipe.yaml"
    recipe.write_text(damage(recipe.read_text()))
    with pytest.raises(UserError, match=f"{tmp_path / 'base/seed0/recipe.yaml'}: .*{message}"):
        sweep.prepare("base/seed0")


@pytest.mark.parametrize("change, message", [
    ("weights", "the initial weights in"),
    ("recipe", "the base recipe changed since the sweep began (field 'base_recipe'; trainer.lr: 1.0 -> 0.0001)"),
])
def test_new_runs_wait_while_the_weights_or_the_base_recipe_changed_and_an_extension_is_not_saved(
        tmp_path, capsys, change, message):
    weights, sweep_dir = tmp_path / "weights", tmp_path / "sweep"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"1")
    sets = [f"trainer.init_from={weights}"]
    manifest = merge(sweep_dir, None, **_request(base="demo", sets=sets, seeds=1,
                                                 variants=[preset_variant("loo_dapo_loss")]),
                     base_recipe=base_fields(resolve_dict("demo", sets)))
    from megatron_scalerl.sweep.weights import fingerprint

    manifest["init_from"], manifest["init_fingerprint"] = str(weights), fingerprint(weights)
    if change == "weights":
        (weights / "model.safetensors").write_bytes(b"22")  # rebuilt since the sweep began
    else:
        manifest["base_recipe"]["trainer.lr"] = 1.0  # the sweep began with another base recipe
    save_manifest(sweep_dir, manifest)
    before = (sweep_dir / "sweep.json").read_bytes()
    assert main(["sweep", "--sweep-dir", str(sweep_dir), "--seeds", "2"]) == 2  # an extension: refused
    assert message in capsys.readouterr().err and (sweep_dir / "sweep.json").read_bytes() == before
    # without one, the runs planned before (never started) wait; started ones would go on; the sweep says so, exits 1
    assert main(["sweep", "--sweep-dir", str(sweep_dir)]) == 1
    out, err = capsys.readouterr()
    assert "2 runs, 0 done, 0 to continue, 0 to start, 2 held back" in out
    assert "2 run(s) were not started" in err and message in err


def test_a_stopped_local_run_leaves_none_of_its_processes_behind(tmp_path, monkeypatch, capsys):
    """A launcher that ignores SIGTERM and whose role runs in a session of its own: after the stop's wait the sweep
    kills the launcher's group and every process carrying the run's marker (a later sweep would have refused it)."""
    from megatron_scalerl.sweep import local

    launcher = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
                "print('role started', flush=True); time.sleep(600)")
    monkeypatch.setattr(local, "_command", lambda run, resume, tokenizer: [sys.executable, "-c", launcher])
    monkeypatch.setattr(local, "stop_wait_s", lambda run: 1.0)
    manifest = merge(tmp_path, None, **_request(base="demo", seeds=1))
    run = SweepRun("base/seed0", tmp_path / "base" / "seed0", load_recipe("demo"))
    sweep = Sweep(tmp_path, manifest, {run.key: run})
    refused: list[str] = []

    def stop_once_started() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (run.console.is_file() and "role started" in run.console.read_text()):
            time.sleep(0.1)
        time.sleep(0.5)  # the role has its environment
        try:
            refuse_live_launchers(sweep)
        except UserError as exc:
            refused.append(str(exc))
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=stop_once_started, daemon=True).start()
    try:
        assert local.run_local(sweep, [run.key], 1, cuda=False) == 128 + signal.SIGINT
    finally:
        left = run.live_processes()
        for pid, _ in left:
            os.kill(pid, signal.SIGKILL)
    out = capsys.readouterr().out
    assert left == [] and "left behind by its launcher" in out and "sweep: run 1/1 base/seed0 started\n" in out
    assert refused and f"run base/seed0 still has 2 process(es) on this machine (SCALERL_SWEEP_RUN={run.marker}" in \
        refused[0]
    assert manifest["runs"][run.key]["state"] == "stopped"
    other = SweepRun("base/seed01", tmp_path / "base" / "seed01", run.recipe)  # never taken for seed0's
    assert not other.marker.startswith(run.marker) and not run.marker.startswith(other.marker)


class _FakeSlurm:
    """`squeue` and `sbatch` as `sweep.slurm._slurm` runs them: a queue of {job name: (job id, state)}; `events`
    change it at given squeue calls (1: the first), or make that call fail (raise)."""

    def __init__(self, queue: dict, events: dict):
        self.queue, self.events, self.polls, self.submitted = dict(queue), events, 0, []

    def __call__(self, *command: str) -> str:
        if command[0] == "sbatch":
            name = next(a for a in command if a.startswith("--job-name=")).split("=", 1)[1]
            self.submitted.append(name)
            self.queue[name] = (100 + len(self.submitted), "PENDING")
            return f"{self.queue[name][0]}\n"
        self.polls += 1
        if self.polls in self.events:
            self.events[self.polls](self)
        names = command[-1].removeprefix("--name=").split(",")
        return "".join(f"{job}|{name}|{state}\n" for name, (job, state) in self.queue.items() if name in names)


def _failed_squeue(fake: _FakeSlurm) -> None:
    raise UserError("squeue -h ... failed (exit 1): slurm_load_jobs error: Socket timed out")


def test_a_slurm_sweep_follows_every_job_it_left_and_never_submits_a_done_run(tmp_path, monkeypatch, capsys):
    from megatron_scalerl.sweep import slurm

    manifest = merge(tmp_path, None, **_request(base="demo", steps=3, seeds=2, variants=[preset_variant(
        "loo_dapo_loss")]), slurm=True)
    keys = ordered_runs(manifest)  # base/seed0, loo_dapo_loss/seed0, base/seed1, loo_dapo_loss/seed1
    sweep = Sweep(tmp_path, manifest, {k: SweepRun(k, tmp_path / k, load_recipe("demo")) for k in keys})
    name = {k: slurm.job_name(tmp_path, k) for k in keys}

    def end(*runs: str):
        def event(fake: _FakeSlurm) -> None:
            for key in runs:
                fake.queue.pop(name[key], None)
                _started_run(tmp_path, key, 3, finished=3)
        return event

    # left by an earlier watcher: base/seed0 (running) and loo_dapo_loss/seed1 (queued, last in order); with
    # --max-concurrent 2 nothing is submitted until one ends; squeue fails twice in a row (tolerated); base/seed1
    # finishes some other way meanwhile (it is then not submitted)
    def runs(fake: _FakeSlurm) -> None:
        fake.queue[name["loo_dapo_loss/seed1"]] = (7, "RUNNING")

    fake = _FakeSlurm({name["base/seed0"]: (5, "RUNNING"), name["loo_dapo_loss/seed1"]: (7, "PENDING")},
                      {2: _failed_squeue, 3: _failed_squeue, 4: end("base/seed0"), 5: runs, 6: end("base/seed1"),
                       7: end("loo_dapo_loss/seed0", "loo_dapo_loss/seed1")})
    monkeypatch.setattr(slurm, "_slurm", fake)
    assert slurm.run_slurm(sweep, keys, 2, 0.001) == 0
    out, err = capsys.readouterr()
    assert fake.submitted == [name["loo_dapo_loss/seed0"]], out
    assert "base/seed0: following job 5 (running)" in out and "loo_dapo_loss/seed1: following job 7 (queued)" in out
    assert out.index("base/seed0: done") < out.index("loo_dapo_loss/seed0: submitted as job 101")
    assert "base/seed1: done" in out and "not submitted" in out
    # the sweep's progress: a job followed while running has no start of its own; one seen starting has
    assert "sweep: run 1/4 base/seed0 finished (job 5); 1 of 4 done\n" in out
    assert out.index("sweep: run 4/4 loo_dapo_loss/seed1 started\n") < out.index(
        "sweep: run 4/4 loo_dapo_loss/seed1 finished in ")
    assert err.count("trying again in 0.001 s") == 2 and "(2 of 3 in a row)" in err
    assert {manifest["runs"][k]["state"] for k in keys} == {"done"}
    # three failed polls in a row end the watching (the jobs go on)
    monkeypatch.setattr(slurm, "_slurm", _FakeSlurm({}, {n: _failed_squeue for n in (1, 2, 3)}))
    with pytest.raises(UserError, match="3 squeue polls in a row failed; the sweep's jobs go on"):
        slurm.run_slurm(sweep, keys, 2, 0.001)


def test_sbatch_and_squeue_run_in_their_own_session_with_a_timeout(monkeypatch):
    from megatron_scalerl.sweep import slurm

    seen = {}

    def run(command, **kwargs):
        seen.update(kwargs)
        return subprocess.CompletedProcess(command, 0, "12+0|sweep-x|PENDING\n12+1|sweep-x|RUNNING\n", "")

    monkeypatch.setattr(subprocess, "run", run)  # as launch.allocation.slurm_client runs it
    assert slurm.queued(["sweep-x"]) == {"sweep-x": (12, "running")}  # a het-job runs when any component does
    assert seen["start_new_session"] is True and seen["timeout"] == slurm.SLURM_TIMEOUT_S


def _reported_run(run_dir: Path, paper, seed: int, sets: list[str], finished: int | None) -> None:
    """A run directory as a finished run leaves it: its recipe, its metrics (a synthetic curve of `paper`)."""
    from megatron_scalerl.forecast.synthetic import simulate_run

    run_dir.mkdir(parents=True)
    (run_dir / "recipe.yaml").write_text(load_recipe("demo", sets).to_yaml())
    (run_dir / "metrics.jsonl").write_text(simulate_run(paper, seed, num_evals=41).curve.to_jsonl())
    if finished is not None:
        write_finished(run_dir, "max_steps", finished, 1.0)


def test_the_report_of_a_sweep_leaves_out_what_is_not_done_or_cannot_be_fitted(tmp_path, monkeypatch, capsys):
    from megatron_scalerl.commands.sweep import _final_report
    from megatron_scalerl.forecast import predict
    from megatron_scalerl.forecast.synthetic import PaperRun
    from megatron_scalerl.sweep import report as sweep_report
    from megatron_scalerl.sweep.report import report_sweep

    base = PaperRun("base", C_mid=2542, B=1.92, A=0.610, budget=16000)
    sets = ["forecast.min_compute=1500", "forecast.budgets=[16000]", "forecast.resamples=20"]
    manifest = merge(tmp_path, None, **_request(base="demo", sets=sets, steps=3, seeds=3,
                                                variants=[Variant("wide", "grid", ("data.validation_generations=8",))]))
    for key, paper, extra, finished in [
        ("base/seed0", base, [], 3), ("base/seed1", base, [], 2), ("base/seed2", base, [], None),
        ("wide/seed0", replace(base, A=0.66), ["data.validation_generations=8"], 3),
        ("wide/seed1", base, ["data.validation_generations=8"], 3),
        ("wide/seed2", base, ["data.validation_generations=8"], 3)]:
        _reported_run(tmp_path / key, paper, len(key) + int(key[-1]), sets + extra, finished)
    manifest["runs"]["wide/seed1"]["exit_code"] = 1  # failed after finished.json: not done
    real = predict.make_forecast

    def failing(curve, options=None):
        if curve.source.endswith("wide/seed2"):
            raise RuntimeError("Optimal parameters not found: the maximum number of function evaluations is exceeded")
        return real(curve, options)

    monkeypatch.setattr(sweep_report, "make_forecast", failing)  # as sweep/report.py imports it
    report_sweep(tmp_path, manifest, as_json=True)
    data = json.loads(capsys.readouterr().out)
    assert data["base"]["runs"] == [str(tmp_path / "base/seed0")]
    assert [v["runs"] for v in data["variants"]] == [[str(tmp_path / "wide/seed0")]]
    reasons = {Path(e["run"]).relative_to(tmp_path).as_posix(): e["reason"] for e in data["left_out"]}
    assert reasons["base/seed1"] == "not extended yet" and reasons["base/seed2"] == "not finished"
    assert reasons["wide/seed1"].startswith("its last launch failed (exit 1)")
    assert reasons["wide/seed2"].startswith("RuntimeError: Optimal parameters not found") and len(reasons) == 4
    assert data["warnings"] == ["wide: its validation scores 512 completions per evaluation (data.validation_holdout x "
                                "data.validation_generations; 0: none), the base's 256: its evaluation noise is "
                                "modelled with the base's"]
    assert data["options"]["eval_draws"] == 256 and data["options"]["targets"] == [0.55]  # the base's recipe
    written = json.loads((tmp_path / "report" / "ablation.json").read_text())
    assert written["left_out"] == data["left_out"] and written["warnings"] == data["warnings"]
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert f"## Left out\n\n- base: {tmp_path / 'base/seed1'}: not extended yet" in markdown
    assert "RuntimeError: Optimal parameters" in markdown and "- wide: its validation scores 512" in markdown
    # every run done but nothing to fit (none covers 5 steps): said, and the sweep still succeeds
    manifest["steps"] = 5
    assert _final_report(Sweep(tmp_path, manifest, {})) == 0
    err = capsys.readouterr().err
    assert "all runs are done, but there is nothing to report: no ablation report: no run of the base can be fitted" \
        in err and "not extended yet" in err


# ------------------------------------------------------------------------------------------------ real sweeps


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    """The tiny dense model (random weights) and its tokenizer, as the README's SLURM walk builds it."""
    out = tmp_path_factory.mktemp("models") / "tiny_dense"
    done = subprocess.run([str(SCALERL), "demo", "--init-only", str(out), "--model", "tiny_dense", "--seed", "3"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _trainer_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir, role="trainer")]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_a_local_sweep_is_interrupted_then_resumed_and_extended_at_once(tmp_path, dense_model):
    sweep_dir = tmp_path / "sweep"
    base, dapo = sweep_dir / "base" / "seed0", sweep_dir / "loo_dapo_loss" / "seed0"
    fresh = ["--sweep-dir", str(sweep_dir), "--base", "demo", "--model", f"hf:{dense_model}",
             "--variants", "loo_dapo_loss", "--steps", "3", *[a for s in SETS for a in ("--set", s)]]
    # 1: the base runs to its end; the variant is interrupted (Ctrl-C) once it has a checkpoint
    first = SweepProcess(fresh, tmp_path / "first.log")
    first.wait_for(lambda: (dapo / "checkpoints" / "iter_0000001" / "manifest.json").is_file(), "a variant checkpoint")
    first.process.send_signal(signal.SIGINT)
    assert first.end() == 130, first.text()[-3000:]
    assert "stopping 1 run(s)" in first.text()
    runs = load_manifest(sweep_dir)["runs"]
    assert (runs["base/seed0"]["state"], runs["loo_dapo_loss/seed0"]["state"]) == ("done", "stopped")
    assert read_finished(base)["step"] == 3 and read_finished(dapo) is None
    assert load_recipe(dapo / "recipe.yaml").algorithm.loss.type == "dapo" and load_recipe(base / "recipe.yaml").model.arch \
        == "llama3"
    # 2: extended to 6 steps: the stopped variant continues from its checkpoint, the finished base from its end, and
    # the report is made. (A resumed trainer may run through batches already on disk faster than the orchestrator
    # polls the versions it pushes, so the variant may have few validations of its first part; the new steps bring
    # it past the fit's 5.)
    second = SweepProcess(["--sweep-dir", str(sweep_dir), "--steps", "6"], tmp_path / "second.log")
    assert second.end() == 0, second.text()[-3000:]
    assert "2 runs, 0 done, 2 to continue, 0 to start" in second.text()
    assert "resumed from iter_" in (dapo / "logs" / "trainer.log").read_text()
    assert "resumed from iter_0000003" in (base / "logs" / "trainer.log").read_text()
    for run in (base, dapo):
        assert read_finished(run)["step"] == 6 and load_recipe(run / "recipe.yaml").trainer.max_steps == 6
        steps = _trainer_steps(run)
        assert sorted(set(steps)) == list(range(1, 7)) and steps.count(1) == 1, (run, steps)
    assert _trainer_steps(base) == list(range(1, 7))  # never a step twice
    assert "# Ablation: loo_dapo_loss vs base" in second.text()
    report = json.loads((sweep_dir / "report" / "ablation.json").read_text())
    assert [v["name"] for v in report["variants"]] == ["loo_dapo_loss"] and report["left_out"] == []
    assert len(report["base"]["runs"]) == 1
    # 3: the same command without its arguments: every run is done, none is run again
    untouched = {p: (p.stat().st_mtime_ns, p.read_bytes()) for run in (base, dapo)
                 for p in (run / "finished.json", run / "metrics.jsonl")}
    third = SweepProcess(["--sweep-dir", str(sweep_dir)], tmp_path / "third.log")
    assert third.end() == 0, third.text()[-3000:]
    assert "2 runs, 2 done, 0 to continue, 0 to start" in third.text()
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in untouched} == untouched
