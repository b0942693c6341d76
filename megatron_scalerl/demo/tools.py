"""`scalerl demo --tools`: what a tool buys, measured on one warm-started model.

    scalerl demo --tools [--run-dir runs/demo_tools] [--steps N] [--set KEY=VALUE ...]

The `demo_tools` recipe asks for products of two numbers of up to three digits, which the tiny model cannot work out
in its head, with the built-in Python tool (`environment: python_tool`, tasks/environments.py).

1. The tiny model, its tokenizer trained on the prompts, worked answers and tool traces (`demo.model.tool_trace`)
   with numbers in digit groups (the same tokens in the prompt, the program, the output and the answer: copying
   them is what the model learns), warm-started on the training prompts with `TOOL_FRACTION` of its completions
   calling the tool (its output out of the loss) and the rest answering at once, until it writes `TRACE_TARGET` of
   the held-out tool traces itself (`demo.sft.reproduced_traces`), at most `WARM_START_STEPS` steps (`RUN_model/`,
   reused while built from the same settings, as the demo's).
2. Two RL runs of that model with the same recipe and steps: `RUN/with_tool`, and `RUN/without_tool` with the
   environment off (`environment: null`: the model may still write a block, nothing answers it).
3. `RUN/tools_comparison.json`: `with_tool` and `without_tool`, each the mean of the last `LAST_VALIDATIONS`
   validation pass rates, their difference (`gain`), each run's validation curve (step, pass rate) and the tool
   figures of the run with it; `RUN/tools_comparison.png`: both curves side by side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from megatron_scalerl.demo.run import demo_recipe, warm_started_model
from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_json
from megatron_scalerl.forecast import plots
from megatron_scalerl.launch.local import start_run
from megatron_scalerl.recipe import Recipe, validate
from megatron_scalerl.run.metrics_log import read_metrics

PRESET = "demo_tools"
TOOL_FRACTION = 0.5  # share of the warm start's completions that call the tool (at 0.3 it samples a call in ~1 of 6)
TRACE_TARGET = 0.8  # held-out tool traces the warm-started model writes: its copying (the expression into the program,
# the output into the answer) emerges after ~500-1000 steps, by seed; from ~0.1 RL has too little to build on
WARM_START_STEPS = 2000
LAST_VALIDATIONS = 3  # each run's figure: the mean of its last validations (one alone is noisy)
RUNS = ("with_tool", "without_tool")


def tool_off(recipe: Recipe) -> Recipe:
    """`recipe` with no source's environment: the same prompts, nothing answers the model's blocks."""
    data = recipe.to_dict()
    for source in data["data"]["train"]:
        source["environment"] = None
    data["name"] = f"{recipe.name}+no_tool"
    return validate(data, source=f"{recipe.name} with the tool off")


def validation_curve(rows: list[dict]) -> tuple[list[int], list[float]]:
    """(steps, val/pass_rate) of a run's validations (its orchestrator's metrics rows), in step order."""
    validations = sorted((r for r in rows if "val/pass_rate" in r), key=lambda r: r["step"])
    return [r["step"] for r in validations], [r["val/pass_rate"] for r in validations]


def last_tool_figures(rows: list[dict]) -> dict[str, float]:
    """The last validation's tool figures (`val/tool/*`) among a run's orchestrator's metrics rows."""
    validations = [r for r in rows if "val/tool/calls_mean" in r]
    if not validations:
        return {}
    return {k: v for k, v in max(validations, key=lambda r: r["step"]).items() if k.startswith("val/tool/")}


def compare(run_dir: Path) -> dict:
    """`RUN/tools_comparison.json` and `.png` from the two finished runs (each one's metrics read once); the
    comparison."""
    rows = {name: read_metrics(run_dir / name, "orchestrator") for name in RUNS}
    curves = {name: validation_curve(rows[name]) for name in RUNS}
    means = {}
    for name, (_, rates) in curves.items():
        if not rates:
            raise UserError(f"{run_dir / name}: no validation logged")
        tail = rates[-LAST_VALIDATIONS:]
        means[name] = sum(tail) / len(tail)
    comparison = {**means, "gain": means["with_tool"] - means["without_tool"], "last_validations": LAST_VALIDATIONS,
                  "curves": {name: {"steps": s, "pass_rate": r} for name, (s, r) in curves.items()},
                  "with_tool_figures": last_tool_figures(rows["with_tool"])}
    atomic_write_json(run_dir / "tools_comparison.json", comparison)
    (run_dir / "tools_comparison.png").write_bytes(plots.steps_png(
        {"with the Python tool": curves["with_tool"], "without it": curves["without_tool"]}, "val/pass_rate",
        f"{run_dir.name}: held-out pass rate, the same model and steps"))
    return comparison


def run_tools_demo(run_dir: Path, model: str, steps: int | None, overrides: Sequence[str]) -> int:
    """The whole demo (module docstring); the exit code of the first run that fails, else 0."""
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir} exists: remove it for a new demo")
    base = demo_recipe(PRESET, model)
    warm = warm_started_model(base, run_dir.with_name(run_dir.name + "_model"), target=TRACE_TARGET,
                              max_steps=WARM_START_STEPS, unclosed_fraction=0.0, tool_fraction=TOOL_FRACTION,
                              digit_groups=True)
    extra = [f"trainer.init_from={warm.resolve()}", *overrides, *([f"trainer.max_steps={steps}"] if steps else [])]
    with_tool = demo_recipe(PRESET, model, extra)
    for name, recipe in zip(RUNS, (with_tool, tool_off(with_tool)), strict=True):
        print(f"demo: RL {name.replace('_', ' ')} in {run_dir / name}", flush=True)
        code = start_run(run_dir / name, recipe, warm)
        if code != 0:
            return code
    comparison = compare(run_dir)
    print(f"demo: held-out pass rate (mean of the last {LAST_VALIDATIONS} validations): with the tool "
          f"{comparison['with_tool']:.3f}, without {comparison['without_tool']:.3f} ({comparison['gain']:+.3f}); "
          f"{run_dir / 'tools_comparison.json'}, {run_dir / 'tools_comparison.png'}", flush=True)
    print(f"demo: tool use at the last validation: {json.dumps(comparison['with_tool_figures'])}", flush=True)
    return 0
