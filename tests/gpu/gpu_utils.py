"""Small pieces the GPU checks share (light to import: the checks' heavy imports happen inside their workers)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

# Each worker start on a GPU node is a spawned interpreter that imports megatron-core (and builds CUDA contexts):
# give every multi-process run a generous bound.
WORKER_TIMEOUT_S = 1200.0

# Deterministic kernels, for the exact-resume check: Transformer Engine picks deterministic attention backends,
# cuBLAS a fixed workspace (needed by torch's deterministic mode).
DETERMINISTIC_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for what starts inside (`run_local_workers` hands its workers this process's
    environment), and restore them after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor inside (dicts, lists, tuples) moved to the CPU: a worker's result is unpickled in the
    pytest process, which must not initialise CUDA."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def on_cpu(rank: int, fn: Any, *args: Any) -> Any:
    """`tests.trainer_utils.run_scenarios` entry: `fn(rank, *args)` with its tensors moved to the CPU."""
    return to_cpu(fn(rank, *args))


def deterministic_on_cpu(rank: int, fn: Any, *args: Any) -> dict:
    """`on_cpu`, with torch's deterministic algorithms on (`torch.use_deterministic_algorithms`, `warn_only`: an op
    that has no deterministic kernel warns and runs anyway); the result dict gains "nondeterministic": the ops that
    warned (empty: every kernel of the run was deterministic)."""
    import warnings

    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = on_cpu(rank, fn, *args)
    marker = " does not have a deterministic implementation"
    result["nondeterministic"] = sorted({str(w.message).split(marker)[0] for w in caught if marker in str(w.message)})
    return result


def layer_backend() -> dict:
    """Inside a worker: which layers the model code builds here (`platform.layer_backend`), and the device."""
    from megatron_scalerl.platform.distributed import current_device
    from megatron_scalerl.platform.layer_backend import base_layer_spec, use_transformer_engine

    qkv = base_layer_spec(num_experts=None, qk_norm=None).submodules.self_attention.submodules.linear_qkv
    return {"transformer_engine": use_transformer_engine(), "linear_qkv": f"{qkv.__module__}.{qkv.__qualname__}",
            "device": str(current_device())}

