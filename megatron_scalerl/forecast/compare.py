"""Compare runs: who is ahead at each budget, where the curves cross, and the paper's shared-A rule.

The paper's rule: two runs whose ceilings A differ by less than its +-0.02 margin cannot be told apart by A; refit
both with the mean A held fixed and compare B (the higher B reaches the shared ceiling with less compute). The refits
use the `lsq` method whatever the main method is (the paper's grid has no fixed-A form).

Linearised view: with F(R) = C_mid ** B / ((A - R0) / (R - R0) - 1) the sigmoid reads F(R) = C ** B, so a run's
evaluations lie on the line log F = B log C; runs are plotted with their shared-A refits when all ceilings agree
within the margin, else with their own fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np
from scipy.optimize import brentq

from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast.data import Curve
from megatron_scalerl.forecast.predict import A_MARGIN, Forecast, ForecastOptions, format_gpu_hours, make_forecast
from megatron_scalerl.forecast.sigmoid import SigmoidFit, fit_sigmoid


@dataclass(frozen=True)
class Comparison:
    forecasts: list[Forecast]
    budgets: list[dict]  # per budget: gpu_hours, leader, clear (intervals do not overlap), rewards by run
    pairs: list[dict]  # per pair: runs, A_difference, crossovers (GPU-h), shared_A refit or None
    linearised: list[SigmoidFit]  # the fits the linearised plot uses, one per run
    linearised_shared_A: bool

    @property
    def names(self) -> list[str]:
        return [f.curve.name for f in self.forecasts]

    def recommendation(self) -> str:
        top = self.budgets[-1]
        best = top["leader"]
        by_A = sorted(self.forecasts, key=lambda f: f.fit.A, reverse=True)
        if by_A[0].fit.A - by_A[1].fit.A < A_MARGIN:
            tied = [p for p in self.pairs if p["shared_A"] and best in p["runs"]]
            efficiency = ""
            if tied:
                shared = tied[0]["shared_A"]
                efficiency = (f" With a shared A = {shared['A']:.3f}, {shared['more_efficient']} has the higher "
                              f"exponent B, i.e. it reaches the ceiling with less compute.")
            reason = (f"the ceilings of {by_A[0].curve.name} and {by_A[1].curve.name} agree within the paper's "
                      f"+-{A_MARGIN} margin, so the choice rests on efficiency.{efficiency}")
        else:
            reason = (f"{by_A[0].curve.name} has the highest ceiling (A = {by_A[0].fit.A:.3f} vs "
                      f"{by_A[1].fit.A:.3f} for {by_A[1].curve.name}).")
        confidence = "" if top["clear"] else " Its lead there is inside the confidence intervals."
        weak = [f.curve.name for f in self.forecasts if not f.identifiable]
        caveat = f" Caution: the fits of {', '.join(weak)} are not yet identifiable." if weak else ""
        return (f"Give the compute to {best}: it is predicted to lead at {format_gpu_hours(top['gpu_hours'])} "
                f"GPU-h ({top['rewards'][best]['reward']:.3f}); {reason}{confidence}{caveat}")

    def to_dict(self) -> dict:
        return {"schema": "scalerl.forecast-compare/1",
                "runs": {f.curve.name: f.to_dict() for f in self.forecasts},
                "budgets": self.budgets, "pairs": self.pairs,
                "linearised": {"shared_A": self.linearised_shared_A,
                               "fits": {n: {"A": f.A, "B": f.B, "C_mid": f.C_mid, "R0": f.R0}
                                        for n, f in zip(self.names, self.linearised, strict=True)}},
                "recommendation": self.recommendation()}


def compare_runs(curves: list[Curve], options: ForecastOptions | None = None) -> Comparison:
    """Forecast each run with the same options (default: `ForecastOptions()`), then rank and pair them."""
    options = options or ForecastOptions()
    if len(curves) < 2:
        raise UserError("compare needs at least two runs")
    names = [c.name for c in curves]
    if len(set(names)) < len(names):  # e.g. two runs/<x>/metrics.jsonl: fall back to the full paths
        curves = [Curve(c.source, c.source, c.metric, c.compute, c.reward, c.compute_rule) for c in curves]
        if len({c.name for c in curves}) < len(curves):
            raise UserError("compare: the same run is given twice")
    forecasts = [make_forecast(c, options) for c in curves]
    pairs = [_pair(a, b, options) for a, b in combinations(forecasts, 2)]
    spread = max(f.fit.A for f in forecasts) - min(f.fit.A for f in forecasts)
    shared = spread < A_MARGIN
    if shared:
        mean_A = float(np.mean([f.fit.A for f in forecasts]))
        linearised = [_refit_with_A(f, mean_A) for f in forecasts]
    else:
        linearised = [f.fit for f in forecasts]
    return Comparison(forecasts, _leaders(forecasts, options), pairs, linearised, shared)


def log_f(fit: SigmoidFit, compute: np.ndarray, reward: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log C, log F(R)) for the evaluations with R0 < R < A, where F(R) is defined; natural logs."""
    ok = (reward > fit.R0) & (reward < fit.A) & (compute > 0)
    ratio = (fit.A - fit.R0) / (reward[ok] - fit.R0) - 1.0
    return np.log(compute[ok]), fit.B * np.log(fit.C_mid) - np.log(ratio)


