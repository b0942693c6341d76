"""Forecaster math: the sigmoid and its inverse against the paper's formula, both fit methods, the power law, the
bootstrap, predictions, comparison and backtests, on curves from the paper's Table 1 parameters with realistic noise."""

import dataclasses

import numpy as np
import pytest

from megatron_scalerl.forecast.backtest import run_backtest
from megatron_scalerl.forecast.compare import compare_runs, crossovers
from megatron_scalerl.forecast.data import Curve
from megatron_scalerl.forecast.powerlaw import fit_power_law
from megatron_scalerl.forecast.predict import ForecastOptions, make_forecast
from megatron_scalerl.forecast.sigmoid import (
    PAPER_C_MID_GRID,
    SigmoidFit,
    compute_to_reach,
    fit_sigmoid,
    reward_at,
    slope_at,
)
from megatron_scalerl.forecast.synthetic import (
    TABLE1,
    PaperRun,
    paper_run,
    replicate_run,
    simulate_run,
    synthetic_curve,
    true_reward,
)
from megatron_scalerl.forecast.uncertainty import bootstrap_sigmoid

NO_BOOT = ForecastOptions(resamples=0)


def paper_formula(C, A, B, C_mid, R0):
    """The law exactly as the paper writes it."""
    return R0 + (A - R0) / (1 + (C_mid / C) ** B)


def test_reward_inverse_and_slope_match_the_written_formula():
    C = np.geomspace(10, 1e6, 50)
    params = (0.645, 1.70, 10909.0, 0.31)
    np.testing.assert_allclose(reward_at(C, *params), paper_formula(C, *params), rtol=1e-12)
    assert reward_at(0.0, *params) == pytest.approx(0.31)  # zero compute gives R0
    np.testing.assert_allclose(compute_to_reach(reward_at(C, *params), *params), C, rtol=1e-8)
    assert compute_to_reach(0.645, *params) == np.inf and compute_to_reach(0.7, *params) == np.inf
    h = C * 1e-6  # central differences of the written formula
    numeric = (paper_formula(C + h, *params) - paper_formula(C - h, *params)) / (2 * h)
    np.testing.assert_allclose(slope_at(C, *params), numeric, rtol=1e-5)


def test_lsq_recovers_exact_parameters_from_noiseless_data():
    C = np.linspace(1500, 50000, 40)
    y = paper_formula(C, 0.645, 1.70, 10909.0, 0.30)
    fit = fit_sigmoid(C, y, 0.30)
    assert (fit.A, fit.B, fit.C_mid) == pytest.approx((0.645, 1.70, 10909.0), rel=1e-6)
    assert fit.rmse < 1e-9 and fit.at_bounds == ()


def test_paper_grid_recovers_parameters_on_its_grid():
    c_mid = float(PAPER_C_MID_GRID[27])  # 10,982 GPU-h, a grid value
    C = np.linspace(1500, 50000, 40)
    fit = fit_sigmoid(C, paper_formula(C, 0.645, 1.70, c_mid, 0.30), 0.30, method="paper-grid")
    assert (fit.A, fit.C_mid) == (0.645, c_mid)
    assert fit.B == pytest.approx(1.70, rel=1e-3)


def test_fixed_A_fits_only_B_and_C_mid():
    C = np.linspace(1500, 16000, 30)
    fit = fit_sigmoid(C, paper_formula(C, 0.60, 2.0, 3000.0, 0.3), 0.3, fixed_A=0.60)
    assert fit.A == 0.60 and (fit.B, fit.C_mid) == pytest.approx((2.0, 3000.0), rel=1e-6)


@pytest.mark.parametrize("run", TABLE1, ids=lambda r: r.name)
def test_table1_curves_with_noise_recover_A_within_the_paper_margin(run):
    for seed in range(3):
        forecast = make_forecast(synthetic_curve(run, seed), NO_BOOT)
        assert abs(forecast.fit.A - run.A) < 0.02, (seed, forecast.fit)
        assert forecast.identifiable


