"""Process groups: the nccl/gloo switch (chosen here only), timeouts, megatron-core model-parallel groups.

    backend = resolve_backend(recipe.cluster.backend)            # "auto" -> nccl with CUDA, else gloo
    init_distributed(backend, timeout_s=recipe.cluster.collective_timeout_s)   # reads RANK/WORLD_SIZE/MASTER_*
    initialize_model_parallel(tp=2, pp=1, ep=2, seed=recipe.trainer.seed)
    ...
    destroy_distributed()

On a machine without CUDA `init_distributed` installs the CPU compatibility layer before anything builds a model. Every
collective inherits `timeout_s`; a peer that never joins gives an error naming the rendezvous address and ranks.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron_scalerl.errors import UserError
from megatron_scalerl.platform.cpu_compat import install_cpu_compat

Backend = Literal["nccl", "gloo"]


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: Backend
    device: torch.device


def resolve_backend(requested: str = "auto") -> Backend:
    """`auto` -> nccl when CUDA is available, else gloo. Asking for nccl without CUDA is a user error."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise UserError("cluster.backend: nccl needs CUDA, and this machine has no CUDA device (use gloo or auto)")
    if requested not in ("nccl", "gloo"):
        raise UserError(f"cluster.backend: unknown backend {requested!r} (expected auto, nccl or gloo)")
    return requested  # type: ignore[return-value]


def _env_int(name: str, given: int | None, default: int | None = None) -> int:
    if given is not None:
        return given
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise UserError(f"init_distributed: environment variable {name} is not set (launch with torchrun/srun)")
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"init_distributed: environment variable {name}={value!r} is not an integer") from None


def init_distributed(
    backend: str = "auto",
    timeout_s: float = 600.0,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    store_hosted: bool = False,
) -> DistributedInfo:
    """Join the default process group (env:// rendezvous unless given explicitly).

    Ranks, world size and the rendezvous address come from the arguments or from RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT. `timeout_s` (seconds) bounds the rendezvous and every later collective.
    `store_hosted`: another process already serves the rendezvous store at that address (`run_local_workers`' parent,
    which bound it itself: no port can be taken between picking and binding it); every rank joins as a client.
    """
    resolved = resolve_backend(backend)
    rank = _env_int("RANK", rank)
    world_size = _env_int("WORLD_SIZE", world_size)
    local_rank = _env_int("LOCAL_RANK", local_rank, default=0)
    addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = master_port if master_port is not None else _env_int("MASTER_PORT", None)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    else:
        install_cpu_compat()
    device = current_device()
    if dist.is_initialized():
        return DistributedInfo(dist.get_rank(), dist.get_world_size(), local_rank, resolved, device)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if store_hosted:
            store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
            dist.init_process_group(backend=resolved, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend=resolved, init_method=f"tcp://{addr}:{port}", rank=rank,
                                    world_size=world_size, timeout=timeout)
    except (RuntimeError, dist.DistError) as exc:
        raise RuntimeError(
            f"rank {rank} of {world_size}: could not join the {resolved} process group at {addr}:{port} "
            f"within {timeout_s:g} s: {exc}"
        ) from exc
    return DistributedInfo(rank, world_size, local_rank, resolved, device)


def check_layout(world_size: int, *, tp: int, pp: int, ep: int, etp: int) -> int:
    """Validate a layout against the world size and return the data-parallel size."""
    if world_size % (tp * pp):
        raise UserError(f"parallelism: world size {world_size} is not a multiple of tp*pp = {tp}*{pp}")
    if (world_size // pp) % (ep * etp):
        raise UserError(
            f"parallelism: world size / pp = {world_size // pp} is not a multiple of ep*expert_tp = {ep}*{etp}"
        )
    return world_size // (tp * pp)


def initialize_model_parallel(
    tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, *, seed: int = 1234, timeout_s: float = 600.0
) -> None:
    """Create megatron-core's TP/PP/EP/DP groups and seed its RNG streams (after `init_distributed`).

    `etp` (expert tensor parallelism) defaults to `tp`. The same `seed` on every rank gives the same weights for
    replicated parameters and per-rank streams for sharded ones (megatron's scheme).
    """
    from megatron.core import parallel_state, tensor_parallel

    etp = tp if etp is None else etp
    check_layout(dist.get_world_size(), tp=tp, pp=pp, ep=ep, etp=etp)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_s / 60.0,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def current_device() -> torch.device:
    """The device this process computes on: its CUDA device (set by `init_distributed`), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Processes in the group (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (e.g. a folder listing, which ranks on a shared filesystem may see differently)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gathered(obj: Any) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def destroy_distributed() -> None:
    """Tear down megatron's groups and the default process group (safe to call when none exist)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
