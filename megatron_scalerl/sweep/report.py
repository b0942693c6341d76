"""The ablation report of a sweep (`scalerl sweep report DIR`, run by the sweep itself when its last run is done),
or of runs made any other way (`scalerl sweep report --runs BASE RUN ...`, the first is the base).

Each run's curve is its validation pass rate against GPU-hours (`forecast.data.load_curve`); a variant's seeds are
its curves. The fits and verdicts are `forecast.ablation.make_ablation`'s, with one set of forecast options for all
runs: the base's (`forecast.live.recipe_options` of its RUN/recipe.yaml: its `forecast` section, `min_compute`,
`budgets`, `resamples`, `target`, and its validation's own noise, held-out prompts x samples per prompt), as the
demo's end-of-run forecast uses them. A variant whose own recipe scores another number of completions per validation
(it changes data.validation_*) is named in the report's warnings: its noise is modelled with the base's.

Left out, each under `left_out` in ablation.json ({"variant", "run", "reason"}), in the report's "Left out" section
and on stderr: in a sweep the runs that are not done (`runs.not_done`, the sweep's own definition: "not finished",
"not extended yet", or a last launch that failed), and everywhere the runs that cannot be read or fitted (too few
evaluations in the fit window, `forecast.predict.fit_window`, or a fit that fails: the error). When the base or every
variant is left without a run there is no report: a UserError says why.

Beside the verdicts, each run's forecast backtest (`backtests`: fitted on the first half of its GPU-hours, scored on
the second), as `scalerl forecast backtest RUN --fit-until HALF` makes it.

Output: the report in markdown on stdout (with `--json`: exactly one JSON object, ablation.json's content), and its
files (ablation.json, report.md, report.html, PNG; `forecast.report.emit`) in `SWEEP/report/` or
`--out DIR`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast import plots
from megatron_scalerl.forecast import report as documents
from megatron_scalerl.forecast.ablation import make_ablation
from megatron_scalerl.forecast.backtest import run_backtest
from megatron_scalerl.forecast.data import MetricsTable
from megatron_scalerl.forecast.design import POWER_TRIALS, Design
from megatron_scalerl.forecast.live import recipe_options
from megatron_scalerl.forecast.predict import FIT_ERRORS, ForecastOptions, make_forecast
from megatron_scalerl.recipe import Recipe, load_run_recipe
from megatron_scalerl.run.directory import RECIPE_FILE, read_finished
from megatron_scalerl.sweep.manifest import ordered_runs
from megatron_scalerl.sweep.plan import BASE_VARIANT
from megatron_scalerl.sweep.runs import not_done

if TYPE_CHECKING:
    from megatron_scalerl.forecast.ablation import Ablation
    from megatron_scalerl.forecast.data import Curve, MetricsTable
    from megatron_scalerl.forecast.predict import ForecastOptions

REPORT_DIR = "report"
DOMAIN_CURVE = re.compile(r"^val/[^/]+/pass_rate$")  # a domain's validation (recipes with several domains)


@dataclass(frozen=True)
class ReportRun:
    """One run of the report: its variant, its curve, its recipe (None: it has no RUN/recipe.yaml) and its metrics
    (the domain curves are read from them)."""

    variant: str
    curve: Curve
    recipe: Recipe | None
    metrics: MetricsTable


def _read(variant: str, run_dir: Path, label: str) -> ReportRun:
    """The run in `run_dir`, its curve named `label`."""

    recipe = load_run_recipe(run_dir, RECIPE_FILE, missing_ok=True)
    metrics = MetricsTable.read(run_dir)
    return ReportRun(variant, replace(metrics.curve(), name=label), recipe, metrics)


def _left(variant: str, run: Path | str, reason: str) -> dict:
    return {"variant": variant, "run": str(run), "reason": reason}


def _failure(exc: Exception) -> str:
    return str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"


def sweep_runs(sweep_dir: Path, manifest: dict) -> tuple[str, list[ReportRun], list[dict]]:
    """(the base's name, the sweep's done runs in `ordered_runs` order, one `left_out` entry for each of the
    others)."""
    runs: list[ReportRun] = []
    left_out: list[dict] = []
    for key in ordered_runs(manifest):
        entry = manifest["runs"][key]
        run_dir = sweep_dir / entry["run_dir"]
        try:
            why = not_done(entry, read_finished(run_dir), manifest.get("steps"), manifest.get("budget"))
            if why is None:
                runs.append(_read(entry["variant"], run_dir, entry["variant"]))
        except FIT_ERRORS as exc:
            why = _failure(exc)
        if why is not None:
            left_out.append(_left(entry["variant"], run_dir, why))
    return BASE_VARIANT, runs, left_out


def _labels(runs: list[Path]) -> list[str]:
    """Each run's shortest trailing path that no other run shares (`seed0`, else `base/seed0`, ...)."""
    parts = [r.resolve().parts for r in runs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    raise UserError(f"--runs: the same run is given twice ({', '.join(sorted({str(r) for r in runs}))})")


def given_runs(run_dirs: list[Path]) -> tuple[str, list[ReportRun], list[dict]]:
    """(the base's label, the runs of `--runs BASE RUN ...`, one per variant labelled by the end of its path; one
    `left_out` entry for each that cannot be read)."""
    if len(run_dirs) < 2:
        raise UserError("--runs: give the base run and at least one other (--runs BASE RUN ...)")
    labels = _labels(run_dirs)
    runs: list[ReportRun] = []
    left_out: list[dict] = []
    for run_dir, label in zip(run_dirs, labels, strict=True):
        try:
            runs.append(_read(label, run_dir, label))
        except FIT_ERRORS as exc:
            left_out.append(_left(label, run_dir, _failure(exc)))
    return labels[0], runs, left_out


def _options(runs: list[ReportRun], base: str) -> ForecastOptions:
    """The ablation's ForecastOptions, one for all runs: those of the base's first run's recipe, else the
    forecaster's defaults."""

    first = next((r for r in runs if r.variant == base), None)
    if first is not None and first.recipe is not None:
        return recipe_options(first.recipe)
    if first is not None:
        print(f"report: {first.curve.source} has no {RECIPE_FILE}: the forecaster's default settings are used",
              file=sys.stderr, flush=True)
    return ForecastOptions()


def _draws_warnings(runs: list[ReportRun], base: str, options: ForecastOptions) -> list[str]:
    """One warning for each variant whose runs' own recipes score another number of completions per validation than
    `options` (the base's) models."""

    warnings = []
    for variant in dict.fromkeys(r.variant for r in runs if r.variant != base):
        draws = sorted({recipe_options(r.recipe).eval_draws or 0 for r in runs if r.variant == variant and r.recipe})
        if draws and draws != [options.eval_draws or 0]:
            warnings.append(f"{variant}: its validation scores {' or '.join(map(str, draws))} completions per "
                            f"evaluation (data.validation_holdout x data.validation_generations; 0: none), the base's "
                            f"{options.eval_draws or 0}: its evaluation noise is modelled with the base's")
    return warnings


def _fittable(runs: list[ReportRun], options, left_out: list[dict]) -> list[ReportRun]:
    """The runs whose point fit succeeds with `options` (each in its own try: a failure leaves that run out, with
    its path and the error, in `left_out`)."""

    kept = []
    for run in runs:
        try:
            make_forecast(run.curve, replace(options, resamples=0))
            kept.append(run)
        except FIT_ERRORS as exc:
            left_out.append(_left(run.variant, run.curve.source, _failure(exc)))
    return kept


def backtests(runs: list[ReportRun], options: ForecastOptions) -> list[dict]:
    """Each run's forecast backtest (`forecast.backtest.run_backtest`, what `scalerl forecast backtest` does): its
    curve fitted up to half its last validation's GPU-hours with `options`, the rest predicted and scored. One dict
    per run: {"variant", "run"} and the backtest's summary, or "error" (too few validations in the first half)."""
    out = []
    for run in runs:
        half = float(run.curve.compute[-1]) / 2
        entry = {"variant": run.variant, "run": str(run.curve.source)}
        try:
            out.append({**entry, **run_backtest(run.curve, replace(options, fit_until=half)).summary()})
        except FIT_ERRORS as exc:
            out.append({**entry, "fit_until": half, "error": _failure(exc)})
    return out


def report(base: str, runs: list[ReportRun], left_out: list[dict], out: Path | None, as_json: bool,
           power_designs: tuple[Design, ...] = (), power_trials: int = POWER_TRIALS) -> list[Path]:
    """Fit, judge, print (markdown, or one JSON object with `as_json`) and, with `out`, write the report of `runs`
    (those of variant `base` are the base's) with `left_out`; the files written. The power is simulated from
    `power_trials` studies of this design and of each of `power_designs` (`design.Design`: seeds per recipe,
    completions per validation, runs' length) of studies to come. UserError when the base or every variant has no
    run left to fit."""

    options = _options(runs, base)
    runs = _fittable(runs, options, left_out)
    warnings = _draws_warnings(runs, base, options)
    for entry in left_out:
        print(f"report: {entry['variant']}: left out {entry['run']}: {entry['reason']}", file=sys.stderr, flush=True)
    groups = {variant: [r.curve for r in runs if r.variant == variant] for variant in dict.fromkeys(
        r.variant for r in runs)}
    base_curves = groups.pop(base, [])
    if not base_curves or not groups:
        whose = [e for e in left_out if (e["variant"] == base) == (not base_curves)]  # why the missing side is missing
        raise UserError(f"no ablation report: no run of {'the base' if not base_curves else 'any variant'} can be "
                        "fitted" + (f" ({whose[0]['run']}: {whose[0]['reason']})" if whose else ""))
    try:
        ablation = make_ablation(base_curves, list(groups.items()), options, power_trials=power_trials,
                                 power_designs=power_designs)
    except (ValueError, RuntimeError, FloatingPointError) as exc:  # a bootstrap refit, past each run's point fit
        raise UserError(f"no ablation report: a bootstrap refit failed ({type(exc).__name__}: {exc})") from None
    domains = domain_ablations(base, runs, options, warnings)
    data = documents.ablation_data(ablation, left_out, warnings, domains, backtests(runs, options))
    png = plots.ablation_png(ablation) if out is not None else b""
    pngs = {curve: plots.ablation_png(a) for curve, a in domains.items()} if out is not None else {}
    return documents.emit(documents.ablation_document(ablation, png, data, pngs), "ablation.json", data, out=out,
                          as_json=as_json)


def domain_ablations(base: str, runs: list[ReportRun], options: ForecastOptions, warnings: list[str]
                     ) -> dict[str, Ablation]:
    """{curve: its ablation} for every domain curve (`val/<domain>/pass_rate`, logged by recipes with several
    domains) that every run has, each judged like the primary curve with the noise of the domain's own validation
    (its `val/<domain>/samples` in the base's first run). A domain that cannot be fitted gets a warning instead."""

    logged = [{key: row for _, row in r.metrics.rows for key in row if DOMAIN_CURVE.match(key)} for r in runs]
    shared = sorted(set.intersection(*(set(keys) for keys in logged))) if logged else []
    ablations = {}
    for metric in shared:
        curve = metric.rsplit("/", 1)[0]
        samples = logged[next(i for i, r in enumerate(runs) if r.variant == base)][metric].get(f"{curve}/samples")
        try:
            curves = [replace(r.metrics.curve(metric), name=r.curve.name) for r in runs]
            groups: dict[str, list[Curve]] = {}
            for run, c in zip(runs, curves, strict=True):
                groups.setdefault(run.variant, []).append(c)
            base_curves = groups.pop(base)
            ablations[curve] = make_ablation(base_curves, list(groups.items()),
                                             replace(options, eval_draws=int(samples) if samples else None))
        except FIT_ERRORS as exc:
            warnings.append(f"{curve}: no ablation of this domain curve ({_failure(exc)})")
    return ablations


def report_sweep(sweep_dir: Path, manifest: dict, out: Path | None = None, as_json: bool = False,
                 power_designs: tuple[Design, ...] = (), power_trials: int = POWER_TRIALS) -> list[Path]:
    """The report of a sweep's done runs, written to `out` (default SWEEP/report/)."""
    return report(*sweep_runs(sweep_dir, manifest), out or sweep_dir / REPORT_DIR, as_json, power_designs,
                  power_trials)
