"""`scalerl forecast fit | compare | backtest`: sigmoidal compute-performance forecasts of RL runs.

    scalerl forecast fit RUN_OR_FILE [--budgets 16k,50k,100k] [--target 0.6] [--eval-draws 1000x16] [--out DIR]
    scalerl forecast compare RUN RUN [...] [--out DIR]
    scalerl forecast backtest RUN --fit-until 8k [--out DIR]

RUN is a run directory (its metrics.jsonl), a metrics JSON Lines file or a wandb CSV export. Without `--json` the
report is printed as Markdown; `--out DIR` also writes the JSON, report.md, report.html and PNG plots there.
"""

from __future__ import annotations

import argparse
import math

from megatron_scalerl.commands.parsing import command_group
from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast import plots, report
from megatron_scalerl.forecast.backtest import run_backtest
from megatron_scalerl.forecast.compare import compare_runs
from megatron_scalerl.forecast.data import load_curve, parse_gpu_hours
from megatron_scalerl.forecast.predict import ForecastOptions, make_forecast

DEFAULT_BUDGETS = "16k,50k,100k"


def register(parser: argparse.ArgumentParser) -> None:
    fsub = command_group(parser, "ACTION")

    fit = fsub.add_parser("fit", help="fit one run, predict budgets and targets, recommend")
    fit.add_argument("run", help="run directory, metrics .jsonl file or wandb .csv export")
    _add_options(fit)
    fit.add_argument("--target", default="", metavar="R[,R...]", help="rewards to reach: GPU-hours needed for each")
    fit.set_defaults(func=_fit)

    compare = fsub.add_parser("compare", help="compare runs: fits, leader per budget, crossovers, shared-A rule")
    compare.add_argument("runs", nargs="+", metavar="RUN", help="two or more runs (directories or metrics files)")
    _add_options(compare)
    compare.set_defaults(func=_compare)

    backtest = fsub.add_parser("backtest", help="fit a prefix of a run and score the prediction of the rest")
    backtest.add_argument("run", help="run directory, metrics .jsonl file or wandb .csv export")
    _add_options(backtest, fit_until_required=True)
    backtest.set_defaults(func=_backtest)


def _add_options(p: argparse.ArgumentParser, fit_until_required: bool = False) -> None:
    data = p.add_argument_group("input")
    data.add_argument("--metric", "--metric-col", dest="metric", default="val/pass_rate",
                      help="metric column, a pass rate in [0, 1] (default: val/pass_rate)")
    data.add_argument("--compute-col", default="gpu_hours",
                      help="compute column in GPU-hours (default: gpu_hours; derived from the wall clock if absent)")
    data.add_argument("--gpus", type=int, help="GPUs the run holds (trainers + generators), to derive GPU-hours")
    fit = p.add_argument_group("fit")
    fit.add_argument("--min-compute", default="1.5k", metavar="C",
                     help="leave out evaluations below C GPU-h (default: 1.5k, the paper's cutoff)")
    fit.add_argument("--fit-until", required=fit_until_required, metavar="C",
                     help="fit only evaluations up to C GPU-h" + (" (required)" if fit_until_required else ""))
    fit.add_argument("--r0", type=float, help="reward at zero RL compute (default: the first evaluation)")
    fit.add_argument("--method", default="lsq", choices=("lsq", "paper-grid"),
                     help="lsq: fast least squares (default); paper-grid: the paper's grid search (baseline)")
    fit.add_argument("--budgets", default=DEFAULT_BUDGETS, metavar="C[,C...]",
                     help=f"GPU-hour budgets to predict (default: {DEFAULT_BUDGETS})")
    fit.add_argument("--bootstrap", type=int, default=200, metavar="N",
                     help="bootstrap replicates for the intervals (default: 200; 0: no intervals)")
    fit.add_argument("--level", type=float, default=0.95, help="interval level (default: 0.95)")
    fit.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    fit.add_argument("--eval-draws", metavar="N", help="completions scored per evaluation, prompts x samples per "
                     "prompt (e.g. 1000x16): fixes the evaluation noise at p(1-p)/N (default: estimated)")
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", help="write the JSON, report.md, report.html and PNGs into DIR")
    out.add_argument("--json", action="store_true", help="print exactly one JSON object instead of the report")


def _options(args: argparse.Namespace, targets: str = ""):
    budgets = tuple(parse_gpu_hours(b, "--budgets") for b in args.budgets.split(",") if b.strip())
    return ForecastOptions(
        min_compute=parse_gpu_hours(args.min_compute, "--min-compute"),
        fit_until=None if args.fit_until is None else parse_gpu_hours(args.fit_until, "--fit-until"),
        r0=args.r0, method=args.method, budgets=budgets, targets=_rewards(targets), resamples=args.bootstrap,
        level=args.level, seed=args.seed, eval_draws=_eval_draws(args.eval_draws))


def _eval_draws(text: str | None) -> int | None:
    """'16000' or '1000x16' (prompts x samples per prompt) -> 16000."""
    if text is None:
        return None
    try:
        return math.prod(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise UserError(f"--eval-draws: '{text}' is not a count (e.g. 16000 or 1000x16)") from None


def _rewards(text: str) -> tuple[float, ...]:
    values = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            values.append(float(item))
        except ValueError:
            raise UserError(f"--target: '{item}' is not a reward (e.g. 0.6)") from None
    return tuple(values)


def _load(args: argparse.Namespace, path: str):
    return load_curve(path, metric=args.metric, compute_col=args.compute_col, gpus=args.gpus)


def _fit(args: argparse.Namespace) -> int:
    forecast = make_forecast(_load(args, args.run), _options(args, args.target))
    png = plots.forecast_png(forecast) if args.out else b""
    report.emit(report.forecast_document(forecast, png), "forecast.json", forecast.to_dict(), out=args.out,
                as_json=args.json)
    return 0


def _compare(args: argparse.Namespace) -> int:
    comparison = compare_runs([_load(args, run) for run in args.runs], _options(args))
    pngs = (plots.compare_png(comparison), plots.linearised_png(comparison)) if args.out else (b"", b"")
    report.emit(report.compare_document(comparison, *pngs), "compare.json", comparison.to_dict(), out=args.out,
                as_json=args.json)
    return 0


def _backtest(args: argparse.Namespace) -> int:
    backtest = run_backtest(_load(args, args.run), _options(args))
    png = plots.forecast_png(backtest.forecast, show_budgets=False) if args.out else b""
    report.emit(report.backtest_document(backtest, png), "backtest.json", backtest.to_dict(), out=args.out,
                as_json=args.json)
    return 0
