"""Calibration of the forecaster's bootstrap intervals against synthetic runs of known parameters (the oracle):
A's interval covers the true ceiling, and prediction intervals beyond the fitted window respect the level the run has
already shown. Rewards are pass rates in [0, 1]; compute is GPU-hours."""

import numpy as np

from megatron_scalerl.forecast.predict import ForecastOptions, make_forecast
from megatron_scalerl.forecast.sigmoid import fit_sigmoid
from megatron_scalerl.forecast.synthetic import TABLE1, PaperRun, replicate_run, simulate_run
from megatron_scalerl.forecast.uncertainty import bootstrap_sigmoid

SMALL_DRAWS = 64 * 4  # the demo's validation: 64 prompts x 4 samples


def test_a_interval_covers_the_true_ceiling_on_runs_with_slow_drift():
    """80 reruns of Table 1 (A, B, C_mid varied, `replicate_run`) with AR(1) drift of correlation 0.5-0.9, the slow
    half (0.8-0.9) over-represented because that is where A was under-covered (87% at 0.9 before the noise prior
    changed), binomial mean@16 noise on 1,000 prompts; fitted on the paper's windows [1.5k GPU-h, budget / 2] and
    [1.5k GPU-h, budget] in turn. The nominal 95% interval of A must cover the true A on 88-99% of them (the goal is
    90-98%; 80 runs carry about 2.5 points of sampling error), and on at least 85% of the slow-drift half."""
    covered, slow = [], []
    for i in range(80):
        seed = 300 + i
        run = replicate_run(TABLE1[i % len(TABLE1)], seed)
        corr = 0.8 + 0.1 * (i % 8) / 7 if i % 2 else 0.5 + 0.3 * (i % 7) / 6
        sim = simulate_run(run, seed, drift_corr=corr)
        until = run.budget / 2 if (i // 10) % 2 else run.budget
        window = (sim.curve.compute >= 1500) & (sim.curve.compute <= until)
        C, y = sim.curve.compute[window], sim.curve.reward[window]
        fit = fit_sigmoid(C, y, sim.curve.reward[0])
        boot = bootstrap_sigmoid(C, y, fit, True, resamples=60, seed=seed, eval_draws=16000)
        lo, hi = boot.interval(boot.A)
        covered.append(lo <= run.A <= hi)
        if corr >= 0.8:
            slow.append(lo <= run.A <= hi)
    assert 0.88 <= np.mean(covered) <= 0.99, np.mean(covered)
    assert np.mean(slow) >= 0.85, np.mean(slow)


def demo_like_run(seed: int):
    """A small run near its ceiling, as the demo's: 16 evaluations every 0.01 GPU-h from 0 to 0.15 GPU-h, 256
    samples each, sigmoid A 0.53, R0 0.22, C_mid 0.02 GPU-h, B 1.9 (96% of the gain reached by 0.15 GPU-h), drift sd
    0.01 with neighbour correlation 0.7."""
    run = PaperRun("demo-like", C_mid=0.02, B=1.9, A=0.53, budget=0.15)
    return simulate_run(run, seed, r0=0.22, num_evals=16, prompts=64, samples_per_prompt=4, drift_sd=0.01,
                        drift_corr=0.7)


def test_prediction_beyond_the_window_stays_near_the_level_the_run_has_shown():
    """The demo's report once predicted 0.566 at 1 GPU-h with the interval [0.324, 0.663] while the run had read
    0.527 at 0.15 GPU-h: the pass-rate draws reflected the refits' upward spread of A into a downward one. The curve
    never falls, so beyond the window a draw may not fall below its own value at the window's end.

    Criterion, on 12 seeds of a demo-like run and at 1 and 5 GPU-h (6.7x and 33x the window): with m the mean of the
    run's last 4 evaluations, the median over seeds of m - lo is at most 0.08 and no lower end lies more than 0.16
    below m. When the curve has stopped rising, what separates the pass rate there from m is a fresh drift value,
    the recent drift and the evaluation noise of m: sd sqrt(2 x 0.01^2 + m (1 - m) / (4 x 256)) = 0.022 here, so
    0.08 is about 3.7 sd (room for the uncertain drift sd and the curve's level), 0.16 twice that. The old
    reflection gave a median of 0.15 and up to 0.35."""
    drops = []
    for seed in range(12):
        curve = demo_like_run(seed).curve
        options = ForecastOptions(min_compute=0.0, budgets=(1.0, 5.0), eval_draws=SMALL_DRAWS, resamples=200,
                                  seed=seed)
        recent = float(np.mean(curve.reward[-4:]))
        predictions = make_forecast(curve, options).predictions()
        for prediction in predictions:
            assert prediction["lo"] <= prediction["reward"] <= prediction["hi"]
            assert prediction["hi"] > recent  # the interval reaches above the level shown, too
        drops.append([recent - prediction["lo"] for prediction in predictions])
    drops = np.array(drops)
    assert np.all(np.median(drops, axis=0) <= 0.08), np.median(drops, axis=0)
    assert drops.max() <= 0.16, drops.max(axis=0)


def test_draws_beyond_the_window_never_fall_below_their_own_end_of_window_value():
    """`Bootstrap.sigmoid_draws`: inside the window the basic bootstrap's draws (fitted curve minus each refit's
    error); beyond it each draw is non-decreasing in compute and at least its value at the last fitted point."""
    sim = demo_like_run(11)
    C, y = sim.curve.compute[1:], sim.curve.reward[1:]
    fit = fit_sigmoid(C, y, sim.curve.reward[0])
    boot = bootstrap_sigmoid(C, y, fit, True, resamples=80, seed=3, eval_draws=SMALL_DRAWS)
    inside = C[::3]
    np.testing.assert_allclose(boot.sigmoid_draws(inside), 2 * fit.predict(inside)[None, :] - boot.curves(inside))
    beyond = np.geomspace(C[-1], 50.0, 40)
    draws = boot.sigmoid_draws(beyond)
    assert np.all(np.diff(draws, axis=1) >= -1e-12)
    assert np.all(draws >= boot.sigmoid_draws([C[-1]]) - 1e-12)
    rewards = boot.rewards(beyond)
    assert rewards.shape == (80, 40) and np.all((rewards >= 0) & (rewards <= 1))
