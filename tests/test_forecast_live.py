"""The live forecast: its status rules on synthetic runs of known parameters (the paper's 8B run), its figures, and
the orchestrator's fitting process, which must never hold up the event loop that drives generation."""

import asyncio
import json
import time

import numpy as np
import pytest

from megatron_scalerl.forecast.data import Curve
from megatron_scalerl.forecast.live import STATUS_CODES, ceiling_reached, live_forecast
from megatron_scalerl.forecast.predict import ForecastOptions
from megatron_scalerl.forecast.synthetic import paper_run, simulate_run
from megatron_scalerl.recipe import load_recipe

RUN = paper_run("scalerl-8b-14k-gen")  # A 0.610, B 1.92, C_mid 2542 GPU-h
OPTIONS = ForecastOptions(resamples=100)  # the paper's window: from 1.5k GPU-h


def _status(budget: float, seed: int) -> str:
    return live_forecast(simulate_run(RUN, seed=seed, budget=budget, num_evals=int(budget / 200)).curve,
                         OPTIONS).status


def test_a_run_just_past_the_cutoff_is_too_early_and_a_run_far_past_c_mid_has_plateaued():
    assert [_status(1600, seed) for seed in range(5)] == ["too-early"] * 5  # < MIN_POINTS in the window
    assert [_status(2400, seed) for seed in range(5)].count("plateaued") == 0  # before C_mid: never a plateau
    assert [_status(16000, seed) for seed in range(5)] == ["plateaued"] * 5  # 6x C_mid: 96% of the gain


def test_a_collapse_is_diverging():
    curve = simulate_run(RUN, seed=1, budget=16000, num_evals=80).curve
    reward = curve.reward.copy()
    reward[-3:] -= 0.15
    live = live_forecast(Curve.from_arrays(curve.compute, reward), OPTIONS)
    assert live.status == "diverging" and "below the best 3 in a row" in live.reason


def test_a_ceiling_bounded_only_from_below_is_told_apart():
    """A flat run whose A interval reaches the fit's bound (1.0), like the demo's: plateaued when the flat stretch is
    seen over 4x compute, too-early from a short window; either way the reason says the bound is the fit's."""
    compute = np.geomspace(0.02, 0.16, 16)  # 8x in compute, as the demo's 16 validations
    reward = 0.27 + 0.29 / (1 + (0.045 / compute) ** 2) + np.random.default_rng(3).normal(0, 0.03, 16)  # a draw whose A interval reaches 1
    options = ForecastOptions(min_compute=0, budgets=(1.0,))
    live = live_forecast(Curve.from_arrays(compute, reward), options)
    assert live.a_hi_at_bound and live.status == "plateaued" and "only from below" in live.reason
    assert live.figures()["forecast/A_hi_at_bound"] == 1.0 and live.progress().endswith(", bound]")
    short = live_forecast(Curve.from_arrays(compute[-6:], reward[-6:]), options)  # 2.3x in compute
    assert short.a_hi_at_bound and short.status in ("too-early", "on-track")


def test_figures_hold_every_key_under_the_prefix():
    curve = simulate_run(RUN, seed=2, budget=16000, num_evals=80).curve
    live = live_forecast(curve, ForecastOptions(resamples=50, budgets=(16000.0, 50000.0)), target=0.6)
    figures = live.figures("forecast/aime24/")
    for key in ("A", "A_lo", "A_hi", "A_hi_at_bound", "B", "C_mid", "points", "status", "status_code",
                "reward_at/16000", "reward_at/50000", "target_reachable", "gpu_hours_to_target"):
        assert f"forecast/aime24/{key}" in figures, key
    assert figures["forecast/aime24/status_code"] == STATUS_CODES[figures["forecast/aime24/status"]]
    assert abs(figures["forecast/aime24/A"] - RUN.A) < 0.03
    assert figures["forecast/aime24/A_lo"] <= figures["forecast/aime24/A"] <= figures["forecast/aime24/A_hi"]
    unreachable = live_forecast(curve, ForecastOptions(resamples=0), target=0.95).figures()
    assert unreachable["forecast/target_reachable"] == 0.0 and "forecast/gpu_hours_to_target" not in unreachable
    early = live_forecast(Curve.from_arrays([0.0, 1.0], [0.3, 0.35]), ForecastOptions(min_compute=0)).figures()
    assert early == {"forecast/status": "too-early", "forecast/status_code": 0.0}


def test_stop_at_fraction_needs_a_narrowly_known_ceiling_and_the_reward_there():
    curve = simulate_run(RUN, seed=2, budget=16000, num_evals=80).curve  # 96% of its gain: plateaued
    live = live_forecast(curve, OPTIONS)
    low, high = live.a_interval
    assert live.status == "plateaued" and high - low < 0.1 and not live.a_hi_at_bound
    recent = float(np.mean(curve.reward[-3:]))
    reason = ceiling_reached(live, 0.95 * recent / live.forecast.fit.A)
    assert reason is not None and "of the ceiling A = " in reason and "stop_at_fraction" in reason
    assert ceiling_reached(live, 1.02 * recent / live.forecast.fit.A) is None  # not there yet
    early = live_forecast(simulate_run(RUN, seed=2, budget=2400, num_evals=12).curve, OPTIONS)
    assert early.status != "plateaued" and ceiling_reached(early, 0.01) is None  # A not known: never stops
    compute = np.geomspace(0.02, 0.16, 16)  # the demo-like flat run whose A interval reaches the bound
    reward = 0.27 + 0.29 / (1 + (0.045 / compute) ** 2) + np.random.default_rng(3).normal(0, 0.03, 16)  # a draw whose A interval reaches 1
    bounded = live_forecast(Curve.from_arrays(compute, reward), ForecastOptions(min_compute=0, budgets=(1.0,)))
    assert bounded.a_hi_at_bound and ceiling_reached(bounded, 0.5) is None  # A known only from below


