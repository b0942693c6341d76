"""The trainer role as users start it: torchrun -m megatron_scalerl.trainer --run-dir RUN."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_scalerl.batches.stream import RolloutStream
from megatron_scalerl.launch.roles import trainer_command
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.directory import request_stop
from megatron_scalerl.run.metrics_log import read_metrics
from tests.trainer_utils import rl_batch, tiny_recipe

pytestmark = pytest.mark.multiprocess


def _trainer_command(run_dir: Path, nproc: int, *extra: str, wait_s: int = 20) -> tuple[list[str], dict]:
    """The launcher's own trainer command line (`launch.roles.trainer_command`) for the recipe in `run_dir`."""
    cmd = trainer_command(run_dir, load_recipe(run_dir / "recipe.yaml"))
    assert f"--nproc-per-node={nproc}" in cmd
    return [*cmd, "--batch-timeout-s", str(wait_s), *extra], {**os.environ, "OMP_NUM_THREADS": "1",
                                                              "WANDB_MODE": "disabled"}


def _run_trainer(run_dir: Path, nproc: int, *extra: str, wait_s: int = 20) -> subprocess.CompletedProcess:
    cmd, env = _trainer_command(run_dir, nproc, *extra, wait_s=wait_s)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _prepare(run_dir: Path, steps: int, interval: int = 2, **layout) -> None:
    recipe = tiny_recipe(extra=[f"trainer.checkpoint_interval={interval}", "logging.wandb_mode=disabled"], **layout)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(recipe.to_yaml())
    stream = RolloutStream(run_dir)
    for seed in range(steps):
        stream.put(rl_batch(seed))


@pytest.mark.slow
def test_trainer_role_trains_checkpoints_and_resumes(tmp_path):
    _prepare(tmp_path, 5)
    (tmp_path / "curriculum.json").write_text('{"retired": [7]}')
    first = _run_trainer(tmp_path, 1, "--max-steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count("precision: auto -> ") == 1  # the recipe's `auto`, resolved and said once
    records = read_metrics(tmp_path, role="trainer")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["gpu_hours"] > 0 and r["gpus"] == 2 for r in records)
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("iter_*"))
    assert checkpoints == ["iter_0000002", "iter_0000003"]
    # pruned below the batch before the oldest checkpoint (iter_2 may have copied the state that ends at batch 1)
    assert sorted(p.name[6:14] for p in (tmp_path / "rollouts").iterdir()) == ["00000001", "00000002", "00000003",
                                                                                 "00000004"]

    second = _run_trainer(tmp_path, 1, "--max-steps", "5")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from iter_0000003" in second.stderr
    steps = [r["step"] for r in read_metrics(tmp_path, role="trainer")]
    assert steps == [1, 2, 3, 4, 5]
    state = json.loads((tmp_path / "checkpoints" / "iter_0000005" / "rl_state.json").read_text())
    assert state["step_state"]["updates"] == 5 and state["curriculum"] == {"retired": [7]}
    assert state["wall_hours"] > records[-1]["wall_hours"]


@pytest.mark.slow
def test_checkpoints_on_a_clock_beside_the_step_interval(tmp_path):
    """`trainer.checkpoint_interval_min` at 0.1 s: every step is past it, so every step checkpoints although the step
    interval (100) never comes; `keep_every: 2` keeps iter_2 beside the newest two, and the stream is pruned behind the
    oldest resumable checkpoint only."""
    recipe = tiny_recipe(extra=["trainer.checkpoint_interval=100", "trainer.checkpoint_interval_min=0.0017",
                                "trainer.keep_checkpoints=2", "trainer.keep_every=2", "logging.wandb_mode=disabled"])
    (tmp_path / "recipe.yaml").write_text(recipe.to_yaml())
    stream = RolloutStream(tmp_path)
    for seed in range(5):
        stream.put(rl_batch(seed))
    done = _run_trainer(tmp_path, 1, "--max-steps", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("checkpoint ") >= 5, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("iter_*")) == ["iter_0000002", "iter_0000004",
                                                                                  "iter_0000005"]
    assert sorted(int(p.name[6:14]) for p in (tmp_path / "rollouts").iterdir()) == [3, 4]  # from iter_4's batch 3


@pytest.mark.slow
def test_trainer_role_waits_for_batches_then_names_the_missing_producer(tmp_path):
    _prepare(tmp_path, 1, dp=2)
    proc = _run_trainer(tmp_path, 2, "--max-steps", "2", wait_s=5)
    assert proc.returncode != 0
    assert proc.stderr.count("precision: ") == 1  # once per run, not once per rank
    assert "trainer ERROR no TrainBatch 1 in" in proc.stderr and "orchestrator" in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path, role="trainer")] == [1]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "stop_file"])
def test_a_stop_checkpoints_the_current_step_and_exits_cleanly(tmp_path, how):
    """SIGTERM to torchrun, which passes it on (what a user's kill or scancel does), or RUN/stop_requested (what the
    launchers do on Ctrl-C and on SLURM's time limit: no signal reaches torchrun, which then exits 0 too)."""
    _prepare(tmp_path, 2, interval=100)
    cmd, env = _trainer_command(tmp_path, 1, "--max-steps", "5", wait_s=300)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 240
    while [r["step"] for r in read_metrics(tmp_path, role="trainer")] != [1, 2]:  # now waiting for batch 2
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.5)
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:
        request_stop(tmp_path)
    out, _ = proc.communicate(timeout=120)
    if how == "sigterm":  # torchrun itself always exits non-zero on a signal; its worker does not
        assert "SIGTERM: stopping after the current step" in out, out[-3000:]
    else:
        assert proc.returncode == 0, out[-3000:]
    assert "stop requested: checkpointing step 2" in out and "[rank0]: Traceback" not in out, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("iter_*")) == ["iter_0000002"]


def test_a_stop_that_hangs_writes_every_threads_stack():
    """Where a rank is stuck after SIGTERM shows in its log before the launcher's SIGKILL."""
    code = ("import threading, time\n"
            "import megatron_scalerl.trainer.trainer as role\n"
            "role.STOP_STACKS_AFTER_S = 0.5\n"
            "role._on_sigterm(threading.Event())\n"
            "def stuck_in_a_collective():\n"
            "    time.sleep(5)\n"
            "stuck_in_a_collective()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Timeout (0:00:00.500000)!" in done.stderr and "in stuck_in_a_collective" in done.stderr, done.stderr


def test_trainer_refuses_a_world_size_the_recipe_does_not_describe():
    """tiny_moe's preset is one trainer GPU: two processes would train at DP2 and report half the GPU-hours."""
    from megatron_scalerl.errors import UserError
    from megatron_scalerl.recipe import load_recipe
    from megatron_scalerl.trainer.trainer import require_trainer_world

    recipe = load_recipe("scalerl", model_preset="tiny_moe")
    require_trainer_world(recipe, 1)
    with pytest.raises(UserError, match=r"runs on 2 processes, but the recipe's layout is tp x pp x dp = 1 x 1 x 1"):
        require_trainer_world(recipe, 2)