def _leaders(forecasts: list[Forecast], options: ForecastOptions) -> list[dict]:
    rows = []
    preds = {f.curve.name: {p["gpu_hours"]: p for p in f.predictions()} for f in forecasts}
    for budget in sorted(options.budgets):
        rewards = {name: preds[name][budget] for name in preds}
        order = sorted(rewards, key=lambda n: rewards[n]["reward"], reverse=True)
        first, second = rewards[order[0]], rewards[order[1]]
        clear = first["lo"] is not None and first["lo"] > second["hi"]
        rows.append({"gpu_hours": budget, "leader": order[0], "clear": bool(clear), "rewards": rewards})
    return rows


def _pair(a: Forecast, b: Forecast, options: ForecastOptions) -> dict:
    low = min(a.curve.compute[a.in_fit][0], b.curve.compute[b.in_fit][0])
    high = max(max(options.budgets), a.fitted_until, b.fitted_until)
    shared = None
    if abs(a.fit.A - b.fit.A) < A_MARGIN:
        mean_A = (a.fit.A + b.fit.A) / 2.0
        fa, fb = _refit_with_A(a, mean_A), _refit_with_A(b, mean_A)
        shared = {"A": mean_A, "B": {a.curve.name: fa.B, b.curve.name: fb.B},
                  "C_mid": {a.curve.name: fa.C_mid, b.curve.name: fb.C_mid},
                  "more_efficient": a.curve.name if fa.B >= fb.B else b.curve.name}
    return {"runs": [a.curve.name, b.curve.name], "A_difference": a.fit.A - b.fit.A,
            "crossovers": crossovers(a.fit, b.fit, low, high), "shared_A": shared}


def _refit_with_A(forecast: Forecast, A: float) -> SigmoidFit:
    C, y = forecast.curve.compute[forecast.in_fit], forecast.curve.reward[forecast.in_fit]
    return fit_sigmoid(C, y, forecast.fit.R0, "lsq", fixed_A=A)


def crossovers(a: SigmoidFit, b: SigmoidFit, low: float, high: float) -> list[float]:
    """GPU-hours in [low, high] where the two fitted curves cross (one overtakes the other)."""
    grid = np.geomspace(low, high, 512)
    diff = a.predict(grid) - b.predict(grid)
    found = []
    for i in np.flatnonzero(np.sign(diff[:-1]) * np.sign(diff[1:]) < 0):
        found.append(float(brentq(lambda c: float(a.predict(c) - b.predict(c)), grid[i], grid[i + 1])))
    return found
