"""A run's forecast while it trains: the figures `metrics.jsonl` gets after each validation, and its status.

    live = live_forecast(curve, options, target=0.6)   # options: ForecastOptions (min_compute, budgets, resamples)
    live.status, live.reason                           # "on-track", "the curve has bent; ..."
    live.figures()                                     # {"forecast/A": 0.61, ..., "forecast/status": "on-track"}

Compute is the curve's GPU-hours (in a run: the orchestrator's `gpu_hours`, the run's one clock). The status comes
from the fit of the evaluations at or past `options.min_compute`, by the first rule that applies:

- `too-early`: fewer than MIN_POINTS evaluations in the fit window (or the fit fails);
- `diverging`: the mean of the latest DIVERGE_SPAN evaluations lies below the best mean of any DIVERGE_SPAN
  consecutive ones by more than DIVERGE_DROP and by more than DIVERGE_RMSES x the fit's rmse (a drop that the run's
  own scatter does not explain: means of several evaluations, so that one noisy high or low point decides nothing),
  or the fit finds no gain over R0 while the latest evaluation is below R0;
- `plateaued`: the fitted curve at the latest evaluation has reached PLATEAU_FRACTION of its gain A - R0. An A
  interval whose upper end sits on A's search bound (1.0) is then no reason to wait (the bound is the fit's, not the
  data's; `forecast/A_hi_at_bound` says so), provided the fitted evaluations span at least PLATEAU_SPAN x in compute,
  so that the flat stretch is seen rather than inferred from a short window (else `too-early`);
- `too-early`: the curve has not bent (the latest evaluation is below C_mid: A is an extrapolation), or A's interval
  is wider than WIDE_A_INTERVAL with both ends set by the data;
- `on-track`: otherwise: the curve has bent and A is known to within WIDE_A_INTERVAL, or bounded below by the data
  with its upper end on the search bound.

Stopping at a fraction of the ceiling (`forecast.stop_at_fraction`, `ceiling_reached`): the run may end itself once
its status is `on-track` or `plateaued`, A's interval is narrow (at most WIDE_A_INTERVAL wide, both ends set by the
data, not by A's search bound) and the mean of its latest DIVERGE_SPAN evaluations has reached that fraction of A.

Keys (prefix `forecast/`, or `forecast/<curve>/` for a further curve): A, A_lo, A_hi, A_hi_at_bound (1/0), B, C_mid,
reward_at/<budget> (the predicted reward at each budget in GPU-hours, e.g. `reward_at/16000`), gpu_hours_to_target (absent when the
fitted curve never reaches the target), target_reachable (1/0), points (evaluations fitted), status (the string),
status_code (STATUS_CODES: a number wandb can chart).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast.data import Curve
from megatron_scalerl.forecast.predict import (
    MIN_POINTS,
    NO_GAIN,
    WIDE_A_INTERVAL,
    Forecast,
    ForecastOptions,
    fit_window,
    format_gpu_hours,
    make_forecast,
)
from megatron_scalerl.recipe import ForecastConfig, Recipe

STATUS_CODES = {"too-early": 0, "on-track": 1, "plateaued": 2, "diverging": 3}
PLATEAU_FRACTION = 0.9  # of the fitted gain A - R0 reached at the latest evaluation
DIVERGE_SPAN = 3  # evaluations averaged on each side of the comparison
DIVERGE_DROP = 0.05  # reward: the latest mean below the best mean so far
DIVERGE_RMSES = 3.0  # ... and below it by this many fit rmse
A_SEARCH_BOUND = 1.0  # A is a pass rate: the fit searches A <= 1
AT_BOUND = 1e-3  # an interval end this close to the bound is the bound's
PLATEAU_SPAN = 4.0  # with A bounded only from below, a plateau must be seen over this factor of compute


@dataclass(frozen=True)
class LiveForecast:
    status: str  # one of STATUS_CODES
    reason: str  # one line: why this status
    forecast: Forecast | None  # None when too few evaluations to fit
    target: float | None  # reward whose GPU-hours are predicted

    @property
    def a_interval(self) -> tuple[float, float] | None:
        return None if self.forecast is None else self.forecast.param_interval("A")

    @property
    def a_hi_at_bound(self) -> bool:
        return _reaches_bound(self.a_interval)

    def figures(self, prefix: str = "forecast/") -> dict[str, float | str]:
        out: dict[str, float | str] = {f"{prefix}status": self.status,
                                       f"{prefix}status_code": float(STATUS_CODES[self.status])}
        if self.forecast is None:
            return out
        fit = self.forecast.fit
        out.update({f"{prefix}A": fit.A, f"{prefix}B": fit.B, f"{prefix}C_mid": fit.C_mid,
                    f"{prefix}points": float(self.forecast.in_fit.sum())})
        if self.a_interval is not None:
            out.update({f"{prefix}A_lo": self.a_interval[0], f"{prefix}A_hi": self.a_interval[1],
                        f"{prefix}A_hi_at_bound": float(self.a_hi_at_bound)})
        for row in self.forecast.predictions():
            out[f"{prefix}reward_at/{row['gpu_hours']:g}"] = row["reward"]
        if self.target is not None:
            needed = fit.compute_for(self.target)
            out[f"{prefix}target_reachable"] = float(np.isfinite(needed))
            if np.isfinite(needed):
                out[f"{prefix}gpu_hours_to_target"] = float(needed)
        return out

    def progress(self) -> str:
        """The progress line's words: status, and A with its interval."""
        if self.forecast is None:
            return f"forecast {self.status}"
        interval, band = self.a_interval, ""
        if interval is not None:
            band = f" [{interval[0]:.3f}, " + ("bound]" if self.a_hi_at_bound else f"{interval[1]:.3f}]")
        return f"forecast {self.status} A {self.forecast.fit.A:.3f}{band}"


