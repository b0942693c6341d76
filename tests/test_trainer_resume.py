"""Checkpoints of a real tiny model: exact resume, resharded resume, corrupt checkpoint fallback."""

import math

import pytest

from megatron_scalerl.platform import run_local_workers
from tests.trainer_utils import rl_batch, tiny_recipe


def _train_and_save(rank, run_dir, save_after):
    from megatron_scalerl.trainer.checkpoint import CheckpointStore
    from megatron_scalerl.trainer.setup import build_trainer
    from megatron_scalerl.trainer.state import save_trainer

    trainer = build_trainer(tiny_recipe())
    store = CheckpointStore(run_dir, keep=5)
    losses = []
    for seed in range(4):
        losses.append(trainer.step.run(rl_batch(seed))["train/loss"])
        if trainer.step.state.step in save_after:
            save_trainer(store, trainer.model, trainer.optimizer, trainer.step.state, {"wall_hours": 0.5})
    return losses


def _resume(rank, run_dir, layout):
    from megatron_scalerl.trainer.checkpoint import CheckpointStore
    from megatron_scalerl.trainer.setup import build_trainer
    from megatron_scalerl.trainer.state import load_trainer

    trainer = build_trainer(tiny_recipe(**layout))
    iteration, path = CheckpointStore(run_dir, keep=5).latest_valid()
    trainer.step.state, rl_state = load_trainer(path, trainer.model, trainer.optimizer)
    losses = [trainer.step.run(rl_batch(seed))["train/loss"] for seed in range(trainer.step.state.step, 4)]
    return iteration, rl_state["wall_hours"], trainer.step.state.weight_version, losses


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    losses = run_local_workers(_train_and_save, 1, run_dir, {1, 2}, timeout_s=300)[0]
    return run_dir, losses


def test_resume_gives_exactly_the_uninterrupted_losses(saved_run):
    run_dir, losses = saved_run
    iteration, hours, version, resumed = run_local_workers(_resume, 1, run_dir, {}, timeout_s=300)[0]
    assert (iteration, hours, version) == (2, 0.5, 4)
    assert resumed == losses[2:]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_resume_into_a_different_layout(saved_run, layout):
    run_dir, losses = saved_run
    for _, _, _, resumed in run_local_workers(_resume, 2, run_dir, layout, timeout_s=400):
        for a, b in zip(resumed, losses[2:], strict=True):
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-7)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(saved_run, tmp_path):
    import shutil

    run_dir, losses = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shard = sorted((copy / "checkpoints" / "iter_0000002").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    iteration, _, _, resumed = run_local_workers(_resume, 1, copy, {}, timeout_s=300)[0]
    assert iteration == 1
    assert resumed == losses[1:]
