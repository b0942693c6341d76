"""Platform layer: process groups, the nccl/gloo switch, the TE/local layer-spec switch, the CPU compatibility layer.

Stable API (what the trainer and tools import):
    resolve_backend(requested) -> "nccl" | "gloo"            ("auto": nccl with CUDA, else gloo)
    init_distributed(backend, timeout_s, *, rank, world_size, ...) -> DistributedInfo
    initialize_model_parallel(tp, pp, ep, etp, *, seed, timeout_s)
    destroy_distributed()
    run_local_workers(fn, world_size, *args, timeout_s) -> [result per rank]   (spawned CPU workers on gloo)
    use_transformer_engine() -> bool;  base_layer_spec(...);  final_norm_spec()
    install_cpu_compat()     (called by init_distributed on gloo; GPU runs never load it)

Modules import megatron-core lazily where they can, so `import megatron_scalerl.platform` stays cheap.
"""

from megatron_scalerl.platform.cpu_compat import install_cpu_compat
from megatron_scalerl.platform.distributed import (
    DistributedInfo,
    check_layout,
    destroy_distributed,
    init_distributed,
    initialize_model_parallel,
    resolve_backend,
)
from megatron_scalerl.platform.local_workers import WorkerError, free_port, run_local_workers

__all__ = [
    "DistributedInfo",
    "WorkerError",
    "check_layout",
    "destroy_distributed",
    "free_port",
    "init_distributed",
    "initialize_model_parallel",
    "install_cpu_compat",
    "resolve_backend",
    "run_local_workers",
]
