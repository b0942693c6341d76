"""Launch-time refusals of the recipe's `weight_sync` section: what this machine cannot run, refused before any role
starts and naming the key. The recipe itself refuses nothing that depends on the machine (recipes load on submit
hosts and in `scalerl recipe show`).

    check_weight_sync(recipe, *, cuda, free_bytes_per_worker)   the refusals (UserError)
    staging_setting(recipe, *, cuda)            `weight_sync.staging` as the trainer runs it
    staging_bytes(recipe, *, cuda)              one copy of the weights as a generator holds them (bytes)
    generator_free_bytes(recipe, *, cuda, generators_here)   a generator worker's memory beside what it serves
    host_free_bytes_per_worker(workers)         a CPU generator worker's share of this host's available memory

Both launchers call them: `launch/local.py` (`scalerl train`) with this machine's memory, and the SLURM job's
preflight (`launch/preflight.py`), which measures the memory on the generator nodes themselves.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_scalerl.errors import UserError
from megatron_scalerl.models.memory_plan import (
    GIB,
    STAGING_PART,
    VLLM_GPU_MEMORY_UTILIZATION,
    generator_plan,
    staging_bytes,
)
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.weight_sync.protocol import host_available_bytes

MEMINFO = Path("/proc/meminfo")


def staging_refusal(need_bytes: int, free_bytes: int, where: str = "this node") -> str:
    """The refusal of `weight_sync.staging: on` that does not fit (`need_bytes` > `free_bytes`, both bytes per
    generator worker), naming the key, both sizes in GiB and the way out; `where`: the node measured."""
    return (f"weight_sync.staging: on needs one copy of the model's weights beside each generator worker, "
            f"{need_bytes / GIB:.2f} GiB, and a generator worker on {where} has {free_bytes / GIB:.2f} GiB free beside what "
            "it serves with (use auto or off)")


def generator_free_bytes(recipe: Recipe, *, cuda: bool, generators_here: int) -> int | None:
    """Memory each worker of the `generators_here` generators on this node has for a staging copy of the weights
    beside what it serves with (bytes), measured before the roles start: every worker stages a whole copy (it
    receives them all and loads its own shard). On GPUs: vLLM's gpu_memory_utilization of the smallest visible GPU
    less the rest of the generator's plan (`memory_plan.generator_plan`: weights, one sequence's KV cache, the
    runtime reserve and weight sync's other parts, which the launch keeps out of vLLM's share with the staging copy);
    on CPUs: the host's available memory (MemAvailable) shared evenly by every worker (an upper bound: the trainer
    and the generators' own weights and KV cache take from it too). None where it cannot be told (no GPU visible,
    /proc/meminfo unreadable)."""
    if cuda:
        gpus = torch.cuda.device_count()
        if not gpus:
            return None
        smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        plan = generator_plan(recipe, cuda=True)
        rest = sum(plan.parts.values()) + sum(v for k, v in plan.beside.items() if k != STAGING_PART)
        return int(smallest * VLLM_GPU_MEMORY_UTILIZATION - rest)
    return host_free_bytes_per_worker(generators_here * recipe.parallelism.generator_tp)


def host_free_bytes_per_worker(workers: int) -> int | None:
    """This host's available memory (MemAvailable) shared evenly by `workers` generator workers (bytes); None where
    /proc/meminfo cannot be read."""
    available = host_available_bytes(MEMINFO)
    return None if available is None else available // max(workers, 1)


def staging_setting(recipe: Recipe, *, cuda: bool) -> str:
    """`weight_sync.staging` as the trainer runs it: `auto` is off on GPU generators of `parallelism.generator_tp`
    > 1, where staging (every TP worker receiving a whole copy on a thread of its own, beside vLLM's own NCCL
    collectives) has not been measured yet; `on` is refused there (`check_weight_sync`)."""
    staging = recipe.weight_sync.staging
    return "off" if staging == "auto" and cuda and recipe.parallelism.generator_tp > 1 else staging


def check_weight_sync(recipe: Recipe, *, cuda: bool, free_bytes_per_worker: int | None) -> None:
    """Refuse what this machine cannot run of `recipe.weight_sync` (a UserError naming the key): `transport: nccl`
    without CUDA (`cuda`: this node has it), `staging: on` on GPU generators with tensor parallelism (not measured
    yet), and `staging: on` where one copy of the weights (`staging_bytes`) does not fit the memory a generator
    worker has free (`free_bytes_per_worker`, bytes; None: unknown, no refusal). `auto`, `gloo` and `disk` run
    anywhere; `staging: auto` turns itself off where the copy does not fit."""
    sync = recipe.weight_sync
    if sync.transport.type == "nccl" and not cuda:
        raise UserError("weight_sync.transport: nccl needs CUDA on the trainer and the generators; this node has none "
                        "(use auto or gloo)")
    if sync.staging == "on" and cuda and recipe.parallelism.generator_tp > 1:
        raise UserError(f"weight_sync.staging: on has not been measured on GPU generators with tensor parallelism "
                        f"(parallelism.generator_tp is {recipe.parallelism.generator_tp}): use auto, which is off "
                        "there, or off")
    if sync.staging == "on" and free_bytes_per_worker is not None:
        need = staging_bytes(recipe, cuda=cuda)
        if need > free_bytes_per_worker:
            raise UserError(staging_refusal(need, free_bytes_per_worker))
