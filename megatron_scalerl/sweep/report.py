"""The ablation report of a sweep (`scalerl sweep report DIR`, run by the sweep itself when its last run is done),
or of runs made any other way (`scalerl sweep report --runs BASE RUN ...`, the first is the base).

Each run's curve is its validation pass rate against GPU-hours (`forecast.data.load_curve`); a variant's seeds are
its curves. The fits and verdicts are `forecast.ablation.make_ablation`'s, with the forecast settings of the base's
recipe (its `forecast` section: `min_compute`, `budgets`, `resamples`, `target`) and the validation's own noise
(held-out prompts x samples per prompt), as the demo's end-of-run forecast uses them. In a sweep only runs that
ended on their own (`RUN/finished.json`) count; the others are left out and named, as are runs with too few
evaluations in the fit window (`forecast.predict.fit_window`; they are listed under `left_out` in ablation.json).

Output: the report in markdown on stdout (with `--json`: exactly one JSON object, ablation.json's content), and its
files (ablation.json, report.md, report.html, PNG) in `SWEEP/report/` or `--out DIR`.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import Recipe, load_recipe
from megatron_scalerl.run_dir import read_finished
from megatron_scalerl.sweep.plan import BASE_VARIANT

REPORT_DIR = "report"


def forecast_settings(recipe: Recipe | None):
    """(ForecastOptions, target reward or None) from a recipe's forecast and data sections; the forecaster's
    defaults without one."""
    from megatron_scalerl.forecast.predict import ForecastOptions

    if recipe is None or recipe.forecast is None:
        return ForecastOptions(), None
    f, data = recipe.forecast, recipe.data
    options = ForecastOptions(min_compute=f.min_compute, budgets=tuple(f.budgets), resamples=f.resamples,
                              eval_draws=data.validation_holdout * data.validation_generations or None)
    return options, f.target


def _curve(run_dir: Path, label: str):
    from megatron_scalerl.forecast.data import load_curve

    return replace(load_curve(run_dir), name=label)


def sweep_curves(sweep_dir: Path, manifest: dict) -> tuple[list, list[tuple[str, list]], Recipe | None]:
    """(the base's curves, [(variant, its curves)], the base's recipe) of a sweep's finished runs."""
    by_variant: dict[str, list] = {name: [] for name in manifest["variants"]}
    left_out, recipe = [], None
    for key, entry in sorted(manifest["runs"].items(), key=lambda item: item[1]["seed_index"]):
        run_dir = sweep_dir / entry["run_dir"]
        if read_finished(run_dir) is None:
            left_out.append(key)
            continue
        by_variant[entry["variant"]].append(_curve(run_dir, entry["variant"]))
        if recipe is None and entry["variant"] == BASE_VARIANT:
            recipe = load_recipe(run_dir / "recipe.yaml")
    if left_out:
        print(f"report: left out {len(left_out)} run(s) that have not ended on their own: {', '.join(left_out)}",
              file=sys.stderr, flush=True)
    base = by_variant.pop(BASE_VARIANT)
    if not base:
        raise UserError(f"{sweep_dir}: no run of the base has finished yet: nothing to compare the variants with")
    variants = [(name, curves) for name, curves in by_variant.items() if curves]
    if not variants:
        raise UserError(f"{sweep_dir}: no run of any variant has finished yet")
    return base, variants, recipe


def _labels(runs: list[Path]) -> list[str]:
    """Each run's shortest trailing path that no other run shares (`seed0`, else `base/seed0`, ...)."""
    parts = [r.resolve().parts for r in runs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    raise UserError(f"--runs: the same run is given twice ({', '.join(sorted({str(r) for r in runs}))})")


def runs_curves(runs: list[Path]) -> tuple[list, list[tuple[str, list]], Recipe | None]:
    """(the base's curve, [(label, [curve])], the base's recipe) of `--runs BASE RUN ...`: one run per variant,
    labelled by the end of its path."""
    if len(runs) < 2:
        raise UserError("--runs: give the base run and at least one other (--runs BASE RUN ...)")
    labels = _labels(runs)
    curves = [_curve(r, label) for r, label in zip(runs, labels, strict=True)]
    recipe_file = runs[0] / "recipe.yaml"
    recipe = load_recipe(recipe_file) if recipe_file.is_file() else None
    if recipe is None:
        print(f"report: {runs[0]} has no recipe.yaml: the forecaster's default settings are used", file=sys.stderr)
    return [curves[0]], [(label, [c]) for label, c in zip(labels[1:], curves[1:], strict=True)], recipe


def _fittable(base: list, variants: list[tuple[str, list]], options) -> tuple[list, list, list[dict]]:
    """The runs whose curves have enough points in the fit window, and one {"variant", "run", "reason"} for each of
    the others; UserError when the base or every variant is left with none."""
    from megatron_scalerl.forecast.predict import fit_window

    left_out: list[dict] = []

    def keep(name: str, curves: list) -> list:
        kept = []
        for curve in curves:
            try:
                fit_window(curve, options)
                kept.append(curve)
            except UserError as exc:
                left_out.append({"variant": name, "run": curve.source, "reason": str(exc)})
        return kept

    base = keep(BASE_VARIANT, base)
    variants = [(name, kept) for name, curves in variants if (kept := keep(name, curves))]
    for entry in left_out:
        print(f"report: {entry['variant']}: left out {entry['reason']}", file=sys.stderr, flush=True)
    if not base or not variants:
        raise UserError(f"no ablation report: {'no run of the base' if not base else 'no run of any variant'} can be "
                        f"fitted ({left_out[0]['reason']})")
    return base, variants, left_out


def report(base: list, variants: list[tuple[str, list]], recipe: Recipe | None, out: Path | None,
           as_json: bool) -> list[Path]:
    """Fit, judge, print (markdown, or one JSON object with `as_json`) and, with `out`, write the report (its JSON
    adds `left_out`: the runs that could not be fitted, and why); the files written."""
    from megatron_scalerl.forecast import plots
    from megatron_scalerl.forecast import report as documents
    from megatron_scalerl.forecast.ablation import make_ablation

    options, target = forecast_settings(recipe)
    base, variants, left_out = _fittable(base, variants, options)
    ablation = make_ablation(base, variants, options, target)
    data = {**ablation.to_dict(), "left_out": left_out}
    document = documents.ablation_document(ablation, plots.ablation_png(ablation) if out else b"")
    if left_out:
        document.heading("Left out")
        document.items([f"{e['variant']}: {e['run']}: {e['reason']}" for e in left_out])
    if as_json:
        print(documents.dumps(data), flush=True)
    else:
        print(document.to_markdown(images=False), end="", flush=True)
    if out is None:
        return []
    written = documents.write_report(out, document, "ablation.json", data)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr if as_json else sys.stdout, flush=True)
    return written


def report_sweep(sweep_dir: Path, manifest: dict, out: Path | None = None, as_json: bool = False) -> list[Path]:
    """The report of a sweep's finished runs, written to `out` (default SWEEP/report/)."""
    base, variants, recipe = sweep_curves(sweep_dir, manifest)
    return report(base, variants, recipe, out or sweep_dir / REPORT_DIR, as_json)
