"""Benchmark: the default sigmoid fit (`lsq`) against the paper's grid procedure (`paper-grid`) on the same curves, and
the calibration of the forecast intervals.

Curves: every run of the paper's Table 1, rerun `--seeds` times (`synthetic.replicate_run`: A, B, C_mid varied within
the run-to-run spread, so the true values do not sit on the published ones) with binomial mean@16 noise on 1,000
prompts and drift (`synthetic.synthetic_curve`). Each curve is fitted on [1.5k GPU-h, budget / 2] and predicts the
reward at the budget, 2x the fit window; the error is against the noiseless true curve.

Figures: median fit time of each method (each curve timed `--repeats` times, best kept) and their ratio, median
absolute prediction error of each. The same figures on the exact Table 1 parameters are printed too (several
published C_mid sit within 1% of a paper-grid value, which favours the grid there).

Calibration: `--calibration-runs` synthetic runs, run i a rerun of Table 1 row i mod 10 whose drift has an AR(1)
correlation drawn uniformly in [0.5, 0.9] (sd 0.005), with binomial mean@16 noise on 1,000 prompts. Each is fitted
(`lsq`) on [1.5k GPU-h, budget / 2]; the nominal 95% interval at the budget (2x the fit window) comes from
`--resamples` bootstrap replicates (forecasts default to 200; fewer keeps the bench short), with the evaluation noise
given (`eval_draws` = 16,000) and estimated. Coverage of the run's own pass rate at the budget (the sigmoid plus that
run's drift, `synthetic.simulate_run`), the quantity the intervals target, and of the noiseless sigmoid; median width.
Baseline: the previous intervals, a moving-block residual bootstrap (percentile interval of the refitted curves).
Goal: 90-98% coverage of the pass rate.

A's interval: on the same runs, coverage of the true A (the rerun's own, `replicate_run`) by the nominal 95% interval
of A, fitted on [1.5k GPU-h, budget / 2] (noise given and estimated) and on [1.5k GPU-h, budget] (noise given), in
all and per drift-correlation half ([0.5, 0.7) and [0.7, 0.9]; `--drift-corr` gives every run one correlation);
`a_interval_coverage` pools them all, `a_interval_coverage_min_cell` is the lowest (window, correlation) cell.
Goal: 90-98%.

Small runs (`--small-runs`, default as many as calibration runs): demo-like curves, 16 evaluations every 0.01 GPU-h
from 0 to 0.15 GPU-h, evaluation noise from 64 prompts x 4 samples (`eval_draws` 256), the whole window fitted
(`min_compute` 0), sigmoid parameters drawn around the demo's (A 0.45-0.65, R0 0.15-0.30, C_mid 0.01-0.06 GPU-h,
B 1-2.5), drift sd 0.003-0.015 with correlation 0.5-0.9. Coverage of their A and of their pass rate at 1 GPU-h
(6.7x the window), and how far the interval's lower end there lies below the mean of the last 4 evaluations (the
level the run has already shown). Last line: one JSON object.

    .venv/bin/python bench/forecast.py [--seeds 10] [--repeats 1] [--calibration-runs 200] [--resamples 100]
                                       [--drift-corr RHO] [--small-runs N]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from megatron_scalerl.forecast.sigmoid import SigmoidFit, fit_sigmoid
from megatron_scalerl.forecast.synthetic import (
    TABLE1,
    PaperRun,
    replicate_run,
    simulate_run,
    synthetic_curve,
    true_reward,
)
from megatron_scalerl.forecast.uncertainty import bootstrap_sigmoid, interval

METHODS = ("lsq", "paper-grid")
MIN_COMPUTE = 1500.0  # GPU-h, the paper's cutoff
LEVEL = 0.95
EVAL_DRAWS = 1000 * 16  # the synthetic runs' prompts x samples per prompt
COVERAGE_GOAL = (0.90, 0.98)
SMALL_PROMPTS, SMALL_SAMPLES = 64, 4  # the demo's validation: prompts x samples per prompt
SMALL_WINDOW = 0.15  # GPU-h fitted in a small run


def measure(runs, repeats: int) -> dict:
    """Fit time (s, best of `repeats`) and |prediction error at 2x the fit window| per method and curve."""
    times = {m: [] for m in METHODS}
    errors = {m: [] for m in METHODS}
    for run, seed in runs:
        curve = synthetic_curve(run, seed)
        window = (curve.compute >= MIN_COMPUTE) & (curve.compute <= run.budget / 2)
        C, y, r0 = curve.compute[window], curve.reward[window], curve.reward[0]
        truth = float(true_reward(run, run.budget))
        for method in METHODS:
            best = np.inf
            for _ in range(repeats):
                start = time.perf_counter()
                fit = fit_sigmoid(C, y, r0, method)
                best = min(best, time.perf_counter() - start)
            times[method].append(best)
            errors[method].append(abs(float(fit.predict(run.budget)) - truth))
    lsq_ms, grid_ms = (1e3 * float(np.median(times[m])) for m in METHODS)
    lsq_err, grid_err = (float(np.median(errors[m])) for m in METHODS)
    return {"curves": len(runs), "lsq_median_fit_ms": round(lsq_ms, 3), "paper_grid_median_fit_ms": round(grid_ms, 2),
            "speedup": round(grid_ms / lsq_ms, 1), "lsq_median_abs_error": round(lsq_err, 5),
            "paper_grid_median_abs_error": round(grid_err, 5),
            "lsq_more_accurate_fraction": round(float(np.mean(np.less(errors["lsq"], errors["paper-grid"]))), 3)}


def block_bootstrap_interval(C, y, fit: SigmoidFit, at: float, resamples: int, seed: int) -> tuple[float, float]:
    """The previous intervals (baseline): the base fit's centred, dof-scaled residuals resampled in blocks of
    n^(1/3) consecutive evaluations, a measured R0 perturbed by one residual, percentile interval of the refitted
    curves at `at` GPU-h."""
    n = C.size
    fitted = fit.predict(C)
    residuals = (y - fitted - np.mean(y - fitted)) * np.sqrt(n / max(n - 3, 1))
    block = max(1, round(n ** (1.0 / 3.0)))
    rng = np.random.default_rng(seed)
    predictions = np.empty(resamples)
    for k in range(resamples):
        starts = rng.integers(0, n - block + 1, size=-(-n // block))
        picked = (starts[:, None] + np.arange(block)[None, :]).ravel()[:n]
        r0 = float(np.clip(fit.R0 + rng.choice(residuals), 0.0, 1.0 - 1e-6))
        predictions[k] = fit_sigmoid(C, np.clip(fitted + residuals[picked], 0.0, 1.0), r0, fit.method).predict(at)
    return interval(predictions, LEVEL)


def calibration(runs: int, resamples: int, drift_corr: float | None = None) -> dict:
    """Coverage of the nominal 95% interval at 2x the fit window, per interval method, and of A's interval, over
    `runs` synthetic runs (drift correlation `drift_corr`, or drawn in [0.5, 0.9])."""
    hits = {"noise_given": [], "noise_estimated": [], "block_baseline": []}
    a_hits = []  # (window, noise, drift correlation, covered, width)
    errors = []
    start = time.perf_counter()
    for i in range(runs):
        seed = 5000 + i  # apart from the seeds the fit benchmark and the tests use
        run = replicate_run(TABLE1[i % len(TABLE1)], seed)
        corr = drift_corr if drift_corr is not None else float(np.random.default_rng([seed, 1]).uniform(0.5, 0.9))
        sim = simulate_run(run, seed, drift_corr=corr)
        pass_rate, sigmoid = float(sim.pass_rate[-1]), float(true_reward(run, run.budget))
        for until in ("budget/2", "budget"):
            window = (sim.curve.compute >= MIN_COMPUTE) & (sim.curve.compute <= run.budget / (2 if until == "budget/2"
                                                                                               else 1))
            C, y = sim.curve.compute[window], sim.curve.reward[window]
            fit = fit_sigmoid(C, y, sim.curve.reward[0])
            for name, draws in (("noise_given", EVAL_DRAWS), ("noise_estimated", None))[:2 if until == "budget/2"
                                                                                          else 1]:
                boot = bootstrap_sigmoid(C, y, fit, True, resamples, LEVEL, seed, eval_draws=draws)
                lo, hi = boot.interval(boot.A)
                a_hits.append((until, name, corr, lo <= run.A <= hi, hi - lo))
                if until == "budget/2":
                    lo, hi = boot.interval(boot.rewards([run.budget])[:, 0])
                    hits[name].append((lo <= pass_rate <= hi, lo <= sigmoid <= hi, hi - lo))
            if until == "budget/2":
                errors.append(abs(float(fit.predict(run.budget)) - sigmoid))
                lo, hi = block_bootstrap_interval(C, y, fit, run.budget, resamples, seed)
                hits["block_baseline"].append((lo <= pass_rate <= hi, lo <= sigmoid <= hi, hi - lo))
    out = {"runs": runs, "resamples": resamples, "lsq_median_abs_error": round(float(np.median(errors)), 5),
           "seconds": round(time.perf_counter() - start, 1)}
    for name, rows in hits.items():
        covered, sigmoid_covered, width = np.array(rows, dtype=float).T
        out[name] = {"coverage": round(covered.mean(), 3), "sigmoid_coverage": round(sigmoid_covered.mean(), 3),
                     "median_width": round(float(np.median(width)), 4)}
    out["a_interval"] = a_interval_cells(a_hits)
    return out


def a_interval_cells(rows) -> dict:
    """A's coverage and median width per (window, noise) and per (window, drift-correlation half), and pooled."""
    cells: dict[str, list] = {}
    for until, noise, corr, covered, width in rows:
        half = "corr_0.5-0.7" if corr < 0.7 else "corr_0.7-0.9"
        for key in (f"fit_to_{until}/{noise}", f"fit_to_{until}/{half}"):
            cells.setdefault(key, []).append((covered, width))
    out = {key: {"coverage": round(float(np.mean([c for c, _ in v])), 3), "runs": len(v),
                 "median_width": round(float(np.median([w for _, w in v])), 4)} for key, v in cells.items()}
    corr_cells = [v["coverage"] for key, v in out.items() if "/corr_" in key]
    out["pooled"] = round(float(np.mean([r[3] for r in rows])), 3) if rows else None
    out["min_cell"] = min(corr_cells) if corr_cells else None
    return out


