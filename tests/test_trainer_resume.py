"""Checkpoints of a real tiny model: exact resume, resharded resume, corrupt checkpoint fallback."""

import math

import pytest

from megatron_scalerl.platform import run_local_workers
from tests.trainer_utils import rl_batch, tiny_hf_checkpoint, tiny_recipe


def _train_and_save(rank, run_dir, save_after, hf, layout=None):
    from megatron_scalerl.trainer.checkpoint import CheckpointStore
    from megatron_scalerl.trainer.setup import build_trainer
    from megatron_scalerl.trainer.state import save_trainer

    trainer = build_trainer(tiny_recipe(hf=hf, **(layout or {})))
    store = CheckpointStore(run_dir, keep=5)
    losses = []
    if 0 in save_after:
        save_trainer(store, trainer.model, trainer.optimizer, trainer.step.state, trainer.step.recipe.model,
                     {"wall_hours": 0.0})
    for seed in range(4):
        losses.append(trainer.step.run(rl_batch(seed))["train/loss"])
        if trainer.step.state.step in save_after:
            save_trainer(store, trainer.model, trainer.optimizer, trainer.step.state, trainer.step.recipe.model,
                         {"wall_hours": 0.5})
    return losses


def _resume(rank, run_dir, layout, hf):
    from megatron_scalerl.trainer.checkpoint import CheckpointStore
    from megatron_scalerl.trainer.setup import build_trainer
    from megatron_scalerl.trainer.state import load_trainer

    trainer = build_trainer(tiny_recipe(hf=hf, **layout))
    iteration, path = CheckpointStore(run_dir, keep=5).latest_valid()
    trainer.step.state, rl_state = load_trainer(path, trainer.model, trainer.optimizer)
    losses = [trainer.step.run(rl_batch(seed))["train/loss"] for seed in range(trainer.step.state.step, 4)]
    return iteration, rl_state["wall_hours"], trainer.step.state.weight_version, losses


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, hf_dir):
    run_dir = tmp_path_factory.mktemp("run")
    losses = run_local_workers(_train_and_save, 1, run_dir, {0, 1, 2}, hf_dir, timeout_s=300)[0]
    return run_dir, losses


def test_resume_gives_exactly_the_uninterrupted_losses(saved_run, hf_dir):
    run_dir, losses = saved_run
    iteration, hours, version, resumed = run_local_workers(_resume, 1, run_dir, {}, hf_dir, timeout_s=300)[0]
    assert (iteration, hours, version) == (2, 0.5, 4)
    assert resumed == losses[2:]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_resume_into_a_different_layout(saved_run, hf_dir, layout):
    run_dir, losses = saved_run
    for _, _, _, resumed in run_local_workers(_resume, 2, run_dir, layout, hf_dir, timeout_s=400):
        for a, b in zip(resumed, losses[2:], strict=True):
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-7)


@pytest.mark.slow
def test_checkpoint_written_by_two_data_parallel_ranks_resumes_on_one(saved_run, hf_dir, tmp_path):
    _, losses = saved_run
    dp_losses = run_local_workers(_train_and_save, 2, tmp_path, {2}, hf_dir, dict(dp=2), timeout_s=400)
    iteration, _, _, resumed = run_local_workers(_resume, 1, tmp_path, {}, hf_dir, timeout_s=300)[0]
    assert iteration == 2
    for a, b in zip(dp_losses[0] + resumed, losses + losses[2:], strict=True):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-7)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(saved_run, hf_dir, tmp_path):
    import shutil

    run_dir, losses = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shard = sorted((copy / "checkpoints" / "iter_0000002").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    iteration, _, _, resumed = run_local_workers(_resume, 1, copy, {}, hf_dir, timeout_s=300)[0]
    assert iteration == 1
    assert resumed == losses[1:]


def _verify(*args):
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "megatron_scalerl.cli", "verify", "logits", *args],
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else proc.stderr


def test_verify_logits_on_trainer_checkpoints(saved_run, hf_dir):
    run_dir, _ = saved_run
    code, report = _verify("--hf", hf_dir, "--megatron", str(run_dir / "checkpoints" / "iter_0000000"))
    assert code == 0 and report["max_abs_diff"] <= 1e-4, report
    code, report = _verify("--hf", hf_dir, "--megatron", str(run_dir / "checkpoints" / "iter_0000002"), "--tp", "2")
    assert code == 1 and report["max_abs_diff"] > 1e-3  # two optimizer steps later the weights differ from HF


def test_verify_logits_refuses_a_checkpoint_of_another_architecture(saved_run, tmp_path):
    from megatron_scalerl.models.hf_io import save_random_hf_model
    from megatron_scalerl.recipe import load_recipe

    run_dir, _ = saved_run
    other = save_random_hf_model(load_recipe("scalerl", ["model.num_layers=2"], model_preset="tiny_dense").model,
                                 tmp_path / "hf2", seed=0)
    code, err = _verify("--hf", str(other), "--megatron", str(run_dir / "checkpoints" / "iter_0000001"))
    assert code == 2 and "model.num_layers is 4 in the checkpoint but 2 in" in err


def test_resume_from_a_checkpoint_taken_before_any_step(saved_run, hf_dir, tmp_path):
    import shutil

    run_dir, losses = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for later in ("iter_0000001", "iter_0000002"):
        shutil.rmtree(copy / "checkpoints" / later)
    iteration, _, version, resumed = run_local_workers(_resume, 1, copy, {}, hf_dir, timeout_s=300)[0]
    assert (iteration, version) == (0, 4)
    assert resumed == losses
