"""Every benchmark in bench/ runs to its JSON line at a tiny size, so that none of them rots between the stops that
measure with them (bench/weight_sync.py once did: its transport's API had changed under it). The figures at these
sizes mean nothing; what is checked is that each bench completes and reports the fields the README's tables quote,
with the invariants that hold at any size."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ["--hidden", "256", "--layers", "2", "--vocab", "512"]


def run_bench(script: str, *args: str, timeout_s: float = 600) -> dict:
    """Run bench/`script` with `args`; its last stdout line, parsed as the JSON object every bench ends with."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.stderr[-4000:]}"
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict)
    return figures


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_forecast_bench():
    figures = run_bench("forecast.py", "--seeds", "1", "--calibration-runs", "4", "--resamples", "5")
    assert figures["curves"] == 10  # the paper's Table 1 runs, once each
    assert positive(figures["lsq_median_fit_ms"]) and positive(figures["speedup"])
    assert 0 <= figures["lsq_more_accurate_fraction"] <= 1


def test_logprobs_bench():
    figures = run_bench("logprobs.py", "--tokens", "256", "--hidden", "32", "--vocab", "512", "--chunk", "64",
                        "--repeats", "1")
    assert positive(figures["time_ratio_chunked_over_naive"])
    assert figures["memory_ratio_chunked_over_naive"] >= 0


def test_losses_bench():
    figures = run_bench("losses.py", "--prompts", "2", "--per-prompt", "4", "--seq-len", "64", "--repeats", "1")
    assert figures["results"] and all(positive(r["speedup"]) for r in figures["results"].values())


def test_precision_bench():
    from megatron_scalerl.platform.precision import resolve_precision

    figures = run_bench("precision.py", "--samples", "8", "--max-len", "34", "--micro-batch", "4", "--warmup", "1",
                        "--steps", "1")
    assert figures["auto_resolves_to"] == resolve_precision("auto", cuda=False).value
    assert (figures["auto_resolves_to"] == "bf16") == figures["bf16_native"]
    assert all(positive(figures[key][p]) for key in ("step_s", "tokens_per_s", "matmul_gflops")
               for p in ("fp32", "bf16"))
    assert positive(figures["bf16_step_time_over_fp32"])


def test_train_step_bench():
    figures = run_bench("train_step.py", "--models", "tiny_dense,tiny_qwen3", "--samples", "8", "--max-len", "34",
                        "--warmup", "1", "--steps", "1")
    for model in ("tiny_dense", "tiny_qwen3"):
        layouts = figures["results"][model]
        assert layouts and all(positive(layout["tokens_per_s"]) for layout in layouts.values())
    assert figures["results"]["tiny_dense"]["TP1"]["vs_first_of_kind"] == 1.0
    assert positive(figures["results"]["tiny_qwen3"]["TP1"]["vs_first_of_kind"])


@pytest.mark.parametrize("layout, tp_pp", [(("--tp", "2"), (2, 1)), (("--pp", "2"), (1, 2))], ids=["tp2", "pp2"])
def test_weight_sync_bench(layout, tp_pp):
    figures = run_bench("weight_sync.py", *TINY_MODEL, *layout, "--buckets", "1", "--repeats", "1")
    assert (figures["tp"], figures["pp"]) == tp_pp and positive(figures["wire_mib"])
    for key in ("ratio_flat_over_sync_1_MiB", "ratio_fresh_over_sync_1_MiB", "ceiling_sync_1_MiB"):
        assert positive(figures[key]), key
    assert positive(figures["core_seconds"]["sync 1 MiB"]["senders"])
    assert positive(figures["core_seconds"]["sync 1 MiB"]["receivers"])


def test_weight_sync_vs_disk_bench():
    figures = run_bench("weight_sync_vs_disk.py", *TINY_MODEL, "--buckets", "1", "--repeats", "1")
    results = figures["results"]
    assert set(results) == {"live 1 MiB, staging auto", "live 1 MiB, staging off", "disk transport 1 MiB",
                            "disk round trip"}
    assert all(positive(r["seconds"]) and positive(r["paused_s"]) for r in results.values())
    assert results["live 1 MiB, staging off"]["staged"] is False and results["disk round trip"]["staged"] is False


@pytest.mark.parametrize("model", [(), ("--preset", "tiny_qwen3_moe")], ids=["dense", "tiny_qwen3_moe"])
def test_generation_bench(model):
    figures = run_bench("generation.py", "--prompts", "4", "--prompt-tokens", "8", "--max-tokens", "8",
                        "--max-num-seqs", "4", "--repeats", "1", *model)
    assert figures["model"] == (model[1] if model else "dense")
    assert 0 < figures["fleet_tokens"] == figures["offline_tokens"] <= 4 * 8  # seeded: both sides sample the same
    assert positive(figures["ratio_tokens_per_s"])


def test_live_forecast_bench():
    figures = run_bench("live_forecast.py", "--workload", "random", "--steps", "12", "--warmup", "2",
                        "--validation-interval", "2")
    assert positive(figures["generated_samples_per_s_on_over_off"]) and positive(figures["samples_per_s_on_over_off"])
    assert figures["fits"]["fits"] >= 1 and positive(figures["fits"]["fit_cpu_s_mean"])  # 7 validations: fits


def test_pipeline_bench():
    k = 2
    figures = run_bench("pipeline.py", "--workload", "random", "--steps", "5", "--warmup", "1", "--k", str(k))
    assert positive(figures["ratio_samples_per_s"])
    assert 1 <= figures["pipeline"]["staleness_max"] <= k and figures["sync"]["staleness_max"] == 0
    for mode in ("pipeline", "sync"):
        assert 0 <= figures[mode]["generator_idle_fraction"] <= 1 and positive(figures[mode]["samples_per_s"])
        assert positive(figures[mode]["generator_busy_s_per_batch"]) and positive(figures[mode]["trainer_busy_s_per_batch"])
    bounds = figures["bounds"]  # PipelineRL's estimates from the synchronous run: shared cores below separate devices
    assert 1 <= bounds["ratio_estimate_separate_devices"] and bounds["ratio_estimate_shared_cores"] <= \
        bounds["ratio_estimate_separate_devices"] and 0 <= bounds["generator_idle_separate_devices"] < 1


@pytest.mark.parametrize("preset, arch, top_k", [("tiny_moe", "llama4", 1), ("tiny_qwen3_moe", "qwen3_moe", 2)])
def test_routing_mismatch_bench(preset, arch, top_k):
    """fp32 on both sides: the trainer's log-probs are the generator's, routed itself or replaying (at any size)."""
    figures = run_bench("routing_mismatch.py", "--model-preset", preset, "--precision", "fp32", "--prompts", "2",
                        "--samples", "2", "--max-tokens", "16")
    assert figures["samples"] == 4 and figures["completion_tokens"] > 0
    assert (figures["arch"], figures["top_k"]) == (arch, top_k)
    for arm in ("own_routing", "replay"):
        assert figures[arm]["routing_agreement"] == 1.0 and figures[arm]["max_abs_dlogprob"] < 1e-4, figures


def test_tied_head_mismatch_bench():
    """fp32 on both sides: the trainer's log-probs are the generator's, tied embeddings or not."""
    figures = run_bench("tied_head_mismatch.py", "--precision", "fp32", "--prompts", "2", "--samples", "2",
                        "--max-tokens", "16")
    assert figures["resolved_precision"] == "fp32" and figures["generator_dtype"] == "float32"
    for variant in ("tied", "untied"):
        assert figures[variant]["tokens"] > 0 and figures[variant]["max_abs_dlogprob"] < 1e-4, figures


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
