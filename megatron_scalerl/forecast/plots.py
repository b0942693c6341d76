"""PNG figures for the reports (matplotlib's Agg canvas through `Figure`, no pyplot state, no display needed)."""

from __future__ import annotations

import io

import numpy as np
from matplotlib.figure import Figure

from megatron_scalerl.forecast.ablation import Ablation
from megatron_scalerl.forecast.compare import Comparison, log_f
from megatron_scalerl.forecast.data import Curve
from megatron_scalerl.forecast.predict import A_MARGIN, Forecast, format_gpu_hours

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def _compute_grid(forecast: Forecast, right: float) -> np.ndarray:
    left = forecast.curve.compute[forecast.curve.compute > 0].min()
    return np.geomspace(left, right, 300)


def _draw_points(ax, forecast: Forecast, colour: str, legend: bool) -> None:
    """A run's evaluations: fitted filled, excluded (before the cutoff) grey, held-out hollow; `legend` labels them."""
    curve = forecast.curve
    shown = curve.compute > 0
    early = shown & ~forecast.in_fit & (curve.compute < curve.compute[forecast.in_fit][0])
    later = shown & ~forecast.in_fit & ~early
    ax.scatter(curve.compute[early], curve.reward[early], s=12, color="0.6",
               label="excluded (before cutoff)" if legend else None)
    ax.scatter(curve.compute[forecast.in_fit], curve.reward[forecast.in_fit], s=14, color=colour,
               label="fitted evaluations" if legend else None)
    ax.scatter(curve.compute[later], curve.reward[later], s=18, facecolors="none", edgecolors=colour,
               label="held-out evaluations" if legend and later.any() else None)


def _draw_band(ax, grid: np.ndarray, draws: np.ndarray, level: float, colour: str, label: str | None) -> None:
    """The `level` interval of reward draws (shape (k, len(grid))) as a shaded band."""
    tail = (1 - level) / 2
    ax.fill_between(grid, np.quantile(draws, tail, axis=0), np.quantile(draws, 1 - tail, axis=0), color=colour,
                    alpha=0.18, lw=0, label=label)


def _draw_run(ax, forecast: Forecast, colour: str, right: float, label: str) -> None:
    """Evaluations (fitted filled, excluded grey, held-out hollow), the sigmoid and its interval band."""
    fit = forecast.fit
    _draw_points(ax, forecast, colour, label == "data")
    grid = _compute_grid(forecast, right)
    ax.plot(grid, fit.predict(grid), color=colour, lw=2,
            label=f"sigmoid: A={fit.A:.3f}, B={fit.B:.2f}, C_mid={format_gpu_hours(fit.C_mid)}" if label == "data" else
            f"{label}: A={fit.A:.3f}, B={fit.B:.2f}")
    if forecast.boot is not None:
        _draw_band(ax, grid, forecast.boot.rewards(grid), forecast.options.level, colour,
                   f"{forecast.options.level:.0%} interval" if label == "data" else None)


def curve_png(curve: Curve, *others: Curve) -> bytes:
    """A run's evaluations as they are: the metric against GPU-hours (linear), no fit (e.g. the demo's own curve);
    `others`, further metrics of the run (e.g. each domain's pass rate), as further lines with a legend."""
    fig = Figure(figsize=(6.5, 3.8))
    ax = fig.add_subplot()
    for index, each in enumerate((curve, *others)):
        ax.plot(each.compute, each.reward, marker="o", color=COLOURS[index % len(COLOURS)], label=each.metric)
    ax.set_xlabel("GPU-hours (wall x every GPU the run holds)")
    ax.set_ylabel(curve.metric)
    ax.set_title(f"{curve.name}: {curve.metric} during RL")
    if others:
        ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    return _png(fig)


