"""The trainer role: a process group that reads TrainBatches from the rollout stream and takes optimizer steps.

    torchrun --nproc-per-node N -m megatron_scalerl.trainer --run-dir RUN [--max-steps S]

Reads `RUN/recipe.yaml` (resolved by the launcher), states its precision once in the log (`trainer.precision: auto`,
as `--recipe` may give it, is resolved by rank 0 for all: `platform.precision`), joins the process group (nccl with
CUDA, gloo otherwise; every collective bounded by `cluster.collective_timeout_s`), builds the model at the recipe's
layout, resumes from the newest valid checkpoint in `RUN/checkpoints/` (or initialises from `trainer.init_from`, an
HF or Megatron checkpoint, else randomly with `trainer.seed`), sends its weights to the run's generators once one
answers (`RUN/generators.json`, see `generator_sync`; a run without that file trains alone; the launcher starts the
trainer beside the generators, so their start-ups overlap), then for each step i reads `RUN/rollouts/batch_i`,
trains, sends the new weights (tagged i + 1: every step under PipelineRL-k, every k-th step under PPO-off-policy-k,
whose generators keep one policy for k batches), appends a `trainer` record to `RUN/metrics.jsonl` and checkpoints
every `trainer.checkpoint_interval` steps and at the end. While it waits for a batch it sends the current weights to
any generator that does not serve them (one that came up later, or restarted). `trainer/idle_fraction` is the share
of its wall time spent waiting for batches. SIGTERM, or the launcher's `RUN/stop_requested` (see `run_dir`): the
current step finishes, the trainer checkpoints it and exits 0; a rank still running `STOP_STACKS_AFTER_S` seconds
after the stop writes every thread's stack to its log (where a stop hangs, before the launcher's SIGKILL).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_scalerl.algo.off_policy import pushes_weights_after
from megatron_scalerl.checkpoint.store import CheckpointStore
from megatron_scalerl.errors import UserError
from megatron_scalerl.gpu_hours import ComputeMeter
from megatron_scalerl.metrics import MetricsLog, read_metrics
from megatron_scalerl.platform.distributed import from_rank0
from megatron_scalerl.platform.precision import resolve_precision, with_precision
from megatron_scalerl.recipe import Recipe, load_recipe
from megatron_scalerl.rollout.stream import RolloutStream, TrainBatch
from megatron_scalerl.run_dir import CURRICULUM_FILE, STOP_TIMEOUT_S, stop_requested
from megatron_scalerl.trainer.generator_sync import GeneratorLink
from megatron_scalerl.trainer.setup import build_trainer
from megatron_scalerl.trainer.state import load_trainer, save_trainer
from megatron_scalerl.trainer.step import NonFiniteError
from megatron_scalerl.weight_sync.protocol import WeightSyncError

STOP_STACKS_AFTER_S = STOP_TIMEOUT_S / 2  # stacks while the launcher still waits for the stop
log = logging.getLogger("megatron_scalerl.trainer")



def _compute_hours_so_far(run_dir: Path, rl_state: dict) -> float:
    """Wall hours the run has used before this process: the later of the checkpoint's figure and the last trainer
    record (work done after the last checkpoint and lost in a crash was still paid for)."""
    records = read_metrics(run_dir, role="trainer")
    logged = records[-1].get("wall_hours") or 0.0 if records else 0.0
    return max(rl_state.get("wall_hours", 0.0), logged)


def _rl_extras(run_dir: Path, wall_hours: float) -> dict:
    extras = {"wall_hours": wall_hours}
    curriculum = run_dir / CURRICULUM_FILE  # snapshotted by each checkpoint
    if curriculum.is_file():
        extras["curriculum"] = json.loads(curriculum.read_text())
    return extras


def require_trainer_world(recipe: Recipe, world_size: int) -> None:
    """The trainer's processes must be the recipe's trainer GPUs (tp x pp x dp): the layout, the micro-batch split
    and the GPU-hours the run reports all follow from them."""
    p = recipe.parallelism
    expected = p.tp * p.pp * p.dp_size(recipe.cluster.trainer_gpus)
    if world_size != expected:
        raise UserError(f"the trainer runs on {world_size} processes, but the recipe's layout is tp x pp x dp = "
                        f"{p.tp} x {p.pp} x {p.dp_size(recipe.cluster.trainer_gpus)} = {expected} (cluster.trainer_nodes "
                        f"x cluster.gpus_per_node = {recipe.cluster.trainer_gpus}): start {expected} processes "
                        f"(torchrun --nproc-per-node) or change the recipe's cluster / parallelism sections")


def _next_batch(stream: RolloutStream, index: int, *, timeout_s: float, vocab_size: int, link: GeneratorLink | None,
                model: list, stopping: Callable[[], bool], poll_s: float = 0.5) -> TrainBatch | None:
    """Batch `index` once the orchestrator wrote it, or None once `stopping()` (asked on rank 0: SIGTERM or the
    launcher's RUN/stop_requested); TimeoutError after `timeout_s` seconds. Meanwhile a generator that restarted gets
    the current weights. Collective: rank 0 decides for every rank."""
    deadline = time.monotonic() + timeout_s
    is_rank0 = dist.get_rank() == 0
    while True:
        ready, stop = from_rank0((stream.ready(index), stopping()) if is_rank0 else None)
        if stop:
            return None
        if ready:
            return stream.read(index, vocab_size)[0]
        if time.monotonic() > deadline:
            raise stream.missing(index, timeout_s)
        if link is None or not link.catch_up(model, index):
            time.sleep(poll_s)


def run_trainer(run_dir: Path, recipe: Recipe, *, max_steps: int | None = None, batch_timeout_s: float = 3600.0,
                is_log_rank: bool = True, stop: threading.Event | None = None) -> dict:
    """Train until `max_steps` (default: trainer.max_steps) optimizer steps, or until `stop` is set or the launcher
    writes RUN/stop_requested (then at the next batch boundary); checkpoints the last step either way. Returns the
    last step's metrics."""
    stop = stop or threading.Event()

    def stopping() -> bool:
        return stop.is_set() or stop_requested(run_dir)

    require_trainer_world(recipe, dist.get_world_size())
    trainer = build_trainer(recipe)
    store = CheckpointStore(run_dir, keep=recipe.trainer.keep_checkpoints)
    rl_state: dict = {}
    latest = store.latest_valid(set_aside=True)
    if latest is not None:
        trainer.step.state, rl_state = load_trainer(latest[1], trainer.model, trainer.optimizer)
        log.info("resumed from %s (step %d)", latest[1].name, trainer.step.state.step)
    stream = RolloutStream(run_dir)
    link = GeneratorLink.from_run_dir(run_dir, recipe, is_rank0=dist.get_rank() == 0)
    metrics = MetricsLog(run_dir, "trainer", wandb_mode=recipe.logging.wandb_mode if is_log_rank else "disabled",
                         wandb_project=recipe.logging.wandb_project, run_name=recipe.name, config=recipe.to_dict())
    # the run's one compute clock, the orchestrator's too: sacct over the run's SLURM jobs where there is accounting,
    # else wall time (over restarts) x the recipe's GPUs
    compute = ComputeMeter(run_dir, recipe.cluster.total_gpus, _compute_hours_so_far(run_dir, rl_state))
    waited_s = 0.0
    last: dict = {}

    saved_step = latest[0] if latest is not None else None

    def checkpoint() -> None:
        nonlocal saved_step
        path = save_trainer(store, trainer.model, trainer.optimizer, trainer.step.state, recipe.model,
                            _rl_extras(run_dir, compute.wall_hours()))
        saved_step = trainer.step.state.step
        if is_log_rank:
            log.info("checkpoint %s (step %d)", path, saved_step)
        if is_log_rank:  # batches older than the oldest kept checkpoint can never be read again
            stream.prune(before=min(store.iterations()))

    end = max_steps if max_steps is not None else recipe.trainer.max_steps
    try:
        if link is not None:  # even with nothing left to train: the orchestrator validates the last weights
            link.first_push(trainer.model, trainer.step.state.step, timeout_s=batch_timeout_s, stopping=stopping)
        while trainer.step.state.step < end:
            waiting = time.monotonic()
            batch = _next_batch(stream, trainer.step.state.step, timeout_s=batch_timeout_s,
                                vocab_size=recipe.model.vocab_size, link=link, model=trainer.model,
                                stopping=stopping)
            batch_wait_s = time.monotonic() - waiting
            waited_s += batch_wait_s
            if batch is None:
                log.info("stop requested: checkpointing step %d", trainer.step.state.step)
                faulthandler.dump_traceback_later(STOP_STACKS_AFTER_S)  # a checkpoint that hangs shows where
                break
            last = trainer.step.run(batch)
            step = trainer.step.state.step
            if link is not None and pushes_weights_after(recipe.rollout.off_policy, recipe.rollout.k, step, end):
                last.update(link.push(trainer.model, step))
            last.update({"trainer/idle_fraction": waited_s / max(time.monotonic() - compute.started, 1e-9),
                         "trainer/batch_wait_s": batch_wait_s})  # since start; seconds this step waited for its batch
            if is_log_rank and step % recipe.logging.log_interval == 0:  # rank 0 alone asks sacct, when it logs
                last.update(compute.figures())
                metrics.log(step, last)
            if step % recipe.trainer.checkpoint_interval == 0:
                checkpoint()
        if saved_step != trainer.step.state.step:
            checkpoint()
    finally:
        metrics.close()
        if link is not None:
            link.close()
    return last


def _on_sigterm(stop: threading.Event) -> None:
    """SIGTERM: the trainer stops at its next batch boundary; stacks of every thread go to stderr if this rank is
    still running `STOP_STACKS_AFTER_S` seconds later."""
    if not stop.is_set():
        log.info("SIGTERM: stopping after the current step (then a checkpoint)")
        faulthandler.dump_traceback_later(STOP_STACKS_AFTER_S)
    stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_scalerl.trainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--recipe", help="recipe to use instead of RUN/recipe.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--batch-timeout-s", type=float, default=3600.0,
                        help="seconds to wait for the next TrainBatch before failing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")

    from megatron_scalerl.platform import destroy_distributed, init_distributed

    try:
        recipe = load_recipe(args.recipe or args.run_dir / "recipe.yaml", args.overrides)
        try:
            info = init_distributed(recipe.cluster.backend, recipe.cluster.collective_timeout_s)
        except RuntimeError as exc:  # rendezvous failed or timed out: the message names the address and rank
            raise UserError(str(exc)) from None
        try:
            # rank 0's resolution for every rank: ranks on unlike machines must still build the same dtypes
            precision = from_rank0(resolve_precision(recipe.trainer.precision, cuda=torch.cuda.is_available()))
            recipe = with_precision(recipe, precision)
            if info.rank == 0:  # said once per start (the launcher warns on the console where bf16 is emulated)
                log.info("precision: %s", precision.reason)
            stop = threading.Event()  # SIGTERM (Ctrl-C of `scalerl train`, SLURM's time limit): checkpoint, exit 0
            signal.signal(signal.SIGTERM, lambda *_: _on_sigterm(stop))
            run_trainer(args.run_dir, recipe, max_steps=args.max_steps, batch_timeout_s=args.batch_timeout_s,
                        is_log_rank=info.rank == 0, stop=stop)
        finally:
            destroy_distributed()
    except (UserError, TimeoutError, NonFiniteError, WeightSyncError, dist.DistError) as exc:
        log.error("%s", exc)
        return 2 if isinstance(exc, UserError) else 1
    return 0
