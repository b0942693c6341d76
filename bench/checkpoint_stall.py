"""Benchmark: how long a checkpoint stalls the trainer, against the train step it interrupts.

The real trainer (`trainer.trainer.Trainer` in a scratch run directory, megatron-core model, distributed optimizer) of
the tiny Llama-4 MoE on spawned gloo workers (one thread each), at `--ep` (the demo's EP=2 by default), on the same
batch as bench/train_step.py (`bench_batch`): `--warmup` steps, then `--steps` times one train step followed by one
`Trainer.checkpoint()` (model, optimizer and RL state, then the pruning: on CPU megatron-core's asynchronous save
runs in place, as its queue that runs it in the background is CUDA-bound; on GPUs the stall is the copy to host memory
and the writer's start, not measured here). Medians, seconds, of the slowest rank; the
ratio is checkpoint / step (the baseline: the step itself). The first lines print the CPU capability torch reports
and whether bf16 is native, to write beside the figures. The last line is one JSON object.

    OMP_NUM_THREADS=1 python bench/checkpoint_stall.py [--ep 2] [--samples 128 --max-len 192 --micro-batch 64]
        [--warmup 1 --steps 3] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from train_step import bench_batch, layout_recipe  # this folder's layout benchmark: the same recipe and batch

from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.platform.precision import cpu_bf16_support
from megatron_scalerl.recipe import load_recipe

MODEL = "tiny_moe"


def measure_rank(rank: int, run_dir: str, sizes: dict[str, int], args: argparse.Namespace) -> dict:
    """On one worker: per measured round, the step's and the checkpoint's wall seconds (after a barrier each)."""
    import torch.distributed as dist

    from megatron_scalerl.trainer.trainer import Trainer

    recipe = layout_recipe(MODEL, sizes, args)
    batch = bench_batch(recipe, args.max_len)
    trainer = Trainer(run_dir, recipe)
    for _ in range(args.warmup):
        trainer.train_step(batch)
    steps, checkpoints = [], []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(batch)
        steps.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        trainer.checkpoint()
        checkpoints.append(time.perf_counter() - start)
    size = sum(p.stat().st_size for p in trainer.store.path(trainer.saved_step).rglob("*") if p.is_file())
    return {"steps": steps, "checkpoints": checkpoints, "checkpoint_mib": size / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, default=2, help="expert parallelism = processes (the demo's: 2)")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=192)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    capability, (native, why) = torch.backends.cpu.get_cpu_capability(), cpu_bf16_support()
    print(f"cpu capability {capability}, bf16 native: {native} ({why}); trainer {args.precision}")
    sizes = {"ep": args.ep, "dp": args.ep}
    with tempfile.TemporaryDirectory() as tmp:
        args.hf_dirs = {MODEL: str(save_random_hf_model(load_recipe("scalerl", model_preset=MODEL).model,
                                                        Path(tmp) / "hf", seed=0))}
        ranks = run_local_workers(measure_rank, args.ep, str(Path(tmp) / "run"), sizes, args, timeout_s=1800)
    step_s = statistics.median(max(r["steps"][i] for r in ranks) for i in range(args.steps))
    checkpoint_s = statistics.median(max(r["checkpoints"][i] for r in ranks) for i in range(args.steps))
    print(f"{MODEL} EP{args.ep}, {args.samples} samples of up to {args.max_len} tokens, median of {args.steps}")
    print(f"{'':<12} {'seconds':>8}")
    print(f"{'train step':<12} {step_s:8.2f}\n{'checkpoint':<12} {checkpoint_s:8.2f} "
          f"({ranks[0]['checkpoint_mib']:.1f} MiB, {checkpoint_s / step_s:.2f}x a step)")
    print(json.dumps({"cpu_capability": capability, "bf16_native": native, "precision": args.precision,
                      "processes": args.ep, "step_s": round(step_s, 3), "checkpoint_s": round(checkpoint_s, 3),
                      "checkpoint_mib": round(ranks[0]["checkpoint_mib"], 2),
                      "ratio_checkpoint_over_step": round(checkpoint_s / step_s, 3)}))


if __name__ == "__main__":
    main()
