"""`scalerl sweep`: run, resume or extend a sweep (variants x seeds of one base recipe), then its ablation report.

    scalerl sweep --sweep-dir DIR --base RECIPE (--variants R1,R2,... | --grid key=v1,v2 ...) [--seeds N]
                  [--steps N | --budget GPU-H] [--set k=v ...] [--model PRESET|hf:DIR] [--tokenizer DIR]
                  [--parallel N | --slurm [--max-concurrent N] [--poll S]]
    scalerl sweep --sweep-dir DIR [more variants, seeds, steps or budget]     # resume / extend
    scalerl sweep report DIR [--json] [--out DIR]
    scalerl sweep report --runs BASE_RUN RUN ... [--json] [--out DIR]

The full manual: docs/sweeps.md. The parts: `plan` (variants -> run recipes), `manifest` (SWEEP/sweep.json),
`weights` (the shared initial weights), `runs` (run directories, done or not, extension), `local` / `slurm` (the
launchers), `report` (the ablation report).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast.data import parse_gpu_hours
from megatron_scalerl.forecast.design import POWER_TRIALS, Design
from megatron_scalerl.recipe import resolve_dict, validate
from megatron_scalerl.sweep.local import run_local
from megatron_scalerl.sweep.manifest import (
    MANIFEST,
    SweepLock,
    check_base_recipe,
    load_manifest,
    manifest_path,
    merge,
    ordered_runs,
)
from megatron_scalerl.sweep.plan import (
    BaseSpec,
    Variant,
    base_fields,
    grid_variants,
    preset_variant,
    variant_notes,
    variant_recipe,
)
from megatron_scalerl.sweep.report import given_runs, report, report_sweep
from megatron_scalerl.sweep.runs import Sweep, SweepRun, refuse_live_launchers
from megatron_scalerl.sweep.slurm import run_slurm
from megatron_scalerl.sweep.weights import check_init_from, decide_init_from, fingerprint


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep-dir", type=Path, help="the sweep's directory (a new one, or one to resume/extend)")
    parser.add_argument("--base", help="base recipe: preset name or YAML (a new sweep; then the manifest's)")
    parser.add_argument("--variants", action="append", default=[], metavar="R1,R2,...",
                        help="variant presets or recipe files, each applied as its differences from its own base")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="one variant per value (several --grid: their product)")
    parser.add_argument("--seeds", type=int, help="seeds per variant (trainer.seed = the base's + 0, 1, ...)")
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--steps", type=int, help="optimizer steps per run (trainer.max_steps)")
    limit.add_argument("--budget", metavar="GPU-H", help="GPU-hours per run (trainer.max_gpu_hours), e.g. 2k")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override applied to the base of every run")
    parser.add_argument("--model", dest="model_preset", help="model preset of the base, or hf:DIR")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: trainer.init_from's)")
    parser.add_argument("--parallel", type=int, help="local runs at once (default 1; kept by the sweep)")
    parser.add_argument("--slurm", action="store_true", help="one SLURM job per run (slurm/scalerl_*.sbatch); a "
                                                             "sweep made with it keeps it")
    parser.add_argument("--max-concurrent", type=int, help="SLURM: most jobs queued or running at once (default: "
                                                           "all; kept by the sweep)")
    parser.add_argument("--poll", type=float, default=30.0, help="SLURM: seconds between squeue polls (> 0)")
    parser.set_defaults(func=_sweep)
    commands = parser.add_subparsers(dest="sweep_command", metavar="report", parser_class=type(parser))
    report = commands.add_parser("report", help="the ablation report of a sweep, or of runs made any other way")
    report.add_argument("report_dir", nargs="?", type=Path, metavar="DIR", help="the sweep's directory")
    report.add_argument("--runs", nargs="+", type=Path, metavar="RUN", help="run directories; the first is the base")
    report.add_argument("--json", action="store_true", help="print exactly one JSON object")
    report.add_argument("--out", type=Path, help="write the report's files here (a sweep's default: DIR/report)")
    report.add_argument("--power-design", dest="power_designs", action="append", default=[], type=_design,
                        metavar="SEEDSxCOMPLETIONS[xLENGTH]", help="also simulate the power of a study of SEEDS "
                        "runs per recipe and COMPLETIONS scored per validation, e.g. 3x2048, and with xLENGTH runs "
                        "that many times as long as this study's (its fitted curves extrapolated), e.g. 3x2048x1.5 "
                        "(repeatable)")
    report.add_argument("--power-trials", type=int, default=POWER_TRIALS, metavar="N",
                        help=f"simulated studies behind each power figure (default {POWER_TRIALS}; >= 1)")
    report.set_defaults(func=_report)


def _check_options(args: argparse.Namespace) -> float | None:
    """Combinations argparse cannot check; the budget in GPU-hours."""

    if args.sweep_dir is None:
        raise UserError("scalerl sweep: give --sweep-dir DIR (run, resume or extend a sweep), or `scalerl sweep "
                        "report DIR`")
    for option, value in (("--seeds", args.seeds), ("--steps", args.steps), ("--parallel", args.parallel),
                          ("--max-concurrent", args.max_concurrent)):
        if value is not None and value < 1:
            raise UserError(f"{option} must be >= 1, got {value}")
    if not args.poll > 0:
        raise UserError(f"--poll must be > 0 seconds, got {args.poll:g}")
    budget = parse_gpu_hours(args.budget, "--budget") if args.budget is not None else None
    if budget == 0:
        raise UserError("--budget must be > 0 GPU-hours")
    return budget


def _merged_manifest(args: argparse.Namespace, sweep_dir: Path, budget: float | None) -> tuple[dict, dict, set[str]]:
    """(the manifest with this invocation merged in, the base recipe's mapping, the keys of the runs this invocation
    adds); the initial weights decided for a new sweep. Nothing is written yet."""
    old = load_manifest(sweep_dir)
    if old is None and args.base is None:
        raise UserError(f"{sweep_dir} holds no sweep yet ({MANIFEST}): give --base and the variants")
    base = args.base or old["base"]
    base_dict = resolve_dict(base, args.overrides or (old or {}).get("set") or [],
                             args.model_preset or (old or {}).get("model"))
    variants = [preset_variant(name.strip()) for text in args.variants for name in text.split(",") if name.strip()]
    variants += grid_variants(args.grid, base_dict) if args.grid else []
    names = [v.name for v in variants]
    if len(set(names)) < len(names):
        raise UserError(f"variants named twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    manifest = merge(sweep_dir, old, base=args.base, model=args.model_preset, sets=args.overrides,
                     tokenizer=str(args.tokenizer.resolve()) if args.tokenizer else None, steps=args.steps,
                     budget=budget, seeds=args.seeds, variants=variants, slurm=args.slurm, parallel=args.parallel,
                     max_concurrent=args.max_concurrent,
                     recipe_steps=validate(base_dict, source=f"base {base}").trainer.max_steps,
                     base_recipe=base_fields(base_dict))
    if manifest["slurm"] and args.parallel is not None:
        raise UserError("--parallel is for local runs; this sweep submits SLURM jobs (--max-concurrent bounds them)")
    if not manifest["slurm"] and args.max_concurrent is not None:
        raise UserError("--max-concurrent is for SLURM sweeps (--slurm); locally, --parallel")
    if len(manifest["variants"]) < 2:
        raise UserError("a sweep compares variants with its base: give --variants or --grid")
    if manifest["init_from"] is None:
        init_from = decide_init_from(manifest["base"], base_dict)
        manifest["init_from"], manifest["init_fingerprint"] = str(init_from), fingerprint(init_from)
    return manifest, base_dict, set(manifest["runs"]) - set((old or {}).get("runs", {}))


def _why_not_start(manifest: dict, base_dict: dict, sweep_dir: Path) -> UserError | None:
    """Why no new run may start (the initial weights or the base recipe changed since the sweep began), or None."""
    try:
        check_init_from(manifest, manifest_path(sweep_dir))
        check_base_recipe(manifest, base_fields(base_dict), manifest_path(sweep_dir))
    except UserError as exc:
        return exc
    return None


def _sweep(args: argparse.Namespace) -> int:
    budget = _check_options(args)
    sweep_dir: Path = args.sweep_dir.resolve()
    with SweepLock(sweep_dir):
        manifest, base_dict, added = _merged_manifest(args, sweep_dir, budget)
        spec = BaseSpec(manifest["base"], manifest["model"], tuple(manifest["set"]), manifest["init_from"],
                        manifest["steps"], manifest["budget"])
        sweep = _plan(sweep_dir, manifest, spec)
        refuse_live_launchers(sweep)
        keys = ordered_runs(manifest)
        fresh = [k for k in keys if not sweep.runs[k].started]
        blocked = _why_not_start(manifest, base_dict, sweep_dir) if fresh else None
        if blocked is not None and added:
            raise blocked  # the extension is refused before anything of it is saved
        if blocked is not None:  # runs planned earlier, never started: they wait; the started ones go on
            print(f"sweep: {len(fresh)} run(s) not started ({', '.join(fresh)}): {blocked}", file=sys.stderr,
                  flush=True)
            keys = [k for k in keys if k not in fresh]
        sweep.save()
        done = [k for k in keys if sweep.done(k)]
        start = [] if blocked else fresh
        print(f"sweep: {sweep_dir}: base {spec.base}, {len(manifest['variants'])} variants "
              f"({', '.join(manifest['variants'])}) x {manifest['seeds']} seed(s): {len(manifest['runs'])} runs, "
              f"{len(done)} done, {len(keys) - len(done) - len(start)} to continue, {len(start)} to start"
              f"{f', {len(fresh)} held back' if blocked else ''}; from the weights in {spec.init_from}", flush=True)
        code = _launch(sweep, keys, args.poll)
        if blocked is not None:
            print(f"sweep: {len(fresh)} run(s) were not started: {blocked}", file=sys.stderr, flush=True)
            return code or 1
        return code if code != 0 else _final_report(sweep)


def _plan(sweep_dir: Path, manifest: dict, spec: BaseSpec) -> Sweep:
    """The Sweep with every run's recipe validated up front (a bad variant fails before any run starts); prints
    what each variant changes beyond its own fields."""
    runs = {}
    for key, entry in manifest["runs"].items():
        variant = Variant(entry["variant"], **manifest["variants"][entry["variant"]])
        recipe = variant_recipe(spec, variant, entry["seed_index"], f"{sweep_dir.name}-{key.replace('/', '-')}")
        entry["seed"] = recipe.trainer.seed
        runs[key] = SweepRun(key, sweep_dir / entry["run_dir"], recipe)
    base = runs["base/seed0"].recipe
    for name, fields in manifest["variants"].items():
        variant = Variant(name, **fields)
        for note in variant_notes(spec, variant, base, runs[f"{name}/seed0"].recipe):
            print(f"sweep: note: {note}", flush=True)
    return Sweep(sweep_dir, manifest, runs)


def _launch(sweep: Sweep, keys: list[str], poll_s: float) -> int:
    if sweep.manifest["slurm"]:
        return run_slurm(sweep, keys, sweep.manifest["max_concurrent"], poll_s)
    return run_local(sweep, keys, sweep.manifest["parallel"], cuda=torch.cuda.is_available())


def _final_report(sweep: Sweep) -> int:
    """Every run is done: the report into SWEEP/report/. One that cannot be made (nothing left to fit: curves too
    short, fits that fail) is said, and the sweep still succeeds: its runs are done."""
    print(f"sweep: all {len(sweep.runs)} runs are done; the report:", flush=True)
    try:
        report_sweep(sweep.dir, sweep.manifest)
    except UserError as exc:
        print(f"sweep: all runs are done, but there is nothing to report: {exc} (again, once fixed: scalerl sweep "
              f"report {sweep.dir})", file=sys.stderr, flush=True)
    return 0


def _design(text: str) -> Design:
    """`--power-design`'s SEEDSxCOMPLETIONS[xLENGTH], e.g. "3x2048" or "3x2048x1.5"."""
    try:
        seeds, draws, *length = text.lower().split("x")
        design = Design(int(seeds), int(draws), *(float(part) for part in length))
    except (ValueError, TypeError):  # fewer than two parts or more than three, or not numbers
        design = None
    if design is None or not design.valid:
        raise argparse.ArgumentTypeError(f"{text!r}: expected SEEDSxCOMPLETIONS, two positive integers, e.g. 3x2048, "
                                         "optionally xLENGTH, the runs' length as a multiple of the study's, e.g. "
                                         "3x2048x1.5")
    return design


def _report(args: argparse.Namespace) -> int:
    if args.power_trials < 1:
        raise UserError(f"scalerl sweep report: --power-trials must be >= 1, got {args.power_trials}")
    if (args.report_dir is None) == (args.runs is None):
        raise UserError("scalerl sweep report: give a sweep directory, or --runs BASE_RUN RUN ... (not both)")
    if args.runs is not None:
        report(*given_runs(args.runs), args.out, args.json, tuple(args.power_designs), args.power_trials)
        return 0
    manifest = load_manifest(args.report_dir)
    if manifest is None:
        raise UserError(f"{args.report_dir}: no {MANIFEST} (not a sweep directory); for other runs use --runs")
    report_sweep(args.report_dir, manifest, args.out, args.json, tuple(args.power_designs), args.power_trials)
    return 0
