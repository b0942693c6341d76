"""One run's forecast: choose the fit window, fit the sigmoid and the power law, bootstrap, predict, recommend.

`make_forecast(curve, options)` does all of it; `Forecast.to_dict()` is the content of forecast.json:

    {"fit": {"A": {"value", "interval", "paper_margin"}, "B": {...}, "C_mid": {...}, "R0": {...}, ...},
     "predictions": [{"gpu_hours", "reward", "lo", "hi"}, ...], "targets": [...], "current": {...},
     "power_law": {...}, "warnings": [...], "recommendation": "..."}

Intervals are bootstrap intervals at `options.level` (null when `resamples` is 0; see `uncertainty`): predictions
cover the run's own pass rate at each budget (the curve plus the run's drift), parameters and targets the curve's.
Compute is GPU-hours.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast.data import Curve
from megatron_scalerl.forecast.powerlaw import PowerLawFit, fit_power_law
from megatron_scalerl.forecast.sigmoid import METHODS, SigmoidFit, fit_sigmoid
from megatron_scalerl.forecast.uncertainty import Bootstrap, bootstrap_sigmoid

MIN_POINTS = 5  # three fitted parameters plus two degrees of freedom for the residual
FIT_ERRORS = (UserError, ValueError, RuntimeError, FloatingPointError)  # what reading or fitting one run may raise
A_MARGIN = 0.02  # the paper's run-to-run margin on A
WIDE_A_INTERVAL = 0.1  # an A interval wider than this means the ceiling is not pinned down
RELIABLE_EXTRAPOLATION = 4.0  # the paper validated predictions 2-3x beyond the fitted compute
DIMINISHING_RETURNS = 0.9  # fraction of the attainable gain after which more compute is poorly spent
NO_GAIN = 1e-3  # A - R0 below this: the run is not improving


@dataclass(frozen=True)
class ForecastOptions:
    min_compute: float = 1500.0  # GPU-h; earlier points are left out (paper: about one epoch, the noisy start)
    fit_until: float | None = None  # GPU-h; fit only the points up to here, the rest is held out
    r0: float | None = None  # reward at zero RL compute; default: the first evaluation
    method: str = "lsq"
    budgets: tuple[float, ...] = (16000.0, 50000.0, 100000.0)  # GPU-h
    targets: tuple[float, ...] = ()  # rewards to reach
    resamples: int = 200  # bootstrap replicates; 0 disables intervals
    level: float = 0.95
    seed: int = 0
    eval_draws: int | None = None  # completions scored per evaluation (prompts x samples); None: noise estimated

    def __post_init__(self):
        if self.method not in METHODS:
            raise UserError(f"--method: unknown fit method '{self.method}' (choose {', '.join(METHODS)})")
        if not 0 < self.level < 1:
            raise UserError(f"--level must be in (0, 1), got {self.level}")
        if self.resamples < 0:
            raise UserError(f"--bootstrap must be >= 0, got {self.resamples}")
        if self.eval_draws is not None and self.eval_draws < 1:
            raise UserError(f"--eval-draws must be >= 1 (prompts x samples per prompt), got {self.eval_draws}")
        if self.r0 is not None and not 0 <= self.r0 < 1:
            raise UserError(f"--r0 must be in [0, 1), got {self.r0}")
        if not self.budgets or min(self.budgets) <= 0:
            raise UserError(f"--budgets: give one or more GPU-hour budgets > 0, got {list(self.budgets)}")
        if any(not 0 <= t <= 1 for t in self.targets):
            raise UserError(f"--target: rewards must be in [0, 1], got {list(self.targets)}")
        if self.fit_until is not None and self.fit_until <= self.min_compute:
            raise UserError(f"--fit-until {self.fit_until:g} must be above --min-compute {self.min_compute:g}")


def fit_window(curve: Curve, options: ForecastOptions) -> np.ndarray:
    """Boolean mask of the fitted points: C > 0, C >= min_compute and (if set) C <= fit_until."""
    mask = (curve.compute > 0) & (curve.compute >= options.min_compute)
    if options.fit_until is not None:
        mask &= curve.compute <= options.fit_until
    if mask.sum() < MIN_POINTS:
        until = f" and --fit-until {options.fit_until:g}" if options.fit_until is not None else ""
        run_max = float(curve.compute.max()) if curve.compute.size else 0.0
        hint = (f"; the run's evaluations reach only {run_max:.3g} GPU-h: lower --min-compute (the paper's 1500 "
                "GPU-h skips a run's noisy start; 0 fits a small run whole)"
                if curve.compute.size >= MIN_POINTS and run_max < options.min_compute else "")
        raise UserError(f"{curve.source}: only {int(mask.sum())} of {curve.compute.size} evaluations fall in the fit "
                        f"window (--min-compute {options.min_compute:g}{until} GPU-h); the fit needs at least "
                        f"{MIN_POINTS}{hint}")
    return mask


@dataclass(frozen=True)
class Forecast:
    curve: Curve
    options: ForecastOptions
    in_fit: np.ndarray  # bool, shape (n,): the fitted points
    fit: SigmoidFit
    boot: Bootstrap | None
    power: PowerLawFit
    warnings: tuple[str, ...] = ()
    identifiable: bool = True

    @property
    def fitted_until(self) -> float:
        """The last fitted compute, GPU-h: 'now' for the marginal gain and the recommendation."""
        return float(self.curve.compute[self.in_fit][-1])

    def param_interval(self, name: str) -> tuple[float, float] | None:
        if self.boot is None or (name == "R0" and self.options.r0 is not None):
            return None
        return self.boot.interval(getattr(self.boot, name))

    def predictions(self) -> list[dict]:
        budgets = sorted(self.options.budgets)
        rewards = self.fit.predict(budgets)
        draws = self.boot.rewards(budgets) if self.boot else None
        out = []
        for i, budget in enumerate(budgets):
            lo, hi = self.boot.interval(draws[:, i]) if draws is not None else (None, None)
            out.append({"gpu_hours": budget, "reward": float(rewards[i]), "lo": lo, "hi": hi})
        return out

    def targets(self) -> list[dict]:
        """GPU-hours to reach each target reward; inf (null in JSON) where the curve never gets there."""
        out = []
        for target in self.options.targets:
            needed = self.fit.compute_for(target)
            lo, hi = self.boot.interval(self.boot.compute_to_reach(target)) if self.boot else (None, None)
            out.append({"reward": target, "gpu_hours": needed, "lo": lo, "hi": hi, "reachable": math.isfinite(needed)})
        return out

    def current(self) -> dict:
        now = self.fitted_until
        fitted = float(self.fit.predict(now))
        slope = self.fit.slope(now) * 1000.0
        slope_interval = self.boot.interval(self.boot.slopes(now) * 1000.0) if self.boot else None
        return {"gpu_hours": now, "observed": float(self.curve.reward[self.in_fit][-1]), "fitted": fitted,
                "marginal_gain_per_1k_gpu_hours": slope, "marginal_gain_interval": slope_interval,
                "fraction_of_asymptote": fitted / self.fit.A,
                "fraction_of_gain": (fitted - self.fit.R0) / (self.fit.A - self.fit.R0)
                if self.fit.A > self.fit.R0 else None}

    def power_law_note(self) -> str:
        gap = self.power.A - self.fit.A
        if abs(gap) <= A_MARGIN:
            return f"The power law's ceiling ({self.power.A:.3f}) agrees with the sigmoid's within +-{A_MARGIN}."
        side = "above" if gap > 0 else "below"
        return (f"The power law's ceiling ({self.power.A:.3f}) is {abs(gap):.3f} {side} the sigmoid's "
                f"({self.fit.A:.3f}); on saturating curves power laws overestimate the ceiling (paper, A.4), "
                "so trust the sigmoid.")

    def recommendation(self) -> str:
        fit, now = self.fit, self.fitted_until
        if fit.A - fit.R0 <= NO_GAIN:
            return (f"No measurable gain: the metric does not rise above R0 = {fit.R0:.3f} in the fitted window; "
                    "check the run (learning rate, rewards, evaluation) before giving it more compute.")
        if not self.identifiable:
            return (f"Too early to call: {self.warnings[0]}. Keep training and refit after about "
                    f"{format_gpu_hours(max(2 * now, min(fit.C_mid, 10 * now)))} GPU-h.")
        current = self.current()
        horizon = max(max(self.options.budgets), 2 * now)  # the largest budget, or 2x now when all are behind us
        reward = float(fit.predict(horizon))
        gain = reward - current["fitted"]
        ceiling = f"ceiling A = {fit.A:.3f} +-{A_MARGIN}"
        if current["fraction_of_gain"] >= DIMINISHING_RETURNS:
            return (f"Diminishing returns: the run has reached {current['fraction_of_gain']:.0%} of its predicted "
                    f"gain ({ceiling}); going from {format_gpu_hours(now)} to {format_gpu_hours(horizon)} GPU-h "
                    f"adds only {gain:+.3f}. Spend further compute on a recipe with a higher ceiling rather than "
                    "on this run.")
        band = ""
        if self.boot is not None:
            lo, hi = self.boot.interval(self.boot.rewards([horizon])[:, 0])
            band = f" [{lo:.3f}, {hi:.3f}]"
        return (f"Worth continuing: the run is at {current['fraction_of_gain']:.0%} of its predicted gain and still "
                f"gains {current['marginal_gain_per_1k_gpu_hours']:.4f} per 1k GPU-h; {format_gpu_hours(horizon)} "
                f"GPU-h is predicted to reach {reward:.3f}{band} ({gain:+.3f} over now), {ceiling}.")

    def to_dict(self) -> dict:
        fit = self.fit

        def param(name: str, value: float) -> dict:
            return {"value": value, "interval": _pair(self.param_interval(name))}

        r0_source = "given (--r0)" if self.options.r0 is not None else "first evaluation"
        fitted = self.curve.compute[self.in_fit]
        return {
            "schema": "scalerl.forecast/1",
            "run": self.curve.name, "source": self.curve.source, "metric": self.curve.metric,
            "compute": {"unit": "GPU-hours", "rule": self.curve.compute_rule},
            "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.options).items()},
            "window": {"min_compute": self.options.min_compute, "fit_until": self.options.fit_until,
                       "first": float(fitted[0]), "last": float(fitted[-1]), "points": int(self.in_fit.sum()),
                       "points_total": int(self.curve.compute.size)},
            "fit": {"method": fit.method, "A": {**param("A", fit.A),
                                                "paper_margin": [fit.A - A_MARGIN, fit.A + A_MARGIN]},
                    "B": param("B", fit.B), "C_mid": param("C_mid", fit.C_mid),
                    "R0": {**param("R0", fit.R0), "source": r0_source}, "rmse": fit.rmse,
                    "at_bounds": list(fit.at_bounds), "identifiable": self.identifiable,
                    "bootstrap": None if self.boot is None else {
                        "resamples": self.boot.resamples, "level": self.boot.level, "seed": self.boot.seed,
                        "noise": self.boot.noise.summary()}},
            "predictions": self.predictions(),
            "targets": self.targets(),
            "current": {k: (_pair(v) if isinstance(v, tuple) else v) for k, v in self.current().items()},
            "power_law": {"A": self.power.A, "B": self.power.B, "D": self.power.D, "rmse": self.power.rmse,
                          "agrees_with_sigmoid": abs(self.power.A - fit.A) <= A_MARGIN,
                          "note": self.power_law_note()},
            "warnings": list(self.warnings),
            "recommendation": self.recommendation(),
        }


def make_forecast(curve: Curve, options: ForecastOptions | None = None) -> Forecast:
    """Fit `curve` in the window `options` (default: `ForecastOptions()`) describes; derive every reported number."""
    options = options or ForecastOptions()
    in_fit = fit_window(curve, options)
    r0 = curve.reward[0] if options.r0 is None else options.r0
    if r0 >= 1.0:
        raise UserError(f"{curve.source}: R0 = {r0:g} (the first evaluation) leaves no room to improve; pass --r0")
    C, y = curve.compute[in_fit], curve.reward[in_fit]
    fit = fit_sigmoid(C, y, r0, options.method)
    boot = (bootstrap_sigmoid(C, y, fit, options.r0 is None, options.resamples, options.level, options.seed,
                              options.eval_draws) if options.resamples else None)
    power = fit_power_law(C, y)
    now = float(C[-1])
    if fit.A - fit.R0 <= NO_GAIN:
        weak = [f"the fit finds no gain over R0 = {fit.R0:.3f} (the metric is flat or falling)"]
    elif now < fit.C_mid:
        weak = [f"the curve has not bent yet: the last fitted point ({format_gpu_hours(now)} GPU-h) is below C_mid "
                f"({format_gpu_hours(fit.C_mid)} GPU-h), so the ceiling A is an extrapolation"]
    else:
        weak = []
    weak += [f"{name} ended on its search bound; the data do not pin it down" for name in fit.at_bounds]
    if boot is not None:
        lo, hi = boot.interval(boot.A)
        if hi - lo > WIDE_A_INTERVAL:
            weak.append(f"A's {options.level:.0%} interval [{lo:.3f}, {hi:.3f}] is wider than {WIDE_A_INTERVAL}")
    notes = []
    if max(options.budgets) > RELIABLE_EXTRAPOLATION * now:
        notes.append(f"budgets beyond {RELIABLE_EXTRAPOLATION:g}x the fitted compute ({format_gpu_hours(now)} GPU-h) "
                     "are less reliable; the paper validated extrapolations of 2-3x")
    return Forecast(curve, options, in_fit, fit, boot, power, tuple(weak + notes), identifiable=not weak)


def format_gpu_hours(value: float) -> str:
    """GPU-hours for prose: 16k, 1.5k, 850, 2.3M."""
    if value >= 1e6:
        return f"{value / 1e6:.3g}M"
    if value >= 1e3:
        return f"{value / 1e3:.3g}k"
    return f"{value:.3g}"


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _pair(values: tuple[float, float] | None) -> list[float | None] | None:
    return None if values is None else [_finite(v) for v in values]
