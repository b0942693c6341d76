"""Preflight: checks at the start of a SLURM job (and `slurm/preflight.sbatch` alone) that fail early and say why.

1. Every node of both het groups (one task each, `node`): the run directory is visible and writable, the model
   (RUN/model, or `trainer.init_from` before the run exists) readable, the job's ports free, and, on GPUs, as many
   GPUs as the recipe counts on with the memory its layout needs (`models/memory_plan.py`, `scalerl recipe show
   --plan`); with `weight_sync.staging: on`, each generator node has room beside every generator for one copy of the
   weights (`weight_sync/launch_checks.py`). Before it, in the batch step, the rest of the `weight_sync` section's
   refusals (`check_weight_sync`: nccl without CUDA).
2. The trainer nodes' all-reduce bus bandwidth (`allreduce`, one task per trainer GPU): NVIDIA nccl-tests'
   `all_reduce_perf` when it is on PATH (its "# Avg bus bandwidth" line), else a torch.distributed all-reduce over
   the trainer's backend (NCCL on GPUs, gloo on CPUs). Below SCALERL_MIN_BUSBW_GBPS (GB/s; default 20 on GPUs, 0 on
   CPUs, where the figure is only reported) the job stops.

    python -m megatron_scalerl.launch.preflight node --run-dir R --model M --ports P,.. [--gpus N --need-gib X]
        [--staging-bytes B --generators K]
    python -m megatron_scalerl.launch.preflight allreduce --master HOST:PORT --backend gloo|nccl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_scalerl.errors import UserError
from megatron_scalerl.launch.allocation import GENERATOR_GROUP, TRAINER_GROUP, srun
from megatron_scalerl.process_exit import exit_with

if TYPE_CHECKING:
    from megatron_scalerl.launch.allocation import Allocation
    from megatron_scalerl.recipe import Recipe

STEP_TIMEOUT_S = 600.0
DEFAULT_MIN_BUSBW_GBPS = {"nccl": 20.0, "gloo": 0.0}
NCCL_TESTS = "all_reduce_perf -b 32M -e 1G -f 2 -g 1"  # one GPU per task, 32 MiB to 1 GiB messages
_AVG_BUSBW = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")


def parse_nccl_tests(text: str) -> float:
    """The average bus bandwidth (GB/s) in nccl-tests output (mpirun's `[1,0]<stdout>:` prefixes allowed)."""
    found = _AVG_BUSBW.findall(text)
    if not found:
        raise ValueError("no '# Avg bus bandwidth' line in the nccl-tests output (did it finish?)")
    return float(found[-1])


# ---- the per-node check -------------------------------------------------------------------------------------


def node_problems(run_dir: Path, model: Path, ports: list[int], gpus: int | None, need_gib: float | None,
                  staging_bytes: int | None = None, generators: int = 1) -> list[str]:
    """What is wrong on this node for the run (empty: ready). `staging_bytes`: one copy of the weights (bytes) that
    each of this node's `generators` CPU workers needs in host memory beside it (`weight_sync.staging: on`; on GPUs
    the staging copy is in the generator's plan, which `need_gib` checks); None: not asked."""
    problems = []
    where = run_dir if run_dir.exists() else run_dir.parent
    probe = where / f".preflight-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        problems.append(f"run directory {where} is not writable here: {exc.strerror}")
    if not (model / "config.json").is_file():
        problems.append(f"model {model} is not visible here (no config.json)")
    for port in ports:
        with socket.socket() as sock:
            # SO_REUSEADDR: a listener still makes the bind fail, while the same check on another (virtual) node of
            # this host or a closed connection's TIME_WAIT does not
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                problems.append(f"port {port} is in use")
    if gpus:
        import torch

        found = torch.cuda.device_count()
        if found < gpus:
            problems.append(f"{found} GPU(s) visible, the recipe needs {gpus} per node")
        elif need_gib is not None:
            have = min(torch.cuda.get_device_properties(i).total_memory for i in range(found)) / 2**30
            if have < need_gib:
                problems.append(f"GPUs hold {have:.1f} GiB, the layout needs {need_gib:.1f} GiB per GPU "
                                "(scalerl recipe show RECIPE --plan)")
    if staging_bytes is not None:
        from megatron_scalerl.weight_sync.launch_checks import (  # deferred: torch
            host_free_bytes_per_worker,
            staging_refusal,
        )

        free = host_free_bytes_per_worker(generators)
        if free is not None and staging_bytes > free:
            problems.append(staging_refusal(staging_bytes, free))
    return problems


def allreduce_busbw(master: str, backend: str, size_mib: int, iters: int, timeout_s: float) -> float | None:
    """All-reduce bus bandwidth (GB/s) over this SLURM step's tasks (rank SLURM_PROCID of SLURM_NTASKS), measured
    on rank 0 (None elsewhere): size x 2(n-1)/n bytes per all-reduce, the nccl-tests definition."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{int(os.environ.get('SLURM_LOCALID', '0'))}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        data = torch.ones(size_mib * 2**18, dtype=torch.float32, device=device)
        dist.all_reduce(data)  # warm-up: connections
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(data)
        if device != "cpu":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iters
        return data.numel() * 4 * 2 * (world - 1) / world / seconds / 1e9 if rank == 0 else None
    finally:
        dist.destroy_process_group()


# ---- the job's preflight (run in the batch step) --------------------------------------------------------------


def _step(command: list[str], what: str) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"preflight: {what} did not finish in {STEP_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise UserError(f"preflight: {what} failed (exit {done.returncode}): "
                        + " | ".join((done.stdout + done.stderr).strip().splitlines()[-8:]))
    return done.stdout


def run_preflight(run_dir: Path, recipe: Recipe, alloc: Allocation, env: dict[str, str], *, cuda: bool
                  ) -> float | None:
    """Both checks over the allocation (`cuda`: the nodes run on GPUs), after the `weight_sync` section's refusals
    (`check_weight_sync`; staging's memory is measured on the generator nodes by their node check); raises UserError
    naming the node and the problem. Returns the measured bus bandwidth (GB/s; None with a single trainer process)."""
    from megatron_scalerl.models.memory_plan import (  # deferred (both): torch, which
        VLLM_GPU_MEMORY_UTILIZATION,
        generator_plan,
        trainer_plan,
    )
    from megatron_scalerl.weight_sync.launch_checks import check_weight_sync, staging_bytes  # the node check
    # (`preflight node`, started on every node) needs only on GPUs or to check staging

    check_weight_sync(recipe, cuda=cuda, free_bytes_per_worker=None)
    staging = ["--staging-bytes", str(staging_bytes(recipe, cuda=cuda)), "--generators",
               str(max(1, recipe.cluster.gpus_per_node // recipe.parallelism.generator_tp))
               ] if recipe.weight_sync.staging == "on" and not cuda else []
    model = run_dir / "model" if (run_dir / "model").is_dir() else Path(recipe.trainer.init_from or run_dir / "model")
    servers = recipe.generator_servers
    ports = ",".join(map(str, [alloc.base_port, alloc.base_port + 1, *alloc.generator_ports(servers)]))
    python = [sys.executable, "-m", "megatron_scalerl.launch.preflight"]
    for group, nodes, plan, checks in ((TRAINER_GROUP, alloc.trainer, trainer_plan(recipe), []),
                                       (GENERATOR_GROUP, alloc.generator, generator_plan(recipe), staging)):
        share = VLLM_GPU_MEMORY_UTILIZATION if group == GENERATOR_GROUP else 1.0  # the GPU vLLM takes a share of
        gpus = ["--gpus", str(recipe.cluster.gpus_per_node), "--need-gib", f"{plan.total_gib / share:.2f}"] if cuda else []
        out = _step(srun(group, nodes=len(nodes.nodes), name="preflight") + ["--label"] + python + [
            "node", "--run-dir", str(run_dir), "--model", str(model), "--ports", ports, *gpus, *checks],
            f"node check of het group {group} ({', '.join(n.name for n in nodes.nodes)})")
        print(out.strip(), flush=True)
    if recipe.cluster.trainer_gpus < 2:
        print("preflight: one trainer process, no all-reduce to measure", flush=True)
        return None
    backend = "nccl" if cuda else "gloo"
    floor = float(env.get("SCALERL_MIN_BUSBW_GBPS", DEFAULT_MIN_BUSBW_GBPS[backend]))
    step = srun(TRAINER_GROUP, nodes=recipe.cluster.trainer_nodes, ntasks_per_node=recipe.cluster.gpus_per_node,
                gpus_per_task=1 if cuda else None, name="preflight_allreduce")
    if cuda and shutil.which("all_reduce_perf"):
        tool = "nccl-tests all_reduce_perf"
        out = _step(step + [f"--mpi={env.get('SCALERL_SRUN_MPI', 'pmix')}"] + shlex.split(
            env.get("SCALERL_NCCL_TESTS", NCCL_TESTS)), tool)
        busbw = parse_nccl_tests(out)
    else:
        tool = f"torch.distributed all-reduce ({backend})"
        out = _step(step + python + ["allreduce", "--master", f"{alloc.trainer.nodes[0].addr}:{alloc.base_port + 1}",
                                     "--backend", backend], tool)
        busbw = float(json.loads(out.strip().splitlines()[-1])["busbw_gbps"])
    print(f"preflight: {tool} over {recipe.cluster.trainer_gpus} trainer processes: bus bandwidth "
          f"{busbw:.2f} GB/s (floor {floor:g})", flush=True)
    if busbw < floor:
        raise UserError(f"preflight: all-reduce bus bandwidth {busbw:.2f} GB/s is below SCALERL_MIN_BUSBW_GBPS="
                        f"{floor:g} ({tool}): check the interconnect (NCCL_DEBUG=INFO) before spending the allocation")
    return busbw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_scalerl.launch.preflight")
    sub = parser.add_subparsers(dest="what", required=True)
    node = sub.add_parser("node")
    node.add_argument("--run-dir", type=Path, required=True)
    node.add_argument("--model", type=Path, required=True)
    node.add_argument("--ports", default="")
    node.add_argument("--gpus", type=int)
    node.add_argument("--need-gib", type=float)
    node.add_argument("--staging-bytes", type=int)
    node.add_argument("--generators", type=int, default=1)
    allreduce = sub.add_parser("allreduce")
    allreduce.add_argument("--master", required=True)
    allreduce.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    allreduce.add_argument("--size-mib", type=int, default=64)
    allreduce.add_argument("--iters", type=int, default=5)
    allreduce.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.what == "allreduce":
        busbw = allreduce_busbw(args.master, args.backend, args.size_mib, args.iters, args.timeout_s)
        if busbw is not None:
            print(json.dumps({"busbw_gbps": busbw}), flush=True)
        return 0
    ports = [int(p) for p in args.ports.split(",") if p]
    problems = node_problems(args.run_dir, args.model, ports, args.gpus, args.need_gib, args.staging_bytes,
                             args.generators)
    host = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    if problems:
        print(f"preflight failed on {host}: {'; '.join(problems)}", flush=True)
        return 1
    print(f"preflight ok on {host}: run directory, model, {len(ports)} port(s)"
          + (f", {args.gpus} GPU(s) with >= {args.need_gib:.1f} GiB" if args.gpus else "")
          + (f", room to stage {args.staging_bytes / 2**30:.2f} GiB of weights per generator"
             if args.staging_bytes is not None else ""), flush=True)
    return 0


if __name__ == "__main__":
    exit_with(main)
