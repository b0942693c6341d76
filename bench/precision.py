"""Benchmark: the trainer's step in bf16 against fp32 on this CPU, and what `trainer.precision: auto` picks here.

The same real train step as bench/train_step.py (its `run_layout`: the trainer's `Trainer.train_step`, megatron-core
model, distributed optimizer, one spawned gloo worker with one thread) at the demo's size (tiny Llama-4 MoE, 16 x 8
samples of up to 192 tokens, micro-batches of 64), once in fp32 (the baseline) and once in bf16, from the same
weights; plus a 512 x 512 matmul in each dtype on one thread. Ratios are bf16 / fp32 (step time: > 1 is slower).

On a CPU without native bf16 (AVX2 only, or AVX512 without its BF16 extension) torch emulates bf16 and the step
crawls; `auto` then resolves to fp32 (`platform.precision`). Any CPU with AVX512-BF16 can be made to compute bf16 as
an AVX2-only one does by capping oneDNN: `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`. The first lines print
the capability torch reports and whether bf16 is native, to write beside the figures.

    OMP_NUM_THREADS=1 python bench/precision.py [--samples 128 --max-len 192 --micro-batch 64] [--warmup 2 --steps 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from train_step import run_layout  # this folder's layout benchmark: the same step, one layout

from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.platform.precision import cpu_bf16_support, resolve_precision
from megatron_scalerl.recipe import load_recipe

MODEL = "tiny_moe"  # the demo's model
PRECISIONS = ("fp32", "bf16")  # baseline first


def matmul_gflops(dtype: torch.dtype, size: int = 512, repeats: int = 10) -> float:
    """GFLOP/s of a size x size matmul on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        return repeats * 2 * size**3 / (time.perf_counter() - start) / 1e9
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=128, help="samples per step, a multiple of 4")
    p.add_argument("--max-len", type=int, default=192, help="longest sample, tokens (prompt + completion)")
    p.add_argument("--micro-batch", type=int, default=64, help="micro-batch size, samples")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (>= 1)")
    p.add_argument("--steps", type=int, default=5, help="measured steps; the median is reported")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per precision")
    args = p.parse_args()
    if args.samples % 4 or args.warmup < 1 or args.steps < 1 or args.max_len < 34:
        p.error("need --samples a multiple of 4, --warmup >= 1, --steps >= 1, --max-len >= 34")

    native, cpu = cpu_bf16_support()
    auto = resolve_precision("auto", cuda=False).value
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"CPU capability {capability}; {cpu}; ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}; "
          f"trainer.precision auto -> {auto}")
    scratch = tempfile.TemporaryDirectory(prefix="bench_precision_")
    hf_dir = str(save_random_hf_model(load_recipe("scalerl", model_preset=MODEL).model, Path(scratch.name), seed=0))
    rows, gflops = {}, {}
    for precision in PRECISIONS:
        run_args = copy.copy(args)
        run_args.precision, run_args.hf_dirs = precision, {MODEL: hf_dir}
        rows[precision] = run_layout(MODEL, {}, run_args)
        gflops[precision] = matmul_gflops(torch.float32 if precision == "fp32" else torch.bfloat16)
    failed = {k: r["error"] for k, r in rows.items() if "error" in r}
    if failed:
        raise SystemExit(f"failed: {failed}")
    step_ratio = rows["bf16"]["step_s"] / rows["fp32"]["step_s"]
    matmul_ratio = gflops["bf16"] / gflops["fp32"]
    print(f"train step, {MODEL}, {args.samples} samples of <= {args.max_len} tokens, micro-batch {args.micro_batch}, "
          f"1 process, 1 thread, median of {args.steps}:")
    print(f"{'precision':9} {'step s':>8} {'tokens/s':>9} {'matmul GFLOP/s':>15}")
    for precision in PRECISIONS:
        r = rows[precision]
        print(f"{precision:9} {r['step_s']:8.3f} {r['tokens_per_s']:9.0f} {gflops[precision]:15.1f}")
    print(f"bf16 / fp32: step time {step_ratio:.2f}x, matmul throughput {matmul_ratio:.3f}x")
    print(json.dumps({"bench": "precision", "cpu_capability": capability, "bf16_native": native, "cpu": cpu,
                      "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "auto_resolves_to": auto,
                      "samples": args.samples, "max_len": args.max_len, "micro_batch": args.micro_batch,
                      "step_s": {k: round(r["step_s"], 4) for k, r in rows.items()},
                      "tokens_per_s": {k: round(r["tokens_per_s"], 1) for k, r in rows.items()},
                      "matmul_gflops": {k: round(v, 2) for k, v in gflops.items()},
                      "bf16_step_time_over_fp32": round(step_ratio, 3),
                      "bf16_matmul_throughput_over_fp32": round(matmul_ratio, 4)}))


if __name__ == "__main__":
    main()