def steps_png(series: dict[str, tuple[list[int], list[float]]], ylabel: str, title: str) -> bytes:
    """Runs side by side on their steps: each label's (steps, values) as a line, with a legend (e.g. the tools
    demo's two runs)."""
    fig = Figure(figsize=(6.5, 3.8))
    ax = fig.add_subplot()
    for index, (label, (steps, values)) in enumerate(series.items()):
        ax.plot(steps, values, marker="o", color=COLOURS[index % len(COLOURS)], label=label)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    return _png(fig)


def forecast_png(forecast: Forecast, show_budgets: bool = True) -> bytes:
    """Data, fit, interval band, extrapolation to the largest budget (to the last evaluation when `show_budgets` is
    off, as in a backtest), cutoff marked, power law dashed."""
    fit, options = forecast.fit, forecast.options
    right = max(max(options.budgets) if show_budgets else 0.0, forecast.curve.compute[-1]) * 1.15
    fig = Figure(figsize=(8.5, 5.2))
    ax = fig.add_subplot()
    ax.set_xscale("log")
    ax.axvspan(forecast.fitted_until, right, color="0.93", lw=0, label="extrapolation")
    ax.axhspan(fit.A - A_MARGIN, fit.A + A_MARGIN, color="#1f77b4", alpha=0.06, lw=0)
    ax.axhline(fit.A, color="#1f77b4", ls=":", lw=1, label=f"ceiling A +-{A_MARGIN} (paper margin)")
    ax.axhline(fit.R0, color="0.4", ls=":", lw=1, label=f"R0 = {fit.R0:.3f}")
    _draw_run(ax, forecast, COLOURS[0], right, "data")
    grid = _compute_grid(forecast, right)
    ax.plot(grid, forecast.power.predict(grid), color="0.25", ls="--", lw=1.3,
            label=f"power law: A={forecast.power.A:.3f}, B={forecast.power.B:.2f}")
    ax.axvline(options.min_compute, color="0.35", lw=1, ls="-.", label=f"fit cutoff {format_gpu_hours(options.min_compute)}")
    if options.fit_until is not None:
        ax.axvline(options.fit_until, color="#ff7f0e", lw=1, ls="-.", label=f"fit until {format_gpu_hours(options.fit_until)}")
    if show_budgets:
        _draw_budgets(ax, forecast)
    top = max(fit.A + A_MARGIN, forecast.power.A if forecast.power.A < 1.0 else 0.0, forecast.curve.reward.max())
    ax.set_ylim(max(0.0, min(fit.R0, forecast.curve.reward.min()) - 0.03), min(1.0, top + 0.05))
    ax.set_xlim(grid[0] * 0.9, right)
    ax.set_xlabel("training compute (GPU-hours, log scale)")
    ax.set_ylabel(forecast.curve.metric)
    ax.set_title(f"{forecast.curve.name}: sigmoidal compute-performance fit ({fit.method})")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="upper left", fontsize=7.5, framealpha=0.9)
    return _png(fig)


def _draw_budgets(ax, forecast: Forecast) -> None:
    """The predictions at the budgets, with their interval as error bars."""
    predictions = forecast.predictions()
    budgets = [p["gpu_hours"] for p in predictions]
    rewards = [p["reward"] for p in predictions]
    if predictions[0]["lo"] is None:
        ax.plot(budgets, rewards, "D", color="black", ms=5, label="budgets")
        return
    errors = [[r - p["lo"] for r, p in zip(rewards, predictions, strict=True)],
              [p["hi"] - r for r, p in zip(rewards, predictions, strict=True)]]
    ax.errorbar(budgets, rewards, yerr=errors, fmt="D", color="black", ms=5, capsize=4, label="budgets")


