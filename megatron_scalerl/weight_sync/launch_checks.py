"""Launch-time refusals of the recipe's `weight_sync` section: what this machine cannot run, refused before any role
starts and naming the key. The recipe itself refuses nothing that depends on the machine (recipes load on submit
hosts and in `scalerl recipe show`).

    check_weight_sync(recipe, *, cuda, free_bytes_per_worker)   the refusals (UserError)
    staging_bytes(recipe, *, cuda)              one copy of the weights as a generator holds them (bytes)
    generator_free_bytes(*, cuda, generators_here, generator_tp)   a generator worker's memory beside what it serves

Both launchers call them: `launch/local.py` (`scalerl train`) with this machine's memory, and the SLURM job's
preflight (`launch/preflight.py`), which measures the memory on the generator nodes themselves.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_scalerl.errors import UserError
from megatron_scalerl.models.memory_plan import GIB, VLLM_GPU_MEMORY_UTILIZATION, param_counts
from megatron_scalerl.platform.precision import serving_dtype
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.weight_sync.protocol import host_available_bytes

MEMINFO = Path("/proc/meminfo")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def staging_bytes(recipe: Recipe, *, cuda: bool) -> int:
    """Bytes of one copy of the model's weights as a generator holds them: every parameter (`param_counts`, the
    vocabulary padded to 128) in the serving dtype (`platform.precision.serving_dtype`: the trainer's precision on
    GPUs, float32 on CPUs), an untied LM head in FP32 with `trainer.fp32_lm_head`. What staging receives into while
    the generator goes on serving the weights it has."""
    counts = param_counts(recipe)
    serve = DTYPE_BYTES[serving_dtype(recipe, cuda)]
    head = 4 if recipe.trainer.fp32_lm_head else serve
    return (counts.total - counts.output) * serve + counts.output * head


def staging_refusal(need_bytes: int, free_bytes: int, where: str = "this node") -> str:
    """The refusal of `weight_sync.staging: on` that does not fit (`need_bytes` > `free_bytes`, both bytes per
    generator worker), naming the key, both sizes in GiB and the way out; `where`: the node measured."""
    return (f"weight_sync.staging: on needs one copy of the model's weights beside each generator worker, "
            f"{need_bytes / GIB:.2f} GiB, and a generator worker on {where} has {free_bytes / GIB:.2f} GiB free beside what "
            "it serves with (use auto or off)")


def generator_free_bytes(*, cuda: bool, generators_here: int, generator_tp: int) -> int | None:
    """Memory each worker of the `generators_here` generators on this node (`generator_tp` workers each) has beside
    what it serves with (bytes), measured before the roles start: every worker stages a whole copy of the weights
    (it receives them all and loads its own shard). On GPUs: what vLLM leaves of one GPU (the smallest visible
    GPU's memory x (1 - gpu_memory_utilization), `memory_plan.VLLM_GPU_MEMORY_UTILIZATION`); on CPUs: the host's
    available memory (MemAvailable) shared evenly by every worker (an upper bound: the trainer and the generators'
    own weights and KV cache take from it too). None where it cannot be told (no GPU visible, /proc/meminfo
    unreadable)."""
    if cuda:
        gpus = torch.cuda.device_count()
        if not gpus:
            return None
        smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        return int(smallest * (1 - VLLM_GPU_MEMORY_UTILIZATION))
    available = host_available_bytes(MEMINFO)
    return None if available is None else available // max(generators_here * generator_tp, 1)


def check_weight_sync(recipe: Recipe, *, cuda: bool, free_bytes_per_worker: int | None) -> None:
    """Refuse what this machine cannot run of `recipe.weight_sync` (a UserError naming the key): `transport: nccl`
    without CUDA (`cuda`: this node has it), and `staging: on` where one copy of the weights (`staging_bytes`) does
    not fit the memory a generator worker has free (`free_bytes_per_worker`, bytes; None: unknown, no refusal).
    `auto`, `gloo` and `disk` run anywhere; `staging: auto` turns itself off where the copy does not fit."""
    sync = recipe.weight_sync
    if sync.transport.type == "nccl" and not cuda:
        raise UserError("weight_sync.transport: nccl needs CUDA on the trainer and the generators; this node has none "
                        "(use auto or gloo)")
    if sync.staging == "on" and free_bytes_per_worker is not None:
        need = staging_bytes(recipe, cuda=cuda)
        if need > free_bytes_per_worker:
            raise UserError(staging_refusal(need, free_bytes_per_worker))
