"""Checkpoints of real tiny models in the GPU recipe's precision (bf16 body, FP32 LM head, on any CPU), dense and MoE: exact resume,
resharded resume, corrupt-checkpoint fallback, and `scalerl verify logits` on trainer checkpoints.

The single-rank scenarios share one spawned worker (`single_rank`); the resharded resumes spawn their layouts.
"""

import math
import shutil

import pytest
import torch

from megatron_scalerl.platform import run_local_workers
from tests.trainer_utils import BF16, rl_batch, run_scenarios, tiny_hf_checkpoint, tiny_recipe

pytestmark = pytest.mark.multiprocess

STEPS = 4  # batches 0..3; checkpoints after 0, 1 and 2 optimizer steps


def _weights(trainer) -> dict:
    from megatron_scalerl.models import export_hf_state

    return {name: t.clone() for name, t in export_hf_state(trainer.model[0], trainer.recipe.model)}


def _train_and_save(rank, run_dir, hf, layout):
    """Train STEPS steps, checkpointing after steps 0, 1, 2; the losses, and the weights and compute (wall hours) as
    saved at step 2."""
    from megatron_scalerl.checkpoint.store import read_rl_state
    from megatron_scalerl.trainer.trainer import Trainer

    trainer = Trainer(run_dir, tiny_recipe(hf=hf, **layout, extra=BF16))
    trainer.checkpoint()
    losses, saved = [], {}
    for seed in range(STEPS):
        losses.append(trainer.train_step(rl_batch(seed))["train/loss"])
        if trainer.state.step in (1, 2):
            trainer.checkpoint()
        if trainer.state.step == 2:
            saved = _weights(trainer)
    return {"losses": losses, "weights": saved, "hours": read_rl_state(trainer.store.path(2))["wall_hours"],
            "precision": trainer.recipe.trainer.precision}


def _resume(rank, run_dir, hf, layout):
    """A trainer at `layout` in `run_dir` (it resumes from the newest valid checkpoint): the step it resumed at, the
    compute it counts from, the weights right after the load and the losses of the remaining steps."""
    from megatron_scalerl.trainer.trainer import Trainer

    trainer = Trainer(run_dir, tiny_recipe(hf=hf, **layout, extra=BF16))
    iteration, hours, weights = trainer.state.step, trainer.compute.wall_hours_before, _weights(trainer)
    losses = [trainer.train_step(rl_batch(seed))["train/loss"] for seed in range(iteration, STEPS)]
    return {"iteration": iteration, "hours": hours, "version": trainer.state.updates, "losses": losses,
            "weights": weights}


def _copy_then_resume(rank, run_dir, copy, damage, hf):
    shutil.copytree(run_dir, copy)
    damage(copy / "checkpoints")
    return _resume(rank, copy, hf, {})


def _corrupt_iter2(checkpoints):
    shard = sorted((checkpoints / "iter_0000002").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _remove_iters_after_0(checkpoints):
    for later in ("iter_0000001", "iter_0000002"):
        shutil.rmtree(checkpoints / later)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return {model: tiny_hf_checkpoint(tmp_path_factory.mktemp(f"hf_{model}"), model=model)
            for model in ("tiny_dense", "tiny_moe")}


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory, hf_dirs):
    root = tmp_path_factory.mktemp("runs")
    dense_hf, moe = hf_dirs["tiny_dense"], dict(model="tiny_moe")
    scenarios = {
        "dense": (_train_and_save, root / "dense", hf_dirs["tiny_dense"], {}),
        "moe": (_train_and_save, root / "moe", hf_dirs["tiny_moe"], moe),
        "dense_resumed": (_resume, root / "dense", hf_dirs["tiny_dense"], {}),
        "moe_resumed": (_resume, root / "moe", hf_dirs["tiny_moe"], moe),
        "corrupt": (_copy_then_resume, root / "dense", root / "corrupt", _corrupt_iter2, dense_hf),
        "from_step_0": (_copy_then_resume, root / "dense", root / "step0", _remove_iters_after_0, dense_hf),
    }
    return root, run_local_workers(run_scenarios, 1, scenarios, timeout_s=600)[0]


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_resume_gives_exactly_the_uninterrupted_losses(single_rank, model):
    _, results = single_rank
    run, resumed = results[model], results[f"{model}_resumed"]
    assert run["precision"] == "bf16"  # the GPU recipe's: bf16 weights, FP32 LM head
    assert (resumed["iteration"], resumed["hours"], resumed["version"]) == (2, run["hours"], STEPS) and run["hours"] > 0
    assert resumed["losses"] == run["losses"][2:]
    assert all(torch.equal(resumed["weights"][n], t) for n, t in run["weights"].items())


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_and_is_set_aside(single_rank):
    root, results = single_rank
    resumed = results["corrupt"]
    assert resumed["iteration"] == 1 and resumed["losses"] == results["dense"]["losses"][1:]
    aside = root / "corrupt" / "checkpoints" / "unusable" / "iter_0000002" / "UNUSABLE.txt"
    assert "resumed from iter_0000001" in aside.read_text()