@pytest.mark.parametrize("run", TABLE1, ids=lambda r: r.name)
def test_fit_to_half_the_budget_predicts_the_final_value(run):
    curve = synthetic_curve(run, seed=4)
    forecast = make_forecast(curve, dataclasses.replace(NO_BOOT, fit_until=run.budget / 2, budgets=(run.budget,)))
    predicted = forecast.predictions()[0]["reward"]
    assert abs(predicted - true_reward(run, run.budget)) < 0.02
    assert abs(predicted - curve.reward[-3:].mean()) < 0.02  # and the run's own last evaluations


def test_power_law_overestimates_the_ceiling_of_saturating_curves():
    run = paper_run("batch-2048-100k")  # the paper's A.4 case: fit 1.5k-50k
    for seed in range(3):
        forecast = make_forecast(synthetic_curve(run, seed), dataclasses.replace(NO_BOOT, fit_until=50000))
        assert forecast.power.A > forecast.fit.A + 0.02 and forecast.power.A > run.A + 0.05
        assert "overestimate" in forecast.power_law_note()
        assert forecast.to_dict()["power_law"]["agrees_with_sigmoid"] is False


def test_power_law_recovers_its_own_curve():
    C = np.geomspace(1500, 50000, 30)
    fit = fit_power_law(C, 0.7 - 2.5 * C**-0.4)
    assert (fit.A, fit.B, fit.D) == pytest.approx((0.7, 0.4, 2.5), rel=1e-4)


def test_forecast_reports_intervals_the_noise_model_and_the_paper_margin():
    run = paper_run("scalerl-8b-32k-gen")
    forecast = make_forecast(synthetic_curve(run, seed=1), ForecastOptions(resamples=60, budgets=(50000,),
                                                                           eval_draws=16000))
    data = forecast.to_dict()
    for name in ("A", "B", "C_mid", "R0"):
        lo, hi = data["fit"][name]["interval"]
        assert lo < data["fit"][name]["value"] < hi
    assert data["fit"]["A"]["paper_margin"] == pytest.approx([forecast.fit.A - 0.02, forecast.fit.A + 0.02])
    noise = data["fit"]["bootstrap"]["noise"]
    assert noise["eval_sd_source"] == "eval_draws" and noise["eval_sd"] == pytest.approx(np.sqrt(0.24 / 16000),
                                                                                         rel=0.05)
    assert 0 < noise["drift_sd"] < 0.02 and 0 < noise["drift_corr"] < 1 and noise["drift_scale_gpu_hours"] > 0
    prediction = data["predictions"][0]
    assert prediction["lo"] < prediction["reward"] < prediction["hi"]


def test_prediction_intervals_are_calibrated_over_many_runs():
    """Nominal 95% intervals at 2x the fit window cover the run's own pass rate (the sigmoid plus that run's drift) on
    most of 48 runs with AR(1) drift (correlation 0.5-0.9) and binomial noise, evaluation noise given on even runs and
    estimated on odd ones; and they are not padded: a moving-block bootstrap covered about 70%, and widening each
    interval by 0.02 on both sides would break the width bound."""
    covered, sigmoid_covered, widths = [], [], []
    for i in range(48):
        seed = 200 + i
        run = replicate_run(TABLE1[i % len(TABLE1)], seed)
        sim = simulate_run(run, seed, drift_corr=np.random.default_rng([seed, 1]).uniform(0.5, 0.9))
        options = ForecastOptions(fit_until=run.budget / 2, budgets=(run.budget,), resamples=60, seed=seed,
                                  eval_draws=None if i % 2 else 16000)
        prediction = make_forecast(sim.curve, options).predictions()[0]
        lo, hi = prediction["lo"], prediction["hi"]
        covered.append(lo <= sim.pass_rate[-1] <= hi)
        sigmoid_covered.append(lo <= true_reward(run, run.budget) <= hi)
        widths.append(hi - lo)
    assert np.mean(covered) >= 0.85 and np.mean(sigmoid_covered) >= 0.85, (np.mean(covered), np.mean(sigmoid_covered))
    assert np.median(widths) < 0.065, np.median(widths)


