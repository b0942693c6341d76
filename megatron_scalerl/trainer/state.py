"""Save and restore the trainer: model + optimizer (Megatron distributed checkpoint) + RL state + RNG states.

Model and optimizer go through `checkpoint.sharded` (megatron-core `dist_checkpointing`, torch_dist format), whose
sharded state dicts are layout-independent: a checkpoint written at TP2 loads at TP1/PP2/EP2. The optimizer uses the
`fully_reshardable` layout for the same reason (gathered on DP rank 0 at save; megatron-core 0.16.1 rejects
the `fully_sharded_model_space` layout's flattened ranges). The RL state (`StepState`, data cursor, compute used) is
JSON written by rank 0; RNG states are per rank and restored only when the world size is unchanged (our models have
no dropout, so they do not affect the loss; they are kept for completeness).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from megatron_scalerl.checkpoint.sharded import load_sharded, save_sharded
from megatron_scalerl.checkpoint.store import CheckpointStore, read_rl_state
from megatron_scalerl.models.weights import unwrap_model
from megatron_scalerl.platform.distributed import rank, world_size
from megatron_scalerl.recipe import ModelConfig
from megatron_scalerl.trainer.step import StepState

log = logging.getLogger(__name__)

# Saving gathers each parameter's optimizer state to data-parallel rank 0 over gloo (`mem_efficient`), not to every
# rank; loading reads it at any layout.
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable",
                      "distrib_optim_fully_reshardable_mem_efficient": True}


def _sharded_state(model_chunks: list, optimizer, *, is_loading: bool) -> dict:
    if len(model_chunks) != 1:
        raise NotImplementedError("virtual pipeline stages (several model chunks per rank) are not supported yet")
    state = {"model": unwrap_model(model_chunks[0]).sharded_state_dict()}
    if optimizer is not None:  # built by trainer.setup.build_optimizer, which gives it its state
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=OPTIMIZER_SHARDING)
    return state


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_trainer(store: CheckpointStore, model_chunks: list, optimizer, step_state: StepState,
                 model_cfg: ModelConfig, extra_rl_state: dict) -> Path:
    """Collective. Publishes `checkpoints/iter_<step>` (step = optimizer steps taken). The architecture
    (`model_cfg`) is recorded in the RL state so tools can rebuild the model from the checkpoint alone."""
    def write(tmp: Path) -> None:
        save_sharded(_sharded_state(model_chunks, optimizer, is_loading=False), tmp)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(), tmp / "rng" / f"rank_{rank():05d}.pt")

    rl_state = {"step_state": dataclasses.asdict(step_state), "world_size": world_size(),
                "model": model_cfg.model_dump(mode="json"), **extra_rl_state}
    return store.save(step_state.step, write, rl_state)


def load_trainer(path: Path, model_chunks: list, optimizer) -> tuple[StepState, dict]:
    """Collective. Loads model (+ optimizer when given) from checkpoint `path`; returns (StepState, rl_state)."""
    from megatron.core import tensor_parallel

    rl_state = read_rl_state(path)
    loaded = load_sharded(_sharded_state(model_chunks, optimizer, is_loading=True), path)
    unwrap_model(model_chunks[0]).load_state_dict(loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    rng_file = path / "rng" / f"rank_{rank():05d}.pt"
    if rl_state.get("world_size") == world_size() and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    else:
        log.info("%s: written by %s ranks, loading on %s: RNG states not restored", path.name,
                 rl_state.get("world_size"), world_size())
    step_state = StepState(**rl_state["step_state"])
    return step_state, rl_state
