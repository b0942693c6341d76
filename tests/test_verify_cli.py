"""`scalerl verify logits`: one command, any layout, one JSON object on the last line; bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.recipe import load_recipe

pytestmark = pytest.mark.multiprocess


def _scalerl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    model_cfg = load_recipe("scalerl", model_preset="tiny_moe").model.model_copy(
        update=dict(num_layers=2, hidden_size=64, ffn_hidden_size=64, moe_ffn_hidden_size=32, vocab_size=128,
                    nope_layer_interval=2)
    )
    return str(save_random_hf_model(model_cfg, tmp_path_factory.mktemp("hf") / "moe", seed=1, std=0.1))


def _report(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # an end-to-end run of its own (make test-fast stays under 10 minutes)
def test_verify_logits_tp1(moe_dir):
    report = _report(_scalerl("verify", "logits", "--hf", moe_dir))
    assert report["layout"] == "TP1xPP1xEP1" and report["world_size"] == 1
    assert report["seq_len"] == 32 + 16  # longer than the attention chunk
    assert report["ok"] and report["max_abs_diff"] <= 1e-4
    assert report["loss_megatron"] == pytest.approx(report["loss_hf"], rel=1e-5)


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory) -> dict[str, str]:
    """Random Qwen3 (tied embeddings) and Qwen3-MoE (8 experts, top-2) checkpoints, written by transformers."""
    root = tmp_path_factory.mktemp("qwen3")
    small = dict(num_layers=2, hidden_size=64, ffn_hidden_size=64, vocab_size=128)
    dirs = {}
    for preset, update in (("tiny_qwen3", small), ("tiny_qwen3_moe", {**small, "moe_ffn_hidden_size": 32})):
        model_cfg = load_recipe("scalerl", model_preset=preset).model.model_copy(update=update)
        dirs[preset] = str(save_random_hf_model(model_cfg, root / preset, seed=1, std=0.1))
    return dirs


@pytest.mark.slow  # an end-to-end run of its own (make test-fast stays under 10 minutes)
@pytest.mark.parametrize("preset", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_verify_logits_qwen3(preset, qwen3_dirs):
    """Both Qwen3 families verify (model_type qwen3 / qwen3_moe); no attention chunk, so 64 tokens by default."""
    report = _report(_scalerl("verify", "logits", "--hf", qwen3_dirs[preset]))
    assert report["layout"] == "TP1xPP1xEP1" and report["seq_len"] == 64
    assert report["ok"] and report["max_abs_diff"] <= 1e-4
    assert report["loss_megatron"] == pytest.approx(report["loss_hf"], rel=1e-5)


@pytest.mark.slow
def test_verify_logits_tp2_ep2(moe_dir):
    report = _report(_scalerl("verify", "logits", "--hf", moe_dir, "--tp", "2", "--ep", "2"))
    assert report["layout"] == "TP2xPP1xEP2" and report["world_size"] == 4
    assert report["ok"] and report["max_abs_diff"] <= 1e-4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--megatron", "/nonexistent/iter_0000001"], "--megatron /nonexistent/iter_0000001: not a complete checkpoint"),
        (["--tp", "3"], "parallelism.tp: tp=3 does not divide model.num_attention_heads=4"),
        (["--ep", "0"], "--ep: must be >= 1, got 0"),
    ],
)
def test_verify_logits_bad_input(moe_dir, args, message):
    proc = _scalerl("verify", "logits", "--hf", moe_dir, *args, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {message}")


def test_verify_logits_not_an_hf_dir(tmp_path):
    proc = _scalerl("verify", "logits", "--hf", str(tmp_path), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path}: not an HF checkpoint directory (no config.json)"
