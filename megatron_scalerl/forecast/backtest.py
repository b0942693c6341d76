"""Backtest: fit a prefix of a run (up to `fit_until` GPU-h), predict the held-out rest, score the predictions.

Each held-out evaluation gets the prediction, its error (predicted - observed) and a prediction interval for an
evaluation (the bootstrap's interval for the run's pass rate there, drift included, plus evaluation noise);
coverage is the fraction of held-out evaluations inside their interval, to be compared with the nominal level.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast.data import Curve
from megatron_scalerl.forecast.predict import Forecast, ForecastOptions, format_gpu_hours, make_forecast


@dataclass(frozen=True)
class Backtest:
    forecast: Forecast  # the fit on the prefix
    held_out: np.ndarray  # bool, shape (n,): evaluations after fit_until
    predicted: np.ndarray  # shape (m,), m = held_out.sum()
    lo: np.ndarray | None  # prediction interval per held-out evaluation, or None without bootstrap
    hi: np.ndarray | None

    @property
    def observed(self) -> np.ndarray:
        return self.forecast.curve.reward[self.held_out]

    @property
    def errors(self) -> np.ndarray:
        return self.predicted - self.observed

    @property
    def coverage(self) -> float | None:
        if self.lo is None:
            return None
        return float(np.mean((self.observed >= self.lo) & (self.observed <= self.hi)))

    def summary(self) -> dict:
        errors = np.abs(self.errors)
        return {"fit_until": self.forecast.options.fit_until, "held_out_points": int(self.held_out.sum()),
                "mean_abs_error": float(errors.mean()), "max_abs_error": float(errors.max()),
                "final_error": float(self.errors[-1]), "coverage": self.coverage,
                "level": self.forecast.options.level}

    def verdict(self) -> str:
        s = self.summary()
        tail = self.forecast.curve.compute[self.held_out]
        text = (f"The fit to {format_gpu_hours(s['fit_until'])} GPU-h predicted the held-out "
                f"{format_gpu_hours(tail[0])}-{format_gpu_hours(tail[-1])} GPU-h within {s['mean_abs_error']:.4f} "
                f"on average (max {s['max_abs_error']:.4f}, final point {s['final_error']:+.4f})")
        if s["coverage"] is not None:
            text += (f"; {s['coverage']:.0%} of held-out evaluations fell inside the {s['level']:.0%} prediction "
                     "interval")
        return text + "."

    def to_dict(self) -> dict:
        compute = self.forecast.curve.compute[self.held_out]
        points = [{"gpu_hours": float(c), "observed": float(o), "predicted": float(p), "error": float(p - o),
                   "lo": None if self.lo is None else float(self.lo[i]),
                   "hi": None if self.hi is None else float(self.hi[i])}
                  for i, (c, o, p) in enumerate(zip(compute, self.observed, self.predicted, strict=True))]
        return {"schema": "scalerl.forecast-backtest/1", "summary": self.summary(), "points": points,
                "verdict": self.verdict(), "forecast": self.forecast.to_dict()}


def run_backtest(curve: Curve, options: ForecastOptions) -> Backtest:
    """Fit the evaluations up to `options.fit_until` GPU-h and score the prediction of the ones after it."""
    if options.fit_until is None:
        raise UserError("backtest needs --fit-until C (GPU-hours): the end of the fitted prefix")
    held_out = curve.compute > options.fit_until
    if not held_out.any():
        raise UserError(f"{curve.source}: no evaluation after --fit-until {options.fit_until:g} GPU-h (the last is "
                        f"at {curve.compute[-1]:g}); nothing to backtest")
    forecast = make_forecast(curve, options)
    compute = curve.compute[held_out]
    lo, hi = forecast.boot.observation_interval(compute) if forecast.boot is not None else (None, None)
    return Backtest(forecast, held_out, forecast.fit.predict(compute), lo, hi)