def run_options(config: ForecastConfig, eval_draws: int | None) -> ForecastOptions:
    """The forecast options of a run from its recipe's `forecast` section (`config`) and its validation's evaluation
    noise (`eval_draws`: held-out prompts x samples per prompt; None: estimated from the data), its target included."""
    return ForecastOptions(min_compute=config.min_compute, budgets=tuple(config.budgets), resamples=config.resamples,
                           targets=(config.target,) if config.target is not None else (), eval_draws=eval_draws)


def recipe_options(recipe: Recipe) -> ForecastOptions:
    """`run_options` of a run's recipe: its forecast section and its validation's draws."""
    return run_options(recipe.forecast, validation_draws(recipe))


def validation_draws(recipe: Recipe) -> int | None:
    """Completions scored per validation (held-out prompts x samples per prompt), None without a validation."""
    draws = recipe.data.validation_holdout * recipe.data.validation_generations
    return draws or None


def ceiling_reached(live: LiveForecast, fraction: float) -> str | None:
    """Why the run may stop now, at `fraction` of a narrowly known ceiling (module docstring), or None."""
    interval = live.a_interval
    if live.forecast is None or live.status not in ("on-track", "plateaued") or interval is None:
        return None
    if live.a_hi_at_bound or interval[1] - interval[0] > WIDE_A_INTERVAL:
        return None
    A = live.forecast.fit.A
    recent = float(np.mean(live.forecast.curve.reward[-DIVERGE_SPAN:]))
    if recent < fraction * A:
        return None
    return (f"the latest {min(DIVERGE_SPAN, live.forecast.curve.reward.size)} evaluations average {recent:.3f}, "
            f"{recent / A:.0%} of the ceiling A = {A:.3f} [{interval[0]:.3f}, {interval[1]:.3f}] "
            f"(forecast.stop_at_fraction {fraction:g})")


def _reaches_bound(interval: tuple[float, float] | None) -> bool:
    """Whether A's interval ends on the fit's search bound (the bound's end, not the data's)."""
    return interval is not None and interval[1] >= A_SEARCH_BOUND - AT_BOUND


