"""Megatron distributed checkpoints (torch_dist format): save and load sharded state dicts, read a checkpoint's model.

megatron-core's sharded state dicts are layout-independent: what a TP2 model saves loads into a TP1/PP2/EP2 one.
Saving and loading split the work across data-parallel replicas (each writes / reads its share). The trainer
(`trainer.checkpointing`) saves model + optimizer through here; tools that only need the weights (`scalerl verify logits
--megatron`, conversion) read them with `load_model_weights`, and the architecture with `checkpoint_model_config`.
Every load goes through `load_strategies`: a checkpoint made elsewhere is read as data (torch's metadata classes,
tensors, plain values), never run.
"""

from __future__ import annotations

import contextlib
import queue
from pathlib import Path

import torch

from megatron_scalerl.checkpoint.store import CheckpointError, read_rl_state, require_complete
from megatron_scalerl.recipe import ModelConfig


def _strategy(path: Path, *, loading: bool):
    """torch_dist save/load with the work split across the data-parallel replicas; loading unpickles no object but
    plain data (`load_strategies.ShardedLoadStrategy`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    from megatron_scalerl.checkpoint.load_strategies import ShardedLoadStrategy  # deferred: imports megatron-core

    group = ps.get_data_parallel_group(with_context_parallel=True)
    if loading:
        return FullyParallelLoadStrategyWrapper(ShardedLoadStrategy(), group)
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)


def save_sharded(sharded_state: dict, path: Path, *, in_place: bool):
    """Collective. Write `sharded_state` (megatron ShardedTensors) into the existing directory `path`: with
    `in_place`, here and now (as megatron's own synchronous save does, `execute_sync()`), returning None; else
    megatron-core's AsyncRequest (its asynchronous save), for the caller to schedule in the background
    (`AsyncCallsQueue`, CUDA only)."""
    from megatron.core import dist_checkpointing

    with _results_in_this_process() if in_place else contextlib.nullcontext():
        request = dist_checkpointing.save(sharded_state, str(path), sharded_strategy=_strategy(path, loading=False),
                                          async_sharded_save=True)
    if not in_place:
        return request
    request.execute_sync()
    return None


@contextlib.contextmanager
def _results_in_this_process():
    """megatron-core's writer hands a save's results to the rank that saves through a queue it makes once per
    process at its first save: a spawned multiprocessing Manager, which a write run in another process needs. Its
    server imports torch to hold them: 5-7 s of CPU per rank at its first checkpoint (2 AVX2 cores). A save run in
    place puts and gets them in this process: its writer is given a plain queue instead (the writer keeps the queue
    it was given; megatron's own, for a save in the background, is left as it was)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    made = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = made


def load_sharded(sharded_state: dict, path: Path) -> dict:
    """Collective. megatron's dist_checkpointing.load, its many failure types turned into one CheckpointError. Its
    files are read by `load_strategies` (no object unpickled but torch's metadata classes, tensors and plain values);
    a file holding anything else is refused with a CheckpointError naming it."""
    from megatron.core import dist_checkpointing

    from megatron_scalerl.checkpoint.load_strategies import CommonLoadStrategy  # deferred: imports megatron-core

    try:
        return dist_checkpointing.load(sharded_state, str(path), sharded_strategy=_strategy(path, loading=True),
                                       common_strategy=CommonLoadStrategy())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # megatron raises many types for missing/mismatched shards (torch's
        # CheckpointException, for one unreadable shard file, is a BaseException)
        refusal = _refusal(exc)
        if refusal is not None:
            raise refusal from None
        raise CheckpointError(f"{path}: cannot load into this model/layout: {exc}") from exc


def _refusal(exc: BaseException) -> CheckpointError | None:
    """`exc` when it is a CheckpointError of `load_strategies` (a file refused), or the first one among the ranks'
    failures of torch's CheckpointException (an object item refused inside torch's collective read); else None."""
    if isinstance(exc, CheckpointError):
        return exc
    failures = getattr(exc, "failures", None)
    for failure in (failures.values() if isinstance(failures, dict) else ()):
        cause = failure[0] if isinstance(failure, tuple) else failure  # (exception, its stack)
        if isinstance(cause, CheckpointError):
            return cause
    return None


def checkpoint_model_config(path: Path) -> ModelConfig:
    """The architecture a checkpoint was written for (recorded in its RL state by the trainer)."""
    rl_state = read_rl_state(path)
    if "model" not in rl_state:
        raise CheckpointError(f"{path}: rl_state.json records no model config")
    return ModelConfig.model_validate(rl_state["model"])


def require_model_config(path: Path, model_cfg: ModelConfig, expected_from: str) -> None:
    """Raise CheckpointError unless checkpoint `path` was written for `model_cfg` (described by `expected_from`),
    naming the first field that differs."""
    ours, theirs = checkpoint_model_config(path).model_dump(), model_cfg.model_dump()
    differing = [k for k in ours if ours[k] != theirs.get(k)]
    if differing:
        field = differing[0]
        raise CheckpointError(f"{path}: model.{field} is {ours[field]!r} in the checkpoint but {theirs.get(field)!r} "
                              f"in {expected_from} ({len(differing)} field(s) differ)")


def load_model_weights(path: Path, gpt: torch.nn.Module) -> None:
    """Collective. The model weights only (no optimizer) of checkpoint `path` into `gpt` (an unwrapped GPTModel at
    any layout).

    Every rank checks the files are complete (sizes); verify checksums once beforehand
    (`checkpoint.store.require_complete(path)`, as `scalerl verify logits` does) rather than on every rank.
    """
    require_complete(path, checksums=False)
    gpt.load_state_dict(load_sharded({"model": gpt.sharded_state_dict()}, path)["model"])