def _metrics_file(run_dir, eval_every: int = 0) -> None:
    """RUN/metrics.jsonl of a synthetic run: its validations, and (every `eval_every`-th) an eval watcher's row."""
    curve = simulate_run(RUN, seed=3, budget=16000, num_evals=60).curve
    rows = [{"step": i, "role": "orchestrator", "val/pass_rate": float(r), "gpu_hours": float(c)}
            for i, (c, r) in enumerate(zip(curve.compute, curve.reward, strict=True))]
    if eval_every:
        aime = simulate_run(RUN, seed=4, budget=16000, num_evals=60, prompts=30, samples_per_prompt=32).curve
        rows += [{"step": i, "role": "eval", "eval/aime24/mean_at_k": float(aime.reward[i]),
                  "eval/aime24/pass_at_k/32": 0.9, "gpu_hours": float(aime.compute[i])}
                 for i in range(0, 60, eval_every)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_further_curve_is_fitted_under_its_own_keys_and_report(tmp_path):
    """An eval watcher's curve beside the validation: `forecast/eval/aime24/...` and RUN/forecast/eval/aime24/; the
    stop rule reads the primary curve only."""
    from megatron_scalerl.forecast.data import MetricsTable
    from megatron_scalerl.orchestrator.live_forecast import fit_run, further_curves

    _metrics_file(tmp_path, eval_every=3)
    assert further_curves(MetricsTable.read(tmp_path)) == {"eval/aime24": "eval/aime24/mean_at_k"}
    config = load_recipe("scalerl", ["forecast.resamples=50", "forecast.stop_at_fraction=0.5"]).forecast
    result = fit_run(str(tmp_path), config, None)
    assert result.figures["forecast/status"] == "plateaued" and result.figures["forecast/eval/aime24/points"] >= 5
    assert result.figures["forecast/eval/aime24/status"] in STATUS_CODES
    assert abs(result.figures["forecast/eval/aime24/A"] - RUN.A) < 0.05
    assert (tmp_path / "forecast" / "eval" / "aime24" / "forecast.json").is_file()
    assert result.stop_reason is not None and "0.5" in result.stop_reason
    assert fit_run(str(tmp_path), load_recipe("scalerl", ["forecast.resamples=50"]).forecast, None).stop_reason is None


def test_the_fit_runs_beside_the_event_loop_and_writes_its_report_atomically(tmp_path):
    """The orchestrator's LiveForecaster on a run directory's metrics: the loop that drives generation keeps its
    pace (a 10 ms ticker) while the fitting process works for seconds, and RUN/forecast/ holds a complete report."""
    from megatron_scalerl.orchestrator.live_forecast import LiveForecaster

    _metrics_file(tmp_path)
    config = load_recipe("scalerl", ["forecast.resamples=400"]).forecast

    async def scenario():
        live = LiveForecaster(tmp_path, config)
        results = live.results()
        gaps, last = [], time.monotonic()
        live.validated(58)
        live.validated(59)  # lands while the first fit runs: covered by one more fit
        got = asyncio.ensure_future(_collect(results, 2))
        while not got.done():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        live.close()
        return got.result(), gaps

    (first, second), gaps = asyncio.run(scenario())
    assert [first[0], second[0]] == [58, 59]
    assert second[1].figures["forecast/status"] == "plateaued" and second[1].cpu_s > 0.1
    assert max(gaps) < 0.25, max(gaps)  # the loop never waited on a fit
    report = tmp_path / "forecast"
    assert json.loads((report / "forecast.json").read_text())["status"] == "plateaued"
    assert {p.name for p in report.iterdir()} == {"forecast.json", "report.md", "report.html", "forecast.png"}


async def _collect(results, count: int) -> list:
    out = []
    async for item in results:
        out.append(item)
        if len(out) == count:
            return out
    return out


def test_stop_at_fraction_is_refused_where_it_could_never_fire():
    from megatron_scalerl.errors import RecipeError

    assert load_recipe("demo", ["forecast.stop_at_fraction=0.95"]).forecast.stop_at_fraction == 0.95
    for off in ("forecast.live=false", "forecast.resamples=0", "data.validation_holdout=0"):
        with pytest.raises(RecipeError, match="forecast.stop_at_fraction: needs the live forecast"):
            load_recipe("demo", ["forecast.stop_at_fraction=0.95", off])


def test_a_finished_record_names_a_known_reason(tmp_path):
    from megatron_scalerl.errors import UserError
    from megatron_scalerl.run.directory import read_finished, write_finished

    assert read_finished(tmp_path) is None
    write_finished(tmp_path, "max_gpu_hours", 7, 0.25)
    assert read_finished(tmp_path) == {"reason": "max_gpu_hours", "step": 7, "gpu_hours": 0.25}
    (tmp_path / "finished.json").write_text(json.dumps({"reason": "bored", "step": 1, "gpu_hours": 0.1}))
    with pytest.raises(UserError, match="finished.json.*'bored' is not one of"):
        read_finished(tmp_path)


@pytest.mark.parametrize("preset", ["scalerl", "demo"])
def test_presets_carry_a_forecast_section(preset):
    forecast = load_recipe(preset).forecast
    assert forecast.live and forecast.budgets and 0 < forecast.target < 1
    assert (forecast.min_compute == 1500) == (preset == "scalerl")  # the paper's cutoff; the demo fits all
