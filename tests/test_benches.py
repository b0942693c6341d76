"""The benches that start no vLLM engine and no launch: the forecaster's fits, the log-prob and loss kernels, the
trainer's precision and layouts, a checkpoint's stall and the code verifier's cases.
(Why every bench runs in a test: tests/bench_utils.py.)"""

from __future__ import annotations

import pytest

from tests.bench_utils import positive, run_bench

pytestmark = pytest.mark.slow


def test_forecast_bench():
    figures = run_bench("forecast.py", "--seeds", "1", "--calibration-runs", "4", "--resamples", "5")
    assert figures["curves"] == 10  # the paper's Table 1 runs, once each
    assert positive(figures["lsq_median_fit_ms"]) and positive(figures["speedup"])
    assert 0 <= figures["lsq_more_accurate_fraction"] <= 1


def test_logprobs_bench():
    """Logits of 16 MiB: large enough for the peak-RSS measurement to see them."""
    figures = run_bench("logprobs.py", "--tokens", "1024", "--hidden", "32", "--vocab", "4096", "--chunk", "256",
                        "--repeats", "1")
    assert positive(figures["time_ratio_chunked_over_naive"]) and positive(figures["naive_peak_mib"])
    assert 0 <= figures["memory_ratio_chunked_over_naive"] < 1


def test_losses_bench():
    figures = run_bench("losses.py", "--prompts", "2", "--per-prompt", "4", "--seq-len", "64", "--repeats", "1")
    assert figures["results"] and all(positive(r["speedup"]) for r in figures["results"].values())


@pytest.mark.multiprocess
def test_precision_bench():
    from megatron_scalerl.platform.precision import resolve_precision

    figures = run_bench("precision.py", "--samples", "8", "--max-len", "34", "--micro-batch", "4", "--warmup", "1",
                        "--steps", "1")
    assert figures["auto_resolves_to"] == resolve_precision("auto", cuda=False).value
    assert (figures["auto_resolves_to"] == "bf16") == figures["bf16_native"]
    assert all(positive(figures[key][p]) for key in ("step_s", "tokens_per_s", "matmul_gflops")
               for p in ("fp32", "bf16"))
    assert positive(figures["bf16_step_time_over_fp32"])


@pytest.mark.multiprocess
def test_train_step_bench():
    figures = run_bench("train_step.py", "--models", "tiny_dense,tiny_qwen3", "--samples", "8", "--max-len", "34",
                        "--warmup", "1", "--steps", "1")
    for model in ("tiny_dense", "tiny_qwen3"):
        layouts = figures["results"][model]
        assert layouts and all(positive(layout["tokens_per_s"]) for layout in layouts.values())
    assert figures["results"]["tiny_dense"]["TP1"]["vs_first_of_kind"] == 1.0
    assert positive(figures["results"]["tiny_qwen3"]["TP1"]["vs_first_of_kind"])


@pytest.mark.multiprocess
def test_checkpoint_stall_bench():
    figures = run_bench("checkpoint_stall.py", "--ep", "1", "--samples", "8", "--max-len", "48", "--micro-batch", "8",
                        "--warmup", "1", "--steps", "1")
    assert positive(figures["step_s"]) and positive(figures["checkpoint_s"]) and positive(figures["checkpoint_mib"])
    assert figures["ratio_checkpoint_over_step"] == pytest.approx(figures["checkpoint_s"] / figures["step_s"],
                                                                  rel=0.01)


def test_code_verifier_bench():
    figures = run_bench("code_verifier.py", "--cases", "2", "--repeats", "1")
    assert figures["sandbox"] == "bwrap" and figures["cases"] == 2
    assert all(figures[key] > 0 for key in ("bare_ms_per_case", "cases_ms_per_case", "asserts_ms_per_case"))


def test_process_exit_bench():
    figures = run_bench("process_exit.py", "--imports", "torch", "--repeats", "1")
    torch_figures = figures["imports"]["torch"]
    assert all(positive(torch_figures[key]) for key in ("floor_cpu_s", "usual_cpu_s", "exit_with_cpu_s"))
    assert torch_figures["exit_with_vs_usual"] == pytest.approx(
        torch_figures["exit_with_cpu_s"] / torch_figures["usual_cpu_s"], abs=0.002)