def test_resume_from_a_checkpoint_taken_before_any_step(single_rank):
    _, results = single_rank
    resumed = results["from_step_0"]
    assert (resumed["iteration"], resumed["version"]) == (0, STEPS)
    assert resumed["losses"] == results["dense"]["losses"]


def _assert_resharded(per_rank, run):
    """Every rank loaded exactly the saved weights, and trains on to the same losses (bf16: different layouts
    round sums differently, so within 2%)."""
    loaded = {name: t for result in per_rank for name, t in result["weights"].items()}
    assert set(loaded) == set(run["weights"])
    assert all(torch.equal(loaded[n], t) for n, t in run["weights"].items())
    for result in per_rank:
        assert result["iteration"] == 2
        for a, b in zip(result["losses"], run["losses"][2:], strict=True):
            assert math.isclose(a, b, rel_tol=2e-2, abs_tol=1e-4), (result["losses"], run["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("model, layout", [("dense", dict(tp=2)), ("dense", dict(pp=2)),
                                           ("moe", dict(model="tiny_moe", ep=2, dp=2))],
                         ids=["dense-tp2", "dense-pp2", "moe-ep2"])
def test_resume_into_a_different_layout(single_rank, hf_dirs, model, layout):
    root, results = single_rank
    hf = hf_dirs["tiny_moe" if model == "moe" else "tiny_dense"]
    _assert_resharded(run_local_workers(_resume, 2, root / model, hf, layout, timeout_s=400), results[model])


@pytest.mark.slow
def test_checkpoint_written_by_two_data_parallel_ranks_resumes_on_one(single_rank, hf_dirs, tmp_path):
    _, results = single_rank
    hf = hf_dirs["tiny_dense"]
    dp_run = run_local_workers(_train_and_save, 2, tmp_path, hf, dict(dp=2), timeout_s=400)[0]
    _assert_resharded(run_local_workers(_resume, 1, tmp_path, hf, {}, timeout_s=300), dp_run)
    for a, b in zip(dp_run["losses"], results["dense"]["losses"], strict=True):
        assert math.isclose(a, b, rel_tol=2e-2, abs_tol=1e-4)


def _verify(*args):
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", "verify", "logits", *args],
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else proc.stderr


def test_verify_logits_on_trainer_checkpoints(single_rank, hf_dirs):
    root, _ = single_rank
    hf = hf_dirs["tiny_dense"]
    code, report = _verify("--hf", hf, "--megatron", str(root / "dense" / "checkpoints" / "iter_0000000"))
    assert code == 0 and report["max_abs_diff"] <= 1e-4, report
    code, report = _verify("--hf", hf, "--megatron", str(root / "dense" / "checkpoints" / "iter_0000002"),
                           "--tp", "2")
    assert code == 1 and report["max_abs_diff"] > 1e-3  # two optimizer steps later the weights differ from HF


def test_verify_logits_refuses_a_checkpoint_of_another_architecture(single_rank, tmp_path):
    from megatron_scalerl.models.hf_io import save_random_hf_model
    from megatron_scalerl.recipe import load_recipe

    root, _ = single_rank
    other = save_random_hf_model(load_recipe("scalerl", ["model.num_layers=2"], model_preset="tiny_dense").model,
                                 tmp_path / "hf2", seed=0)
    code, err = _verify("--hf", str(other), "--megatron", str(root / "dense" / "checkpoints" / "iter_0000001"))
    assert code == 2 and "model.num_layers is 4 in the checkpoint but 2 in" in err