def test_drift_continues_past_the_fitted_window():
    run = paper_run("batch-512")
    curve = synthetic_curve(run, seed=5)
    window = (curve.compute >= 1500) & (curve.compute <= 8000)
    C, y = curve.compute[window], curve.reward[window]
    boot = bootstrap_sigmoid(C, y, fit_sigmoid(C, y, curve.reward[0]), True, resamples=40, eval_draws=16000)
    np.testing.assert_allclose(boot.drift_at([C[-1], C[3]]), boot.drift[:, [-1, 3]])
    far = boot.drift_at([1e9])[:, 0]  # past the drift's memory: a fresh stationary draw
    np.testing.assert_allclose(far, boot.noise.drift_sd * boot.continuation)
    near, later = boot.rewards([C[-1] + 200, 16000]).std(axis=0)
    assert later > near  # uncertainty grows with the horizon


def test_given_r0_is_fixed_and_has_no_interval():
    forecast = make_forecast(synthetic_curve(paper_run("batch-512"), 0), ForecastOptions(resamples=20, r0=0.3))
    assert forecast.fit.R0 == 0.3 and forecast.to_dict()["fit"]["R0"]["interval"] is None


def test_unbent_curve_is_flagged_not_identifiable():
    curve = synthetic_curve(PaperRun("slow", C_mid=60000, B=1.5, A=0.7, budget=100000), 0)
    for fit_until in (12000, 25000):  # at most 40% of the way to C_mid
        forecast = make_forecast(curve, ForecastOptions(resamples=30, fit_until=fit_until))
        assert not forecast.identifiable and forecast.recommendation().startswith("Too early to call")
        assert any("has not bent yet" in w or "wider than 0.1" in w for w in forecast.warnings)
        assert forecast.to_dict()["fit"]["identifiable"] is False


def test_predictions_targets_and_current_point():
    run = paper_run("batch-2048-100k")
    forecast = make_forecast(synthetic_curve(run, 2), ForecastOptions(resamples=50, fit_until=50000,
                                                                      targets=(0.6, 0.9)))
    fit = forecast.fit
    reach, never = forecast.targets()
    assert reach["reachable"] and reach["gpu_hours"] == pytest.approx(fit.compute_for(0.6))
    assert float(fit.predict(reach["gpu_hours"])) == pytest.approx(0.6)
    assert reach["lo"] < reach["gpu_hours"] < reach["hi"]
    assert not never["reachable"] and never["gpu_hours"] == np.inf
    now = forecast.current()
    assert now["gpu_hours"] == 50000
    assert now["marginal_gain_per_1k_gpu_hours"] == pytest.approx(1000 * slope_at(50000, fit.A, fit.B, fit.C_mid,
                                                                                  fit.R0))
    assert now["fraction_of_gain"] == pytest.approx((now["fitted"] - fit.R0) / (fit.A - fit.R0))
    assert [p["gpu_hours"] for p in forecast.predictions()] == [16000, 50000, 100000]


def test_recommendation_diminishing_returns_vs_worth_continuing():
    run = paper_run("scalerl-8b-14k-gen")
    late = make_forecast(synthetic_curve(run, 0), NO_BOOT)  # 16k GPU-h, far past C_mid = 2.5k
    assert late.recommendation().startswith("Diminishing returns")
    early = make_forecast(synthetic_curve(paper_run("batch-2048-100k"), 0),
                          dataclasses.replace(NO_BOOT, fit_until=20000))
    assert early.recommendation().startswith("Worth continuing")


def test_compare_applies_the_shared_A_rule_and_finds_the_leader():
    efficient = synthetic_curve(PaperRun("fast", 3000, 2.4, 0.60, 16000), seed=0)
    slow = synthetic_curve(PaperRun("slow", 3000, 1.5, 0.605, 16000), seed=1)
    comparison = compare_runs([efficient, slow], dataclasses.replace(NO_BOOT, budgets=(4000, 16000)))
    (pair,) = comparison.pairs
    assert abs(pair["A_difference"]) < 0.02
    shared = pair["shared_A"]
    assert shared["more_efficient"] == "fast-seed0" and shared["B"]["fast-seed0"] > shared["B"]["slow-seed1"]
    assert comparison.linearised_shared_A and comparison.linearised[0].A == comparison.linearised[1].A
    assert comparison.budgets[0]["leader"] == "fast-seed0"
    assert "efficiency" in comparison.recommendation()


