"""A short PipelineRL-k run on GPUs: `scalerl train` of the tiny Llama-4 MoE with the CPU end-to-end test's settings
(tests/test_pipeline_run.py: 6 steps, k = 2, validation every 3), its generators CUDA vLLM servers on GPUs of their
own, its trainer torchrun over NCCL. No faults: the run must finish, train every step once, keep every trained
token within k steps of the policy that trains it, and leave no process behind. Figures: trainer steps/s (first to
last step) and the largest staleness seen.

On 2-3 GPUs: 1 trainer GPU and 1 generator; on 4 or more: 2 trainer GPUs (EP=2) and 2 generators, so the trainer
also pushes to two servers at once.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.gpu(gpus=2, vllm=True)

THIS_FILE = "tests/gpu/test_gpu_pipeline_run.py"


def run_args(run_dir, model, gpus_per_side: int) -> list[str]:
    from tests.test_pipeline_run import OVERRIDES

    overrides = [*OVERRIDES, f"cluster.gpus_per_node={gpus_per_side}",
                 *(["parallelism.ep=2"] if gpus_per_side == 2 else [])]
    return ["--recipe", "scalerl", "--model", "tiny_moe", "--run-dir", str(run_dir),
            "--set", f"trainer.init_from={model}", *[a for o in overrides for a in ("--set", o)]]


def test_pipeline_rl_k_run(tmp_path, gpu_figures):
    from megatron_scalerl.algo.off_policy import staleness_bound
    from megatron_scalerl.demo.model import build_model
    from megatron_scalerl.launch.supervise import LAUNCH_ENV, processes_with_environment
    from megatron_scalerl.recipe import load_recipe
    from megatron_scalerl.run.metrics_log import read_metrics
    from tests.gpu.summary import node_facts
    from tests.launch_utils import launch
    from tests.test_pipeline_run import STEPS

    per_side = 2 if node_facts()["gpu_count"] >= 4 else 1
    model = build_model(load_recipe("scalerl", model_preset="tiny_moe"), tmp_path / "hf", seed=3)
    run_dir = tmp_path / "run"
    start = time.monotonic()
    code, out = launch(run_args(run_dir, model, per_side), [])
    wall = time.monotonic() - start
    recipe = load_recipe(run_dir / "recipe.yaml")
    bound = staleness_bound(recipe.rollout.off_policy, recipe.rollout.k)
    trainer = read_metrics(run_dir, role="trainer")
    batches = read_metrics(run_dir, role="orchestrator")
    steps = [r["step"] for r in trainer]
    times = [r["time"] for r in trainer]
    staleness = [r["staleness/max"] for r in batches if "staleness/max" in r]
    trained_staleness = [r["train/staleness_max"] for r in trainer if "train/staleness_max" in r]
    gpu_figures.update({
        "steps/s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None,
        "max staleness": max(staleness, default=None), "max trained staleness": max(trained_staleness, default=None),
        "k": recipe.rollout.k, "bound": bound, "steps": len(steps), "wall s": wall,
        "layout": f"{recipe.cluster.trainer_gpus} trainer + {recipe.cluster.generator_gpus} generator GPU(s)",
    })
    assert code == 0, out[-3000:]
    assert sorted(steps) == list(range(1, STEPS + 1)), steps
    assert staleness and max(staleness) <= bound, staleness
    assert trained_staleness and max(trained_staleness) <= bound, trained_staleness
    assert (run_dir / "checkpoints" / f"iter_{STEPS:07d}").is_dir()
    assert processes_with_environment(f"{LAUNCH_ENV}=", f"PYTEST_CURRENT_TEST={THIS_FILE}") == []
