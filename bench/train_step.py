"""Benchmark: one CISPO train step of the tiny models at each parallel layout: tokens/s and peak memory per rank.

Every layout runs the real trainer (`trainer.trainer.Trainer` in a scratch run directory: megatron-core model,
distributed optimizer, `Trainer.train_step`) on spawned gloo workers, one thread each, on the same TrainBatch. The
baseline is the TP1 single-process layout of the same model, run in the same invocation; ratios are layout / TP1.

- Layouts: tiny_dense and tiny_qwen3 at TP1, TP2, PP2, DP2; tiny_moe, tiny_qwen3_moe, tiny_deepseek_v3 at TP1, EP2 (2 processes:
  the two DP ranks hold half the experts each), TP2xEP2 (4 processes: tp 2 x dp 2, experts over ep 2 with expert-tp
  2) and DP2 (experts replicated, for comparison with EP2). Sequence parallelism only where the recipe requires it
  (MoE with tp > 1). With several models, each model's TP1 is also compared with the first model's of its kind
  (dense, MoE) given: `vs_first_of_kind` (e.g. tiny_qwen3_moe's top-2 of 8 experts beside tiny_moe's top-1 of 4).
- Time: `--warmup` steps, then the median over `--steps` measured steps of the step time (`train/step_time_s`, the
  slowest rank; ranks start each step together after a barrier). tokens/s = the batch's tokens / that median.
  CPU s = the step's CPU time summed over ranks (median): the work a layout adds, less sensitive than wall time to
  other load on a shared machine.
- Memory (CPU torch has no allocator statistics, so RSS): the peak RSS during the measured steps (VmHWM, reset
  through /proc/self/clear_refs after the warm-up), max over ranks, above two baselines: the RSS just before the
  measured steps ("step peak": what the steps allocate beyond the model, gradients and optimizer state, plus RSS the
  allocator keeps growing in the first few dozen steps) and the RSS before the `Trainer` is built, after the imports
  ("trainer": model, gradient buffers, optimizer state and the step together).
- Precision: fp32 by default. On CPU, bf16 adds about 200 MiB of RSS on the first step (partly oneDNN's per-shape
  kernel cache) and more as new shapes appear (MoE experts see new token counts every step), which swamps the
  differences between layouts. `--precision bf16` measures the GPU recipe's setting anyway (bench/precision.py
  compares the two).
- A layout that fails (e.g. a model that does not build) is reported as failed with the first line of its error.

    OMP_NUM_THREADS=1 python bench/train_step.py [--models tiny_dense,tiny_moe,tiny_qwen3,tiny_qwen3_moe,tiny_deepseek_v3]
        [--samples 16 --max-len 128]
        [--micro-batch 1] [--warmup 2 --steps 5] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megatron_scalerl.batches.train_batch import TrainBatch
from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.recipe import Recipe, load_recipe

GROUP_SIZE = 4  # samples per prompt
_DENSE_LAYOUTS = [("TP1", {}), ("TP2", {"tp": 2}), ("PP2", {"pp": 2}), ("DP2", {"dp": 2})]
_MOE_LAYOUTS = [("TP1", {}), ("EP2", {"ep": 2, "dp": 2}), ("TP2xEP2", {"tp": 2, "ep": 2, "dp": 2}), ("DP2", {"dp": 2})]
LAYOUTS: dict[str, list[tuple[str, dict[str, int]]]] = {  # name -> (label, parallel sizes); the first is the baseline
    "tiny_dense": _DENSE_LAYOUTS, "tiny_moe": _MOE_LAYOUTS, "tiny_qwen3": _DENSE_LAYOUTS, "tiny_qwen3_moe": _MOE_LAYOUTS,
    "tiny_deepseek_v3": _MOE_LAYOUTS,
}


def layout_recipe(model: str, sizes: dict[str, int], args: argparse.Namespace) -> Recipe:
    """The scalerl recipe for `model` at `sizes` (tp, pp, ep, dp; default 1), sized for the bench's batch."""
    tp, pp, ep, dp = (sizes.get(k, 1) for k in ("tp", "pp", "ep", "dp"))
    moe_tp = tp > 1 and LAYOUTS[model] is _MOE_LAYOUTS
    overrides = [f"parallelism.tp={tp}", f"parallelism.pp={pp}", f"parallelism.ep={ep}", f"parallelism.dp={dp}",
                 f"parallelism.sequence_parallel={'true' if moe_tp else 'false'}",
                 f"parallelism.micro_batch_size={args.micro_batch}", f"cluster.gpus_per_node={tp * pp * dp}",
                 f"rollout.prompts_per_step={args.samples // GROUP_SIZE}",
                 f"rollout.generations_per_prompt={GROUP_SIZE}", f"trainer.precision={args.precision}",
                 f"trainer.init_from={args.hf_dirs[model]}", "logging.wandb_mode=disabled"]
    return load_recipe("scalerl", overrides, model_preset=model)


