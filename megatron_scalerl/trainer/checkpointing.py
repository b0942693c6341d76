"""Save and restore the trainer: model + optimizer (Megatron distributed checkpoint) + RL state + RNG states.

Model and optimizer go through `checkpoint.sharded` (megatron-core `dist_checkpointing`, torch_dist format; written
by `CheckpointWriter`, in the background on GPUs), whose
sharded state dicts are layout-independent: a checkpoint written at TP2 loads at TP1/PP2/EP2. The optimizer uses the
`fully_reshardable` layout for the same reason (gathered on DP rank 0 at save; megatron-core 0.16.1 rejects
the `fully_sharded_model_space` layout's flattened ranges). The RL state (`StepState`, data cursor, compute used) is
JSON written by rank 0; RNG states are per rank and restored only when the world size is unchanged (our models have
no dropout, so they do not affect the loss; they are kept for completeness). An RNG file holds tensors only (torch's
CPU and CUDA states, megatron's tracker states by name) and is read with `torch.load(weights_only=True)`, which
unpickles no object but tensors and plain values: a file that holds anything else (a checkpoint of another writer) is not restored, with a
warning, and the resume goes on from it, exact in all but the random draws.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from pathlib import Path

import torch

from megatron_scalerl.checkpoint.sharded import load_sharded, save_sharded
from megatron_scalerl.checkpoint.store import CheckpointError, CheckpointStore, Publication, read_rl_state
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
    """This rank's RNG states, tensors only: {"torch": CPU state, "tracker": {name: state}, "cuda": state (on GPUs)}."""
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def read_rng_state(file: Path) -> dict | None:
    """The RNG states in `file` (as `_rng_state` gives them), read with `torch.load(weights_only=True)`: tensors and
    plain values (torch's allowlist), no other object unpickled. None, with a warning naming the file, when it holds
    anything else or another layout: then the checkpoint loads without them."""
    try:
        state = torch.load(file, weights_only=True)
    except pickle.UnpicklingError as exc:
        why = str(exc).splitlines()[0]
        state = None
    else:
        why = _rng_layout_problem(state)
    if why is None:
        return state
    log.warning("%s: RNG states not restored, the file holds what this version does not write (%s); the resume "
                "goes on without them: exact in all but random draws (our models have no dropout)", file, why)
    return None


def _rng_layout_problem(state: object) -> str | None:
    """Why `state` is not the layout `_rng_state` writes, or None."""
    if not isinstance(state, dict) or not isinstance(state.get("torch"), torch.Tensor):
        return "no tensor 'torch'"
    if not isinstance(state.get("tracker"), dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state["tracker"].items()):
        return "'tracker' is no dict of tensors by name"
    if "cuda" in state and not isinstance(state["cuda"], torch.Tensor):
        return "'cuda' is no tensor"
    return None


class CheckpointWriter:
    """Writes the trainer's checkpoints into a `CheckpointStore`; `save` and `poll` are collective.

    Model and optimizer go through megatron-core's asynchronous save (`checkpoint.sharded.save_sharded` returns its
    AsyncRequest). With `background` (CUDA: megatron's AsyncCallsQueue is CUDA-bound) the request runs in a process
    of its own once the tensors are copied to host memory, the trainer steps on, and `poll` publishes the checkpoint
    when it finds the write finished on every rank; without it (CPU) the same request runs in place, and `save`
    returns the checkpoint published. One checkpoint is written at a time: publish the one in the background
    (`poll(blocking=True)`) before the next `save`. A failed write raises CheckpointError on every rank from the
    `save` or `poll` that finds it (`checkpoint.store.Publication`); what was written in the background is then
    stopped and nothing is published."""

    def __init__(self, store: CheckpointStore, *, background: bool):
        self.store = store
        self.queue = None
        if background:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue()
        self.pending: tuple[int, int, Publication] | None = None  # (step, megatron's call index, its publication)

    def save(self, model_chunks: list, optimizer, step_state: StepState, model_cfg: ModelConfig,
             extra_rl_state: dict) -> Path | None:
        """Start checkpoint `iter_<step>` (step = optimizer steps taken), the architecture (`model_cfg`) recorded in
        its RL state so tools can rebuild the model from it alone; the published directory, or None while it is
        written in the background."""
        if self.pending is not None:
            raise RuntimeError(f"checkpoint of step {self.pending[0]} still written in the background: "
                               "poll(blocking=True) publishes it before the next save")
        rl_state = {"step_state": dataclasses.asdict(step_state), "world_size": world_size(),
                    "model": model_cfg.model_dump(mode="json"), **extra_rl_state}
        publication = self.store.start(step_state.step, rl_state)
        scheduled: list[int] = []

        def write() -> None:  # megatron's files first: it warns of a directory that already holds some
            request = save_sharded(_sharded_state(model_chunks, optimizer, is_loading=False), publication.tmp,
                                   in_place=self.queue is None)
            if request is not None:
                scheduled.append(self.queue.schedule_async_request(request))
            (publication.tmp / "rng").mkdir(exist_ok=True)
            torch.save(_rng_state(), publication.tmp / "rng" / f"rank_{rank():05d}.pt")

        try:
            publication.write(write)
        except CheckpointError:
            self._abort()
            raise
        if self.queue is None:
            return self.store.finish(step_state.step, publication)
        self.pending = (step_state.step, scheduled[0], publication)
        return None

    def poll(self, *, blocking: bool = False) -> Path | None:
        """The checkpoint written in the background, published once its write finished on every rank (`blocking`:
        wait for it); None when there is none, or it is not finished."""
        if self.pending is None:
            return None
        step, call, publication = self.pending
        done: list[int] = []
        try:
            publication.write(lambda: done.extend(self.queue.maybe_finalize_async_calls(blocking=blocking)))
        except CheckpointError:
            self.pending = None
            self._abort()
            raise
        if call not in done:
            return None
        self.pending = None
        return self.store.finish(step, publication)

    def _abort(self) -> None:
        """Kill what megatron's queue still writes (its partial directory is gone or never published)."""
        if self.queue is not None:
            for active in self.queue.async_calls:
                active.async_caller.close(abort=True)
            self.queue.async_calls.clear()

    def close(self) -> None:
        """Stop the background writer: a write still unfinished (the trainer failed) is abandoned, its partial
        directory never published (the next save replaces it)."""
        self._abort()


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
        rng = read_rng_state(rng_file)
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
            tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    else:
        log.info("%s: written by %s ranks, loading on %s: RNG states not restored", path.name,
                 rl_state.get("world_size"), world_size())
    step_state = StepState(**rl_state["step_state"])
    return step_state, rl_state