def small_run(seed: int):
    """A demo-like synthetic run (module docstring): its truth, its evaluations to 1 GPU-h, and the fitted part."""
    rng = np.random.default_rng([seed, 2])
    run = PaperRun(f"small{seed}", C_mid=float(rng.uniform(0.01, 0.06)), B=float(rng.uniform(1.0, 2.5)),
                   A=float(rng.uniform(0.45, 0.65)), budget=1.0)
    sim = simulate_run(run, seed, r0=float(rng.uniform(0.15, 0.30)), num_evals=101, prompts=SMALL_PROMPTS,
                       samples_per_prompt=SMALL_SAMPLES, drift_sd=float(rng.uniform(0.003, 0.015)),
                       drift_corr=float(rng.uniform(0.5, 0.9)))
    return run, sim, sim.curve.compute <= SMALL_WINDOW + 1e-9


def small_runs(runs: int, resamples: int) -> dict:
    """Demo-like runs: coverage of A and of the pass rate at 1 GPU-h, and the lower end's drop below the level the
    run has shown (the mean of its last 4 fitted evaluations), over `runs` runs."""
    rows = []
    start = time.perf_counter()
    for i in range(runs):
        seed = 7000 + i
        run, sim, window = small_run(seed)
        C, y = sim.curve.compute[window], sim.curve.reward[window]
        fit = fit_sigmoid(C[1:], y[1:], y[0])
        boot = bootstrap_sigmoid(C[1:], y[1:], fit, True, resamples, LEVEL, seed,
                                 eval_draws=SMALL_PROMPTS * SMALL_SAMPLES)
        a_lo, a_hi = boot.interval(boot.A)
        lo, hi = boot.interval(boot.rewards([1.0])[:, 0])
        bent = (true_reward(run, SMALL_WINDOW, 0.0) / run.A) >= 0.9  # 90% of the gain reached in the window
        rows.append((a_lo <= run.A <= a_hi, lo <= sim.pass_rate[-1] <= hi, float(np.mean(y[-4:])) - lo, hi - lo,
                     bent))
    a_covered, covered, drop, width, bent = np.array(rows, dtype=float).T
    bent = bent.astype(bool)
    return {"runs": runs, "resamples": resamples, "seconds": round(time.perf_counter() - start, 1),
            "a_coverage": round(a_covered.mean(), 3), "coverage_at_1_gpu_hour": round(covered.mean(), 3),
            "bent_runs": int(bent.sum()), "coverage_at_1_gpu_hour_bent": round(float(np.mean(covered[bent])), 3)
            if bent.any() else None, "coverage_at_1_gpu_hour_unbent": round(float(np.mean(covered[~bent])), 3)
            if (~bent).any() else None,
            "median_width_at_1_gpu_hour": round(float(np.median(width)), 4),
            "median_drop_below_recent": round(float(np.median(drop)), 4),
            "p95_drop_below_recent": round(float(np.quantile(drop, 0.95)), 4)}


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="reruns of each Table 1 run (default: 10)")
    parser.add_argument("--repeats", type=int, default=1, help="timings per fit, best kept (default: 1)")
    parser.add_argument("--calibration-runs", type=int, default=200, help="runs for the interval calibration "
                        "(default: 200; 0 skips it)")
    parser.add_argument("--resamples", type=int, default=100, help="bootstrap replicates per interval in the "
                        "calibration (default: 100)")
    parser.add_argument("--drift-corr", type=float, default=None, help="one drift correlation for every "
                        "calibration run (default: drawn in [0.5, 0.9])")
    parser.add_argument("--small-runs", type=int, default=None, help="demo-like runs (default: as many as "
                        "--calibration-runs; 0 skips them)")
    args = parser.parse_args()

    seeds = range(args.seeds)
    reruns = measure([(replicate_run(run, s), s) for run in TABLE1 for s in seeds], args.repeats)
    exact = measure([(run, s) for run in TABLE1 for s in seeds], args.repeats)
    for label, r in (("Table 1 reruns (headline)", reruns), ("exact Table 1 parameters", exact)):
        print(f"{label}: {r['curves']} curves, fit on [1.5k, budget/2], predict at budget (2x)")
        print(f"  median fit time   lsq {r['lsq_median_fit_ms']:8.3f} ms   "
              f"paper-grid {r['paper_grid_median_fit_ms']:8.2f} ms   ratio {r['speedup']:.1f}x")
        print(f"  median |error|    lsq {r['lsq_median_abs_error']:8.5f}      paper-grid "
              f"{r['paper_grid_median_abs_error']:8.5f}      lsq better on {r['lsq_more_accurate_fraction']:.0%}")
    goal = reruns["speedup"] >= 20 and reruns["lsq_median_abs_error"] <= reruns["paper_grid_median_abs_error"]
    result = {"bench": "forecast", **reruns, "exact_table1": exact, "goal_20x_no_worse_error": goal}
    if args.calibration_runs:
        cal = calibration(args.calibration_runs, args.resamples, args.drift_corr)
        corr = "0.5-0.9" if args.drift_corr is None else f"{args.drift_corr:g}"
        print(f"interval calibration: {cal['runs']} runs (drift correlation {corr}), fit on [1.5k, budget/2], "
              f"nominal {LEVEL:.0%} interval at the budget (2x), {cal['resamples']} resamples, {cal['seconds']} s")
        for name in ("noise_given", "noise_estimated", "block_baseline"):
            c = cal[name]
            print(f"  {name:16s} covers the run's pass rate {c['coverage']:6.1%}   the sigmoid "
                  f"{c['sigmoid_coverage']:6.1%}   median width {c['median_width']:.4f}")
        headline = cal["noise_given"]["coverage"]
        result.update({"interval_coverage_at_2x": headline,
                       "interval_coverage_at_2x_noise_estimated": cal["noise_estimated"]["coverage"],
                       "interval_sigmoid_coverage_at_2x": cal["noise_given"]["sigmoid_coverage"],
                       "block_bootstrap_coverage_at_2x": cal["block_baseline"]["coverage"],
                       "interval_coverage_goal_met": bool(COVERAGE_GOAL[0] <= headline <= COVERAGE_GOAL[1]
                                                          and COVERAGE_GOAL[0] <= cal["noise_estimated"]["coverage"]
                                                          <= COVERAGE_GOAL[1]),
                       "calibration": cal})
        a = cal["a_interval"]
        print(f"A's nominal {LEVEL:.0%} interval covers the true A: {a['pooled']:.1%} pooled, lowest cell "
              f"{a['min_cell']:.1%}")
        for key, c in sorted(a.items()):
            if isinstance(c, dict):
                print(f"  {key:34s} {c['coverage']:6.1%}   median width {c['median_width']:.4f}   ({c['runs']} runs)")
        result.update({"a_interval_coverage": a["pooled"], "a_interval_coverage_min_cell": a["min_cell"],
                       "a_interval_goal_met": bool(COVERAGE_GOAL[0] <= a["min_cell"] and a["pooled"]
                                                   <= COVERAGE_GOAL[1])})
    small = args.calibration_runs if args.small_runs is None else args.small_runs
    if small:
        s = small_runs(small, args.resamples)
        print(f"small runs: {s['runs']} demo-like runs (16 evaluations to 0.15 GPU-h, 64x4 samples), {s['seconds']} s:"
              f" A covered {s['a_coverage']:.1%}, pass rate at 1 GPU-h covered {s['coverage_at_1_gpu_hour']:.1%}"
              f" ({percent(s['coverage_at_1_gpu_hour_bent'])} on the {s['bent_runs']} runs past 90% of their gain at"
              f" 0.15 GPU-h, {percent(s['coverage_at_1_gpu_hour_unbent'])} on the others)"
              f" (median width {s['median_width_at_1_gpu_hour']:.3f}); lower end below the last 4 evaluations' mean"
              f" by {s['median_drop_below_recent']:.3f} (median), {s['p95_drop_below_recent']:.3f} (95th pct)")
        result.update({"small_runs": s})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
