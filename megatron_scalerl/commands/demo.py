"""`scalerl demo`: the one-command CPU demo (what `make demo` runs); the demo itself is `megatron_scalerl.demo`.

    scalerl demo [--run-dir runs/demo] [--steps N] [--mix] [--routing measure|replay] [--model PRESET] [--set K=V]
    scalerl demo --init-only DIR [--model tiny_moe|...] [--seed S]
    scalerl demo --model smollm2_135m [--steps N] [--set K=V]     # a real pretrained model (demo/real_model.py)
    scalerl demo --tools [--steps N] [--set K=V]                  # RL with the Python tool and without (demo/tools.py)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_scalerl.demo.real_model import (
    REAL_MODELS,
    check_real_demo_options,
    evaluate_before_and_after,
    real_checkpoint,
    real_demo_recipe,
    write_heldout,
)
from megatron_scalerl.demo.run import (
    RISE_POINTS,
    ROUTING,
    TINY_MODELS,
    demo_recipe,
    domain_verdicts,
    init_only,
    mismatch_summary,
    plot_validation,
    print_forecast,
    warm_started_model,
)
from megatron_scalerl.demo.tools import run_tools_demo
from megatron_scalerl.errors import UserError
from megatron_scalerl.launch.local import start_run
from megatron_scalerl.models.gguf import gguf_to_hf


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, help="the run directory (default: runs/demo, with --mix runs/demo_mix)")
    parser.add_argument("--mix", action="store_true",
                        help="math and code in one run (the demo_mix recipe): one validation curve per domain")
    parser.add_argument("--tools", action="store_true",
                        help="multi-turn RL with the Python tool (the demo_tools recipe) and the same run with it "
                             "off, compared: RUN/tools_comparison.json and .png")
    parser.add_argument("--steps", type=int, help="RL steps (default: the demo recipe's trainer.max_steps)")
    parser.add_argument("--routing", choices=list(ROUTING), default="off",
                        help="MoE routing: measure = the generator returns its routes and the trainer logs "
                             "train/routing_agreement; replay = the trainer also replays them (default: off)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="change the RL run's recipe (repeatable), e.g. trainer.precision=bf16")
    parser.add_argument("--init-only", type=Path, metavar="DIR",
                        help="only build the tiny model (random weights) and its tokenizer into DIR, then exit")
    parser.add_argument("--model", choices=[*TINY_MODELS, *REAL_MODELS], default=TINY_MODELS[0],
                        help="the tiny model the demo builds and trains (with --init-only: builds), or a real "
                             "pretrained one it builds from its installed wheel (smollm2_135m)")
    parser.add_argument("--seed", type=int, help="with --init-only: weight seed (default: the recipe's trainer.seed)")
    parser.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    if args.tools:
        if args.mix or args.routing != "off" or args.init_only is not None or args.seed is not None:
            raise UserError("--tools is its own demo: without --mix, --routing, --init-only and --seed")
        if args.model in REAL_MODELS:
            raise UserError(f"--tools trains the tiny model (its warm start writes the tool traces); {args.model} "
                            "with the tool is a `scalerl train` of its recipe with `environment: python_tool` on "
                            "its source (docs/tasks.md, \"Tools and environments\")")
        return run_tools_demo(args.run_dir or Path("runs") / "demo_tools", args.model, args.steps, args.overrides)
    if args.model in REAL_MODELS:
        return _real_demo(args)
    if args.init_only is not None:
        if args.steps is not None or args.mix or args.routing != "off" or args.overrides:
            raise UserError("--steps, --mix, --routing and --set are the demo's RL run: --init-only trains nothing")
        return init_only(args.init_only, args.model, args.seed)
    if args.seed is not None:
        raise UserError("--seed goes with --init-only (the demo itself trains with its recipe's seed)")
    preset = "demo_mix" if args.mix else "demo"
    run_dir: Path = args.run_dir or Path("runs") / preset
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir} exists: remove it for a new demo, or continue it with "
                        f"`scalerl train --run-dir {run_dir} --resume`")
    base = demo_recipe(preset, args.model)
    warm = warm_started_model(base, run_dir.with_name(run_dir.name + "_model"))
    overrides = [f"trainer.init_from={warm.resolve()}", *ROUTING[args.routing], *args.overrides]
    if args.steps:
        overrides.append(f"trainer.max_steps={args.steps}")
    recipe = demo_recipe(preset, args.model, overrides)
    code = start_run(run_dir, recipe, warm)
    if code != 0:
        return code
    domains = recipe.data.domains()
    print(f"demo: validation curve {plot_validation(run_dir, domains)}", flush=True)
    print_forecast(run_dir, recipe)
    print(f"demo: {mismatch_summary(run_dir)}", flush=True)
    if len(domains) > 1:
        print("demo: validation pass rate by domain, start -> end (the mean of the last "
              f"{RISE_POINTS} validations):", flush=True)
        for line in domain_verdicts(run_dir, domains):
            print(f"demo:   {line}", flush=True)
    return 0


def _real_demo(args: argparse.Namespace) -> int:
    """The demo on a real pretrained model (demo/real_model.py): its checkpoint, RL in its own chat format, the
    held-out evaluation before and after, the curve and its forecast."""
    name = args.model
    check_real_demo_options(name, mix=args.mix, routing=args.routing)
    if args.init_only is not None:
        if args.steps is not None or args.overrides or args.seed is not None:
            raise UserError("--steps, --set and --seed are the demo's RL run: --init-only trains nothing")
        if args.init_only.exists() and (not args.init_only.is_dir() or any(args.init_only.iterdir())):
            raise UserError(f"{args.init_only} is not an empty directory: --init-only writes a new model directory")
        gguf_to_hf(REAL_MODELS[name].gguf_path(), args.init_only)
        print(f"demo: {name}'s HF checkpoint in {args.init_only}; start a run from it with "
              f"--model hf:{args.init_only}", flush=True)
        return 0
    if args.seed is not None:
        raise UserError("--seed goes with --init-only (the demo itself trains with its recipe's seed)")
    run_dir: Path = args.run_dir or Path("runs") / f"demo_{name}"
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir} exists: remove it for a new demo, or continue it with "
                        f"`scalerl train --run-dir {run_dir} --resume`")
    hf_dir = real_checkpoint(name, run_dir.with_name(run_dir.name + "_model"))
    overrides = [*args.overrides, *([f"trainer.max_steps={args.steps}"] if args.steps else [])]
    recipe = real_demo_recipe(name, hf_dir, run_dir, overrides)
    code = start_run(run_dir, recipe, hf_dir)
    if code != 0:
        return code
    print(f"demo: held-out prompts as a local benchmark in {write_heldout(recipe, run_dir)}", flush=True)
    before, after = evaluate_before_and_after(run_dir, recipe, hf_dir, recipe.trainer.max_steps)
    print(f"demo: held-out mean@{recipe.eval.samples_per_problem} before RL {before:.3f}, after {after:.3f} "
          f"({after - before:+.3f})", flush=True)
    print(f"demo: validation curve {plot_validation(run_dir)}", flush=True)
    print_forecast(run_dir, recipe)
    print(f"demo: {mismatch_summary(run_dir)}", flush=True)
    return 0