def test_crossovers_are_where_the_curves_meet():
    late_bloomer = SigmoidFit(0.70, 1.5, 8000.0, 0.3, 0.0, "lsq")
    early = SigmoidFit(0.60, 2.0, 2000.0, 0.3, 0.0, "lsq")
    (cross,) = crossovers(late_bloomer, early, 100, 100000)
    assert float(late_bloomer.predict(cross)) == pytest.approx(float(early.predict(cross)), abs=1e-9)
    grid = np.geomspace(100, 100000, 200000)  # independent check: first sign change on a fine grid
    first = grid[np.argmax(late_bloomer.predict(grid) > early.predict(grid))]
    assert cross == pytest.approx(first, rel=1e-3)


def test_compare_different_ceilings():
    high = synthetic_curve(paper_run("moe-17bx16-scout"), 0)
    low = synthetic_curve(paper_run("batch-2048-100k"), 0)
    comparison = compare_runs([low, high], NO_BOOT)
    assert comparison.pairs[0]["shared_A"] is None and not comparison.linearised_shared_A
    assert all(row["leader"] == high.name for row in comparison.budgets)
    assert comparison.recommendation().startswith(f"Give the compute to {high.name}")


def test_backtest_scores_the_held_out_tail():
    run = replicate_run(paper_run("scalerl-8b-14k-gen"), seed=3)
    curve = synthetic_curve(run, seed=3)
    backtest = run_backtest(curve, ForecastOptions(resamples=100, fit_until=8000))
    summary = backtest.summary()
    assert summary["held_out_points"] == int((curve.compute > 8000).sum())
    assert summary["mean_abs_error"] < 0.02 and summary["coverage"] >= 0.8
    np.testing.assert_allclose(backtest.errors, backtest.forecast.fit.predict(curve.compute[curve.compute > 8000])
                               - curve.reward[curve.compute > 8000])


def test_curve_from_arrays_roundtrips_through_jsonl(tmp_path):
    curve = Curve.from_arrays([0, 1000, 2000], [0.3, 0.4, 0.45], name="x")
    path = tmp_path / "m.jsonl"
    path.write_text(curve.to_jsonl())
    from megatron_scalerl.forecast.data import load_curve

    loaded = load_curve(path)
    np.testing.assert_array_equal(loaded.compute, curve.compute)
    np.testing.assert_array_equal(loaded.reward, curve.reward)


def test_flat_or_falling_metric_says_no_gain():
    compute = np.linspace(0, 20000, 30)
    noise = np.random.default_rng(0).normal(0, 0.003, 30)
    for reward in (0.4 + noise, 0.5 - compute / 1e5):
        forecast = make_forecast(Curve.from_arrays(compute, reward), ForecastOptions(resamples=20))
        assert not forecast.identifiable and "no gain over R0" in forecast.warnings[0]
        assert forecast.recommendation().startswith("No measurable gain")


def test_prediction_intervals_of_a_small_noisy_run_stay_pass_rates():
    """A demo-sized run: 7 validations of 256 samples from 0.24 to 0.45 over 0.15 GPU-hours. Its bootstrap draws
    spread wide, but a pass rate stays in [0, 1]."""
    compute = np.linspace(0.0, 0.15, 7)
    reward = np.array([0.238, 0.25, 0.31, 0.29, 0.38, 0.41, 0.453])
    forecast = make_forecast(Curve.from_arrays(compute, reward), ForecastOptions(
        resamples=60, budgets=(1.0, 5.0, 100.0), eval_draws=256, min_compute=0.0))
    for prediction in forecast.to_dict()["predictions"]:
        assert 0.0 <= prediction["lo"] <= prediction["reward"] <= prediction["hi"] <= 1.0