def live_forecast(curve: Curve, options: ForecastOptions, target: float | None = None) -> LiveForecast:
    """The status and forecast of `curve` (see the module docstring for the rules)."""
    try:
        fit_window(curve, options)
    except UserError:
        in_window = int(((curve.compute > 0) & (curve.compute >= options.min_compute)).sum())
        return LiveForecast("too-early", f"{in_window} evaluation(s) at or past {format_gpu_hours(options.min_compute)}"
                                         f" GPU-h; the fit needs {MIN_POINTS}", None, target)
    if target is not None:
        options = dataclasses.replace(options, targets=(target,))
    try:
        forecast = make_forecast(curve, options)
    except (UserError, ValueError, RuntimeError, FloatingPointError) as exc:  # e.g. R0 = 1: nothing to fit
        return LiveForecast("too-early", f"no fit: {exc}", None, target)
    return LiveForecast(*_status(forecast), forecast, target)


def _status(forecast: Forecast) -> tuple[str, str]:
    fit, curve = forecast.fit, forecast.curve
    latest = float(curve.reward[-1])
    if curve.reward.size >= 2 * DIVERGE_SPAN:
        means = np.convolve(curve.reward, np.ones(DIVERGE_SPAN) / DIVERGE_SPAN, mode="valid")
        drop = float(means.max() - means[-1])
        if drop > DIVERGE_DROP and drop > DIVERGE_RMSES * fit.rmse:
            return "diverging", (f"the latest {DIVERGE_SPAN} evaluations average {means[-1]:.3f}, {drop:.3f} below "
                                 f"the best {DIVERGE_SPAN} in a row ({means.max():.3f}), more than "
                                 f"{DIVERGE_RMSES:g}x the fit's rmse ({fit.rmse:.3f})")
    if fit.A - fit.R0 <= NO_GAIN and latest < fit.R0:
        return "diverging", f"no gain over R0 = {fit.R0:.3f} and the latest evaluation ({latest:.3f}) is below it"
    now = forecast.fitted_until
    fitted_now = float(fit.predict(now))
    gain = fit.A - fit.R0
    fraction = (fitted_now - fit.R0) / gain if gain > NO_GAIN else 0.0
    interval = forecast.param_interval("A")
    at_bound = _reaches_bound(interval)
    span = now / float(curve.compute[forecast.in_fit][0])
    if gain > NO_GAIN and fraction >= PLATEAU_FRACTION and at_bound and span < PLATEAU_SPAN:
        return "too-early", (f"the fit puts the latest evaluation at {fraction:.0%} of its gain, but A's interval "
                             f"reaches its search bound and the fitted evaluations span only {span:.1f}x in compute "
                             f"(a plateau bounded only by the data needs {PLATEAU_SPAN:g}x)")
    if gain > NO_GAIN and fraction >= PLATEAU_FRACTION:
        note = (f"; A's interval reaches its search bound ({A_SEARCH_BOUND:g}): the data bound A only from below, "
                f"A >= {interval[0]:.3f}" if at_bound else "")
        return "plateaued", (f"the fitted curve has reached {fraction:.0%} of its gain (A = {fit.A:.3f}) at "
                             f"{format_gpu_hours(now)} GPU-h{note}")
    if gain <= NO_GAIN:
        return "too-early", f"no gain over R0 = {fit.R0:.3f} yet"
    if now < fit.C_mid:
        return "too-early", (f"the curve has not bent: the latest evaluation ({format_gpu_hours(now)} GPU-h) is "
                             f"below C_mid ({format_gpu_hours(fit.C_mid)} GPU-h), so A is an extrapolation")
    if interval is not None and interval[1] - interval[0] > WIDE_A_INTERVAL and not at_bound:
        return "too-early", f"A's interval [{interval[0]:.3f}, {interval[1]:.3f}] is wider than {WIDE_A_INTERVAL}"
    bound = (f", A >= {interval[0]:.3f} (its interval's upper end is the search bound)" if at_bound
             else f", A = {fit.A:.3f}" + ("" if interval is None else f" [{interval[0]:.3f}, {interval[1]:.3f}]"))
    return "on-track", f"the curve has bent ({fraction:.0%} of its gain at {format_gpu_hours(now)} GPU-h){bound}"