def compare_png(comparison: Comparison) -> bytes:
    """All runs' evaluations and fits on one axis, crossovers marked."""
    right = max(max(f.options.budgets) for f in comparison.forecasts) * 1.15
    fig = Figure(figsize=(8.5, 5.2))
    ax = fig.add_subplot()
    ax.set_xscale("log")
    for i, forecast in enumerate(comparison.forecasts):
        _draw_run(ax, forecast, COLOURS[i % len(COLOURS)], right, forecast.curve.name)
    for pair in comparison.pairs:
        for c in pair["crossovers"]:
            ax.axvline(c, color="0.3", ls=":", lw=1)
            ax.annotate(f" {' x '.join(pair['runs'])} cross at {format_gpu_hours(c)}", (c, ax.get_ylim()[1]), rotation=90,
                        fontsize=7, va="top", ha="right", bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    ax.set_xlabel("training compute (GPU-hours, log scale)")
    ax.set_ylabel(comparison.forecasts[0].curve.metric)
    ax.set_title("runs compared: fits and intervals")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def linearised_png(comparison: Comparison) -> bytes:
    """log F(R) against log C: each run's evaluations around a line of slope B."""
    fig = Figure(figsize=(7.5, 5.0))
    ax = fig.add_subplot()
    for i, (forecast, fit) in enumerate(zip(comparison.forecasts, comparison.linearised, strict=True)):
        colour = COLOURS[i % len(COLOURS)]
        x, y = log_f(fit, forecast.curve.compute[forecast.in_fit], forecast.curve.reward[forecast.in_fit])
        ax.scatter(x, y, s=12, color=colour)
        if x.size:
            line = np.linspace(x.min(), x.max(), 2)
            ax.plot(line, fit.B * line, color=colour, lw=2, label=f"{forecast.curve.name}: slope B = {fit.B:.2f}")
    shared = f"shared A = {comparison.linearised[0].A:.3f}" if comparison.linearised_shared_A else "each run's own A"
    ax.set_title(f"linearised view, {shared}")
    ax.set_xlabel("log C (GPU-hours)")
    ax.set_ylabel("log F(R)")
    ax.grid(True, alpha=0.25)
    ax.legend(loc="upper left", fontsize=8)
    return _png(fig)


def ablation_png(ablation: Ablation) -> bytes:
    """The base and every variant on one log-compute axis: each seed's evaluations, the recipe's mean fitted curve
    and the band of its pass rate; dotted lines at the base's 50% and 90% of gain."""
    recipes = (ablation.base, *ablation.variants)
    forecasts = [f for r in recipes for f in r.forecasts]
    right = max(max(ablation.options.budgets), *(f.curve.compute[-1] for f in forecasts)) * 1.15
    grid = np.geomspace(min(f.curve.compute[f.curve.compute > 0].min() for f in forecasts), right, 300)
    fig = Figure(figsize=(8.5, 5.2))
    ax = fig.add_subplot()
    ax.set_xscale("log")
    for i, recipe in enumerate(recipes):
        colour = COLOURS[i % len(COLOURS)]
        for forecast in recipe.forecasts:
            _draw_points(ax, forecast, colour, legend=False)
        fit = recipe.fitted
        seeds = f", {len(recipe.forecasts)} seeds" if len(recipe.forecasts) > 1 else ""
        verdict = "base" if i == 0 else ablation.contrasts[i - 1].verdict
        ax.plot(grid, recipe.predict(grid), color=colour, lw=2,
                label=f"{recipe.name} ({verdict}{seeds}): A={fit['A']:.3f}, C_mid={format_gpu_hours(fit['C_mid'])}")
        _draw_band(ax, grid, recipe.rewards(grid), recipe.level, colour, None)
    base = ablation.base.fitted
    for q in (0.5, 0.9):
        ax.axhline(base["R0"] + q * (base["A"] - base["R0"]), color="0.4", ls=":", lw=1)
    ax.set_xlim(grid[0] * 0.9, right)
    ax.set_xlabel("training compute (GPU-hours, log scale)")
    ax.set_ylabel(ablation.metric)
    ax.set_title(f"ablation: fits and {ablation.base.level:.0%} bands; dotted: 50% and 90% of the base's gain")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="lower right", fontsize=7.5)
    return _png(fig)
