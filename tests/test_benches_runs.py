"""The benches made of whole `scalerl train` runs (two each): PipelineRL-k against synchronous RL, and the live
forecast on against off; at a batch of 4 prompts x 4 samples (the demo's is 16 x 8) and short validations.
(Why every bench runs in a test: tests/bench_utils.py.)"""

from __future__ import annotations

import pytest

from tests.bench_utils import positive, run_bench

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multiprocess]
# the runs' batch and validations, small: the figures are produced and sane at any size
SMALL = ["--set", "rollout.prompts_per_step=4", "--set", "rollout.generations_per_prompt=4", "--set",
         "data.validation_holdout=8", "--set", "data.validation_generations=2"]


def test_live_forecast_bench():
    figures = run_bench("live_forecast.py", "--workload", "random", "--steps", "5", "--warmup", "1", *SMALL,
                        "--validation-interval", "1")
    assert positive(figures["generated_samples_per_s_on_over_off"]) and positive(figures["samples_per_s_on_over_off"])
    assert figures["fits"]["fits"] >= 1 and positive(figures["fits"]["fit_cpu_s_mean"])  # 6 validations: a fit from the 5th


def test_pipeline_bench():
    k = 2
    figures = run_bench("pipeline.py", "--workload", "random", "--steps", "5", "--warmup", "1", "--k", str(k), *SMALL)
    assert positive(figures["ratio_samples_per_s"])
    assert 1 <= figures["pipeline"]["staleness_max"] <= k and figures["sync"]["staleness_max"] == 0
    for mode in ("pipeline", "sync"):
        assert 0 <= figures[mode]["generator_idle_fraction"] <= 1 and positive(figures[mode]["samples_per_s"])
        assert positive(figures[mode]["generator_busy_s_per_batch"]) and positive(figures[mode]["trainer_busy_s_per_batch"])
    bounds = figures["bounds"]  # PipelineRL's estimates from the synchronous run: shared cores below separate devices
    assert 1 <= bounds["ratio_estimate_separate_devices"] and bounds["ratio_estimate_shared_cores"] <= \
        bounds["ratio_estimate_separate_devices"] and 0 <= bounds["generator_idle_separate_devices"] < 1