def bench_batch(recipe: Recipe, max_len: int, seed: int = 0) -> TrainBatch:
    """A TrainBatch shaped like a real step's: `recipe.samples_per_step` samples in groups of GROUP_SIZE, lengths
    (tokens) uniform in [max(max_len / 4, 34), max_len], prompts of 8-32 tokens, +-1 rewards with group-baseline advantages,
    generator log-probs near log(1/vocab) (what a freshly initialised policy gives)."""
    g = torch.Generator().manual_seed(seed)
    vocab, n = recipe.model.vocab_size, recipe.samples_per_step
    lengths = torch.randint(max(max_len // 4, 34), max_len + 1, (n,), generator=g)
    prompt_lengths = torch.randint(8, 33, (n,), generator=g)
    rewards = (torch.rand(n, generator=g) < 0.5).float() * 2 - 1
    rewards[0::GROUP_SIZE], rewards[1::GROUP_SIZE] = 1.0, -1.0  # no zero-variance group
    grouped = rewards.view(-1, GROUP_SIZE)
    advantages = (grouped - grouped.mean(1, keepdim=True)).flatten()
    advantages = advantages / advantages.std()
    starts = torch.repeat_interleave(prompt_lengths, lengths)
    completion = torch.cat([torch.arange(int(length)) for length in lengths]) >= starts
    total = int(lengths.sum())
    noise = 0.2 * torch.randn(total, generator=g)
    return TrainBatch(
        input_ids=torch.randint(0, vocab, (total,), generator=g), loss_mask=completion,
        gen_logprobs=torch.where(completion, noise - math.log(vocab), 0.0),
        weight_versions=torch.where(completion, 0, -1), lengths=lengths, prompt_lengths=prompt_lengths,
        advantages=advantages, rewards=rewards, group_ids=torch.arange(n // GROUP_SIZE).repeat_interleave(GROUP_SIZE),
        truncated=torch.zeros(n, dtype=torch.bool),
    ).validate("bench batch", vocab)


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB -> MiB


def measure_rank(rank: int, run_dir: str, model: str, sizes: dict[str, int], args: argparse.Namespace) -> dict:
    """On one worker: build the trainer in `run_dir`, run the warm-up and measured steps. Returns per measured step
    the wall and CPU time (s), and the peak RSS (MiB) during the measured steps above the RSS before them and before
    the build."""
    import megatron.core.distributed  # noqa: F401 - imported before the baseline RSS so that imports are not counted
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import torch.distributed as dist

    import megatron_scalerl.models.provider  # noqa: F401
    from megatron_scalerl.trainer.trainer import Trainer

    recipe = layout_recipe(model, sizes, args)
    batch = bench_batch(recipe, args.max_len)
    gc.collect()
    rss_before_build = _status_mib("VmRSS")
    trainer = Trainer(run_dir, recipe)
    first = trainer.train_step(batch)
    for _ in range(args.warmup - 1):
        trainer.train_step(batch)
    gc.collect()
    rss_before_steps = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak-RSS counter (VmHWM)
        f.write("5")
    times, cpu_times = [], []
    for _ in range(args.steps):
        dist.barrier()
        cpu_start = time.process_time()
        times.append(trainer.train_step(batch)["train/step_time_s"])
        cpu_times.append(time.process_time() - cpu_start)
    peak = _status_mib("VmHWM")
    return {"step_times": times, "cpu_times": cpu_times, "tokens": first["train/tokens"],
            "first_loss": first["train/loss"], "step_peak_mib": peak - rss_before_steps,
            "trainer_mib": peak - rss_before_build}


def error_line(exc: Exception) -> str:
    """The first line of the failing exception (from a worker's traceback when there is one)."""
    lines = str(exc).splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  ")]
    head = lines[0] if lines else type(exc).__name__
    if frames and frames[-1] + 1 < len(lines):  # a worker traceback: the exception follows the last frame line
        return f"{head.rstrip(':')}: {lines[frames[-1] + 1]}"
    return f"{type(exc).__name__}: {head}"


def run_layout(model: str, sizes: dict[str, int], args: argparse.Namespace) -> dict:
    world = sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("dp", 1)
    start = time.perf_counter()
    try:
        layout_recipe(model, sizes, args)  # a bad layout fails here, naming the field, before any process starts
        with tempfile.TemporaryDirectory(prefix="bench_train_step_run_") as run_dir:  # the layout's own: no resume
            ranks = run_local_workers(measure_rank, world, run_dir, model, sizes, args, timeout_s=args.timeout)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON, not hidden
        return {"processes": world, "error": error_line(exc)}
    step_s = statistics.median(max(r["step_times"][i] for r in ranks) for i in range(args.steps))
    cpu_s = statistics.median(sum(r["cpu_times"][i] for r in ranks) for i in range(args.steps))
    tokens = ranks[0]["tokens"]
    return {"processes": world, "tokens": tokens, "step_s": step_s, "tokens_per_s": tokens / step_s, "cpu_s": cpu_s,
            "step_peak_mib": max(r["step_peak_mib"] for r in ranks), "trainer_mib": max(r["trainer_mib"] for r in ranks),
            "first_loss": ranks[-1]["first_loss"], "wall_s": time.perf_counter() - start}


RATIOS = {"tokens_per_s": "tokens_per_s_vs_tp1", "step_peak_mib": "step_peak_vs_tp1", "trainer_mib": "trainer_vs_tp1"}


def with_ratios(rows: dict[str, dict], baseline: str) -> None:
    """Add each figure's ratio to the baseline row's (None where either failed)."""
    base = rows[baseline]
    for row in rows.values():
        for figure, ratio in RATIOS.items():
            ok = "error" not in row and "error" not in base and base[figure] > 0
            row[ratio] = row[figure] / base[figure] if ok else None


def compare_with_first_of_kind(results: dict[str, dict[str, dict]]) -> None:
    """Add `vs_first_of_kind` to each model's baseline (TP1) row: its tokens/s over that of the first model given of
    the same kind (dense or MoE), e.g. tiny_qwen3_moe against tiny_moe; 1.0 for that first model itself."""
    first: dict[bool, dict] = {}
    for model, rows in results.items():
        row = rows[LAYOUTS[model][0][0]]
        base = first.setdefault(LAYOUTS[model] is _MOE_LAYOUTS, row)
        ok = "error" not in row and "error" not in base
        row["vs_first_of_kind"] = row["tokens_per_s"] / base["tokens_per_s"] if ok else None


def print_table(results: dict[str, dict[str, dict]]) -> None:
    print(f"{'model':11} {'layout':8} {'procs':>5} {'tokens':>6} {'step s':>7} {'tokens/s':>9} {'vs TP1':>7} "
          f"{'CPU s':>6} {'step peak MiB':>13} {'vs TP1':>7} {'trainer MiB':>11} {'vs TP1':>7} {'wall s':>6}")

    def ratio(r: dict, key: str) -> str:
        return "-" if r[key] is None else f"{r[key]:.2f}x"

    for model, rows in results.items():
        for label, r in rows.items():
            if "error" in r:
                print(f"{model:11} {label:8} {r['processes']:5} FAILED: {r['error']}")
                continue
            print(f"{model:11} {label:8} {r['processes']:5} {r['tokens']:6} {r['step_s']:7.3f} "
                  f"{r['tokens_per_s']:9.0f} {ratio(r, 'tokens_per_s_vs_tp1'):>7} {r['cpu_s']:6.2f} "
                  f"{r['step_peak_mib']:13.1f} {ratio(r, 'step_peak_vs_tp1'):>7} {r['trainer_mib']:11.1f} "
                  f"{ratio(r, 'trainer_vs_tp1'):>7} {r['wall_s']:6.1f}")


def _rounded(row: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny_dense,tiny_moe", help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    p.add_argument("--samples", type=int, default=16, help=f"samples per step, a multiple of {GROUP_SIZE}")
    p.add_argument("--max-len", type=int, default=128, help="longest sample, tokens (prompt + completion)")
    p.add_argument("--micro-batch", type=int, default=1, help="micro-batch size, samples")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (>= 1)")
    p.add_argument("--steps", type=int, default=5, help="measured steps; the median is reported")
    p.add_argument("--precision", default="fp32", choices=("bf16", "fp32"),
                   help="trainer precision (default fp32, see the module docstring; the GPU recipe's is bf16)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per layout")
    args = p.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in LAYOUTS]
    if unknown or args.samples % GROUP_SIZE or args.warmup < 1 or args.steps < 1 or args.max_len < 34:
        p.error(f"need --models from {sorted(LAYOUTS)}, --samples a multiple of {GROUP_SIZE}, --warmup >= 1, "
                "--steps >= 1, --max-len >= 34")

    # Every layout of a model starts from the same weights (an HF checkpoint), as a real run does, so the first
    # losses agree across layouts and the layouts do the same work.
    scratch = tempfile.TemporaryDirectory(prefix="bench_train_step_")
    args.hf_dirs = {m: str(save_random_hf_model(load_recipe("scalerl", model_preset=m).model,
                                                Path(scratch.name) / m, seed=0)) for m in models}
    results: dict[str, dict[str, dict]] = {}
    for model in models:
        rows = {label: run_layout(model, sizes, args) for label, sizes in LAYOUTS[model]}
        with_ratios(rows, LAYOUTS[model][0][0])
        results[model] = rows
    compare_with_first_of_kind(results)
    print(f"train step: {args.samples} samples of <= {args.max_len} tokens, micro-batch {args.micro_batch}, "
          f"{args.precision}, {args.warmup} warm-up + median of {args.steps} steps, 1 thread per process")
    print_table(results)
    print(json.dumps({"bench": "train_step", "samples": args.samples, "max_len": args.max_len,
                      "micro_batch": args.micro_batch, "precision": args.precision, "steps": args.steps,
                      "results": {m: {label: _rounded(r) for label, r in rows.items()} for m, rows in results.items()}}))


if __name__ == "__main__":
    main()
