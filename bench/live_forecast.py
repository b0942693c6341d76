"""Benchmark: what the live forecast costs a run (issue 27): the orchestrator's throughput with it on and off, and
each fit's CPU time against the time between validations.

Two whole `scalerl train` runs of the `demo` recipe (PipelineRL-8, the demo's warm-started model, the same
checkpoint; bench/pipeline.py's `run` and `figures`), validating every `--validation-interval` steps (more often
than the demo, so that fits are frequent), one with `forecast.live: true`, the baseline with it off. Figures over
the batches after `--warmup`: generated samples/s at the orchestrator and trained samples/s at the trainer (ratios
on / off), and, from the live run's `forecast/fit_cpu_s` rows, each fit's CPU seconds (spent in the fitting process,
not in the orchestrator's) against the seconds between two validations. The last line is one JSON object.

    OMP_NUM_THREADS=1 python bench/live_forecast.py [--workload demo|random] [--steps 60] [--warmup 16]
        [--validation-interval 4] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from pipeline import (  # this folder's pipeline bench: same runs
    WORKLOAD_OVERRIDES,
    add_set_argument,
    figures,
    run,
    workload_model,
)

from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.metrics_log import read_metrics


def fit_costs(run_dir: Path) -> dict:
    """CPU seconds per live fit and seconds between validations, from the run's metrics."""
    rows = read_metrics(run_dir, "orchestrator")
    fits = [r["forecast/fit_cpu_s"] for r in rows if "forecast/fit_cpu_s" in r and "forecast/A" in r]
    times = sorted(r["time"] for r in rows if "val/pass_rate" in r)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"fits": len(fits), "fit_cpu_s_mean": statistics.fmean(fits) if fits else None,
            "fit_cpu_s_max": max(fits) if fits else None,
            "seconds_between_validations": statistics.median(gaps) if gaps else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOAD_OVERRIDES), default="demo",
                        help="demo: the warm-started model (as `make demo`); random: random weights, no warm start")
    parser.add_argument("--model-dir", type=Path, default=Path("runs/demo_model"),
                        help="where the demo's warm-started model is reused from or built (as `make demo`)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=16, help="first batches left out of the throughput figures")
    parser.add_argument("--validation-interval", type=int, default=4, help="steps between validations")
    add_set_argument(parser)
    args = parser.parse_args()
    recipe = load_recipe("demo", args.set)
    samples = recipe.rollout.prompts_per_step * recipe.rollout.generations_per_prompt
    common = [*args.set, f"trainer.max_steps={args.steps}", f"data.validation_interval={args.validation_interval}",
              "data.validation_holdout=32", "data.validation_generations=2", *WORKLOAD_OVERRIDES[args.workload]]
    with tempfile.TemporaryDirectory(prefix="bench_live_forecast_") as tmp:
        root = Path(tmp)
        model = workload_model(args.workload, recipe, args.model_dir, root)
        # run() turns validation off by an interval past the run; the interval here comes after it and wins.
        # The baseline runs first (page cache and vLLM's start-up then favour the live run, not the baseline).
        off = run(root, model, "off", [*common, "forecast.live=false"])
        on = run(root, model, "on", [*common, "forecast.live=true"])
        result = {"on": figures(on, args.warmup, samples), "off": figures(off, args.warmup, samples),
                  "fits": fit_costs(on)}
    result["generated_samples_per_s_on_over_off"] = (result["on"]["generated_samples_per_s"]
                                                     / result["off"]["generated_samples_per_s"])
    result["samples_per_s_on_over_off"] = result["on"]["samples_per_s"] / result["off"]["samples_per_s"]
    costs = result["fits"]
    if costs["fit_cpu_s_mean"] is not None and costs["seconds_between_validations"]:
        costs["fit_cpu_share_of_validation_gap"] = costs["fit_cpu_s_mean"] / costs["seconds_between_validations"]
    for mode in ("on", "off"):
        f = result[mode]
        print(f"live forecast {mode}: generated {f['generated_samples_per_s']:.2f} samples/s, trained "
              f"{f['samples_per_s']:.2f} samples/s")
    print(f"ratios on / off: generated {result['generated_samples_per_s_on_over_off']:.3f}, trained "
          f"{result['samples_per_s_on_over_off']:.3f}; {costs['fits']} fits, {costs['fit_cpu_s_mean']} CPU s each "
          f"(max {costs['fit_cpu_s_max']}), {costs['seconds_between_validations']} s between validations")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
