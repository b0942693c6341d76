"""`trainer.precision`: `auto` resolves to bf16 only where bf16 is native; explicit values are honoured.

Oracles: the CPU's own flags in /proc/cpuinfo, and oneDNN capped to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`), under which any
x86 CPU computes bf16 as an AVX2-only one does (emulated); a timing there shows the emulation is real."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_scalerl.platform import precision
from megatron_scalerl.platform.precision import (
    cpu_flags,
    resolve_precision,
    trainer_dtype,
    with_resolved_precision,
)
from megatron_scalerl.recipe import load_recipe

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def _in_subprocess(code: str, env: dict[str, str]) -> dict:
    """Run `code` (which prints one JSON line) in a fresh interpreter with `env` added: oneDNN reads its ISA cap once
    per process."""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_flags_read_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert {"avx2", "avx512_bf16"} <= cpu_flags(x86) and "bf16" in cpu_flags(arm)
    assert cpu_flags(tmp_path / "absent") == set()


@pytest.mark.parametrize("cpuinfo, onednn, native, says", [
    ("flags\t: fpu avx2 avx512f avx512_bf16\n", True, True, "with avx512_bf16: native bf16"),
    ("flags\t: fpu avx2 amx_bf16 amx_tile\n", True, True, "with amx_bf16: native bf16"),
    ("Features\t: fp asimd bf16\n", True, True, "with bf16: native bf16"),
    ("flags\t: fpu avx2 avx512f\n", True, False, "without avx512_bf16 or amx_bf16 or bf16: bf16 would be emulated"),
    ("flags\t: fpu avx512_bf16\n", False, False, "but oneDNN's bf16 is off"),
    (None, True, False, "flags unreadable: bf16 taken as emulated"),
])
def test_the_cpu_decision_table(tmp_path, monkeypatch, cpuinfo, onednn, native, says):
    """Each row: the CPU's flags (or no readable /proc/cpuinfo) and oneDNN's own check -> native or not."""
    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo)
    monkeypatch.setattr(precision, "CPUINFO", path)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    precision.cpu_bf16_support.cache_clear()
    try:
        assert precision.cpu_bf16_support()[0] == native
        assert says in precision.cpu_bf16_support()[1]
        assert resolve_precision("auto", cuda=False).value == ("bf16" if native else "fp32")
        assert resolve_precision("bf16", cuda=False).emulated_bf16 == (not native)
        assert resolve_precision("fp32", cuda=False).value == "fp32"
    finally:
        precision.cpu_bf16_support.cache_clear()


def test_auto_is_bf16_on_gpus_and_explicit_values_are_honoured():
    assert resolve_precision("auto", cuda=True).value == "bf16"
    for value in ("bf16", "fp32"):
        for cuda in (True, False):
            assert resolve_precision(value, cuda=cuda).value == value
    assert not resolve_precision("bf16", cuda=True).emulated_bf16
    with pytest.raises(ValueError, match="not auto, bf16 or fp32"):
        resolve_precision("fp16", cuda=False)


def test_auto_on_this_cpu_follows_its_flags():
    native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"}) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    resolved = resolve_precision("auto", cuda=False)
    assert resolved.value == ("bf16" if native else "fp32")
    assert resolved.reason.startswith(f"auto -> {resolved.value} (CPU {torch.backends.cpu.get_cpu_capability()}")
    assert resolve_precision("bf16", cuda=False).emulated_bf16 == (not native)


def test_a_cpu_without_native_bf16_trains_in_fp32_and_bf16_there_is_flagged(tmp_path):
    """oneDNN capped to AVX2: `auto` is fp32, an explicit bf16 stays bf16 with the warning flag, and a bf16 matmul is
    measurably slower than an fp32 one there (the reason for all of this)."""
    code = """
import json, time, torch
from megatron_scalerl.platform.precision import resolve_precision
torch.set_num_threads(1)
def gflops(dtype):
    a, b = torch.randn(256, 256, dtype=dtype), torch.randn(256, 256, dtype=dtype)
    a @ b
    t = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * 256**3 / (time.perf_counter() - t) / 1e9
auto, bf16 = resolve_precision("auto", cuda=False), resolve_precision("bf16", cuda=False)
print(json.dumps({"auto": auto.value, "auto_reason": auto.reason, "bf16": bf16.value,
                  "emulated": bf16.emulated_bf16, "fp32_gflops": gflops(torch.float32),
                  "bf16_gflops": gflops(torch.bfloat16)}))
"""
    if not cpu_flags() & {"avx2", "avx512f"}:
        pytest.skip("not an x86 CPU with AVX2: ONEDNN_MAX_CPU_ISA=AVX2 means nothing here")
    out = _in_subprocess(code, AVX2_ONLY)
    assert out["auto"] == "fp32" and "bf16" not in out["auto_reason"].split("(")[0]
    assert out["bf16"] == "bf16" and out["emulated"]
    assert out["bf16_gflops"] * 3 < out["fp32_gflops"], out  # emulated bf16: measured ~36x slower on 2 cores


def test_the_run_record_never_says_auto():
    recipe = load_recipe("demo")
    assert recipe.trainer.precision == "auto"  # the presets' default
    resolved, why = with_resolved_precision(recipe, cuda=False)
    assert resolved.trainer.precision == why.value == resolve_precision("auto", cuda=False).value
    assert resolved.trainer.fp32_lm_head and resolved.model_copy(update={"trainer": recipe.trainer}) == recipe
    gpu, _ = with_resolved_precision(recipe, cuda=True)
    assert gpu.trainer.precision == "bf16"
    explicit = load_recipe("demo", ["trainer.precision=fp32"])
    assert with_resolved_precision(explicit, cuda=True)[0] == explicit


def test_trainer_dtype_resolves_auto_for_this_process():
    expected = torch.bfloat16 if resolve_precision("auto", cuda=torch.cuda.is_available()).value == "bf16" \
        else torch.float32
    assert trainer_dtype(load_recipe("demo")) == expected
    assert trainer_dtype(load_recipe("demo", ["trainer.precision=fp32"])) == torch.float32
    assert trainer_dtype(load_recipe("demo", ["trainer.precision=bf16"])) == torch.bfloat16
