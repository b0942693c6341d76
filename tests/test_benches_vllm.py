"""The benches that start vLLM engines: weight sync into a server (against disk), the fleet against offline
generate, and the trainer's log-probs against the generator's (MoE routes, tied heads).
(Why every bench runs in a test: tests/bench_utils.py.)"""

from __future__ import annotations

import pytest

from tests.bench_utils import TINY_MODEL, positive, run_bench

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


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


def test_generation_bench():
    """The bench's default model (dense); the MoE fleet's samples against transformers' are
    tests/test_routing_capture.py's."""
    figures = run_bench("generation.py", "--prompts", "4", "--prompt-tokens", "8", "--max-tokens", "8",
                        "--max-num-seqs", "4", "--repeats", "1")
    assert figures["model"] == "dense"
    assert 0 < figures["fleet_tokens"] == figures["offline_tokens"] <= 4 * 8  # seeded: both sides sample the same
    assert positive(figures["ratio_tokens_per_s"])


def test_routing_mismatch_bench():
    """fp32 on both sides, the bench's default model (the demo's tiny Llama-4 MoE): the trainer's log-probs are the
    generator's, routed itself or replaying (at any size). Both MoE families' replayed log-probs against the server's
    are tests/test_routing_capture.py's."""
    figures = run_bench("routing_mismatch.py", "--precision", "fp32", "--prompts", "2", "--samples", "2",
                        "--max-tokens", "16")
    assert figures["samples"] == 4 and figures["completion_tokens"] > 0
    assert (figures["arch"], figures["top_k"]) == ("llama4", 1)
    for arm in ("own_routing", "replay"):
        assert figures[arm]["routing_agreement"] == 1.0 and figures[arm]["max_abs_dlogprob"] < 1e-4, figures


def test_tied_head_mismatch_bench():
    """fp32 on both sides: the trainer's log-probs are the generator's, tied embeddings or not."""
    figures = run_bench("tied_head_mismatch.py", "--precision", "fp32", "--prompts", "2", "--samples", "2",
                        "--max-tokens", "16")
    assert figures["resolved_precision"] == "fp32" and figures["generator_dtype"] == "float32"
    for variant in ("tied", "untied"):
        assert figures[variant]["tokens"] > 0 and figures[variant]["max_abs_dlogprob"] < 1e-4, figures
