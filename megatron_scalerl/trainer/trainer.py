"""The trainer role: a process group that reads TrainBatches from the rollout stream and takes optimizer steps.

    torchrun --nproc-per-node N -m megatron_scalerl.trainer --run-dir RUN [--max-steps S]

`main` reads `RUN/recipe.yaml` (resolved by the launcher), states its precision once in the log
(`trainer.precision: auto`, as `--recipe` may give it, is resolved by rank 0 for all: `platform.precision`), joins
the process group (nccl with CUDA, gloo otherwise; every collective bounded by `cluster.collective_timeout_s`) and
runs a `Trainer`, read top to bottom:

- `Trainer(run_dir, recipe)` builds the model at the recipe's layout and its optimizer (`trainer/setup.py`), resumes
  from the newest valid checkpoint in `RUN/checkpoints/` (or initialises from `trainer.init_from`, an HF or Megatron
  checkpoint, else randomly with `trainer.seed`), and opens the run's generators (`RUN/generators.json`, see
  `weight_sync.generator_link`; a run without that file trains alone), the metrics log and the compute clock;
- `train_step(batch)`: one optimizer step (the forward/backward passes and the loss: `trainer/step.py`);
- `checkpoint()`: `RUN/checkpoints/iter_<step>`, then the rollout batches no checkpoint a resume may use needs are
  pruned (`CheckpointStore.resumable`: the `keep_checkpoints` newest; `keep_every` ones are kept for evaluation);
- `log(metrics)`: a `trainer` record in `RUN/metrics.jsonl` with the compute so far (rank 0);
- `run()`: sends its weights to the generators once one answers (the launcher starts the trainer beside the
  generators, so their start-ups overlap), then for each step i reads `RUN/rollouts/batch_i`, trains, sends the new
  weights (tagged i + 1: every step under PipelineRL-k, every k-th step under PPO-off-policy-k, whose generators keep
  one policy for k batches), logs every `logging.log_interval` steps and checkpoints every
  `trainer.checkpoint_interval` steps, or once `trainer.checkpoint_interval_min` minutes passed since the last one
  (by rank 0's clock), and at the end (`trainer.checkpointing.CheckpointWriter`: megatron-core's asynchronous save, in
  the background on GPUs, published once written on every rank; in place on CPUs, where megatron-core's queue
  for it cannot run: it is CUDA-bound). While it waits for a batch it sends the current weights to any generator
  that does not serve them (one that came up later, or restarted). `trainer/idle_fraction` is the share of its wall time spent waiting for batches.
  After the last step it waits until the generators serve its weights (`GeneratorLink.deliver`).

Every wait has a deadline (`run.deadlines.Deadline`, over this process's recent steps; `--batch-timeout-s` fixes
it): the first push; a batch, waited for as long as the orchestrator's heartbeat (`RUN/orchestrator.heartbeat`)
moves, and the deadline after it stops; the delivery of the last step's weights. Past one, the trainer fails
(exit 1) with the wait's cause, and the launch heals or ends the run (launch/supervise.py).

SIGTERM, or the launcher's `RUN/stop_requested` (see `run_dir`): the current step finishes, the trainer checkpoints
it and exits 0; a rank still running `STOP_STACKS_AFTER_S` seconds after the stop writes every thread's stack to its
log (where a stop hangs, before the launcher's SIGKILL).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_scalerl.algo.off_policy import pushes_weights_after
from megatron_scalerl.batches.stream import BatchReader, RolloutStream
from megatron_scalerl.batches.train_batch import CorruptBatchError, TrainBatch
from megatron_scalerl.checkpoint.store import CheckpointStore
from megatron_scalerl.errors import UserError
from megatron_scalerl.platform import destroy_distributed, init_distributed
from megatron_scalerl.platform.distributed import from_rank0
from megatron_scalerl.platform.precision import resolve_precision, with_precision
from megatron_scalerl.recipe import Recipe, load_recipe, load_run_recipe
from megatron_scalerl.run.deadlines import Deadline, Heartbeat, minutes
from megatron_scalerl.run.directory import (
    CURRICULUM_FILE,
    HEARTBEAT_FILE,
    RECIPE_FILE,
    STOP_TIMEOUT_S,
    stop_requested,
)
from megatron_scalerl.run.gpu_hours import ComputeMeter
from megatron_scalerl.run.metrics_log import MetricsLog, logged_wall_hours
from megatron_scalerl.trainer.checkpointing import CheckpointWriter, load_trainer
from megatron_scalerl.trainer.setup import build_model_and_optimizer
from megatron_scalerl.trainer.step import ForwardBackward, NonFiniteError, StepState, clip_and_update, grad_norm, lr_at
from megatron_scalerl.weight_sync.generator_link import GeneratorLink
from megatron_scalerl.weight_sync.protocol import WeightSyncError

STOP_STACKS_AFTER_S = STOP_TIMEOUT_S / 2  # stacks while the launcher still waits for the stop
BATCH_POLL_S = 0.5  # how often rank 0 looks for the next batch (and for a stop) while it waits
log = logging.getLogger("megatron_scalerl.trainer")


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


class Trainer:
    """One rank of the trainer: owns the model chunks, the optimizer, the `StepState`, the run's checkpoints, its
    link to the generators, the `trainer` rows of the metrics log and the compute clock. Building it, `train_step`,
    `checkpoint` and `run` are collective: every rank calls them, and rank 0 decides what depends on files or
    servers (`from_rank0`); `log` and `stopping` are rank 0's."""

    def __init__(self, run_dir: Path, recipe: Recipe, *, batch_timeout_s: float | None = None,
                 stop: threading.Event | None = None):
        """Collective, after `platform.init_distributed` with the recipe's trainer processes. `batch_timeout_s`:
        seconds to wait for a batch (and for a first generator) instead of the deadline of the run's recent steps
        (`run.deadlines`); `stop`: set (SIGTERM) to stop at the next batch."""
        require_trainer_world(recipe, dist.get_world_size())
        self.run_dir, self.recipe = Path(run_dir), recipe
        self.batch_timeout_s = batch_timeout_s
        self.deadline = Deadline.of(recipe.launch)  # marked at each step's end (rank 0's decides for all)
        self.heartbeat = Heartbeat(self.run_dir / HEARTBEAT_FILE)  # the orchestrator's
        self.stop = stop or threading.Event()
        self.is_rank0 = dist.get_rank() == 0
        self.model, self.optimizer = build_model_and_optimizer(recipe)
        self.forward_backward = ForwardBackward(recipe, self.model)
        self.state = StepState()
        self.store = CheckpointStore(run_dir, keep=recipe.trainer.keep_checkpoints,
                                     keep_every=recipe.trainer.keep_every)
        self.writer = CheckpointWriter(self.store, background=torch.cuda.is_available())
        self.saved_step: int | None = None  # the step of the newest checkpoint of this run (or being written)
        self.last_checkpoint_s = time.monotonic()  # of the last checkpoint of this process (or its start)
        rl_state = self._resume()
        self.stream: BatchReader = RolloutStream(run_dir)
        self.link = GeneratorLink.from_run_dir(run_dir, recipe, is_rank0=self.is_rank0,  # None: no generators
                                               deadline=self.deadline)
        self.metrics_log = MetricsLog(run_dir, "trainer",
                                      wandb_mode=recipe.logging.wandb_mode if self.is_rank0 else "disabled",
                                      wandb_project=recipe.logging.wandb_project, run_name=recipe.name,
                                      config=recipe.to_dict(), resumed_from=self.saved_step)
        # the run's one compute clock, the orchestrator's too: sacct over the run's SLURM jobs where there is
        # accounting, else wall time (over restarts) x the recipe's GPUs
        # wall hours before this process: the checkpoint's, or more where work after it was lost (still paid for)
        self.compute = ComputeMeter(self.run_dir, recipe.cluster.total_gpus,
                                    max(rl_state.get("wall_hours", 0.0), logged_wall_hours(self.run_dir, "trainer")))
        self.waited_s = 0.0  # seconds spent waiting for batches since this process started

    def _resume(self) -> dict:
        """Load the newest checkpoint that passes its manifest (newer, corrupt ones are set aside); returns its RL
        state, {} when the run has no checkpoint yet (the model keeps its initial weights)."""
        latest = self.store.latest_valid(set_aside=True)
        if latest is None:
            return {}
        self.saved_step, path = latest
        self.state, rl_state = load_trainer(path, self.model, self.optimizer)
        log.info("resumed from %s (step %d)", path.name, self.state.step)
        return rl_state

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on `batch` (the whole step's batch, identical on every rank); returns its metrics.

        A non-finite loss or gradient norm skips the update (weights and LR schedule unchanged; the step still counts,
        `train/skipped` says so); `trainer.max_consecutive_nonfinite` skips in a row raise NonFiniteError naming the
        step."""
        start = time.perf_counter()
        step, t = self.state.step, self.recipe.trainer
        lr = lr_at(self.state.updates, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss, merged = self.forward_backward.gradients(batch)
        norm = grad_norm(self.optimizer)
        updated = math.isfinite(loss) and math.isfinite(norm) and clip_and_update(self.optimizer, norm, t.grad_clip)
        self.state.advance(updated)  # nothing to undo when skipped: the gradients are zeroed at the next step
        if self.state.consecutive_nonfinite >= t.max_consecutive_nonfinite:
            raise NonFiniteError(f"step {step}: non-finite loss ({loss}) or grad norm ({norm}) for "
                                 f"{self.state.consecutive_nonfinite} steps in a row "
                                 "(trainer.max_consecutive_nonfinite)")
        elapsed = time.perf_counter() - start
        tokens = int(batch.lengths.sum())
        return {
            "train/loss": loss, "train/grad_norm": norm, "train/lr": lr, "train/skipped": 0.0 if updated else 1.0,
            "train/clip_fraction": merged["clip_fraction"], "train/ratio_mean": merged["ratio_mean"],
            "train/ratio_max": merged["ratio_max"], "train/mismatch_k3": merged["mismatch_k3"],
            "train/entropy": merged["entropy"], "train/loss_tokens": merged["tokens"],
            "train/truncated_fraction": float(batch.truncated.float().mean()),
            "train/samples": batch.num_samples, "train/tokens": tokens,
            "train/step_time_s": elapsed, "train/tokens_per_s": tokens / elapsed,
            "train/updates": self.state.updates,
            # PipelineRL-k bounds this by k: how many steps behind this step's policy the batch's oldest token's was
            "train/staleness_max": float(step - batch.weight_versions[batch.loss_mask].min())
            if bool(batch.loss_mask.any()) else 0.0,
            # a batch with routes (an MoE run that captures routing: `Recipe.captures_routes`)
            **({"train/routing_agreement": merged["routing_agreement"]} if "routing_agreement" in merged else {}),
        }

    def _checkpoint_clock_due(self) -> bool:
        """Whether `trainer.checkpoint_interval_min` minutes have passed since this process's last checkpoint (or its
        start), by rank 0's clock: collective (every rank checkpoints at the same step); False without the key."""
        minutes = self.recipe.trainer.checkpoint_interval_min
        if minutes is None:
            return False
        return bool(from_rank0(time.monotonic() - self.last_checkpoint_s >= 60.0 * minutes))

    def checkpoint(self) -> None:
        """Publish `RUN/checkpoints/iter_<step>`: model, optimizer, and the RL state (`StepState`, the compute used so
        far, a copy of the orchestrator's `RUN/curriculum.json`); rank 0 then prunes the rollout batches older than
        the oldest kept checkpoint (none can be read again)."""
        extras = {"wall_hours": self.compute.wall_hours()}
        curriculum = self.run_dir / CURRICULUM_FILE
        if curriculum.is_file():
            extras["curriculum"] = json.loads(curriculum.read_text())
        self._published(self.writer.poll(blocking=True))  # the one before, if it is still written in the background
        self.saved_step = self.state.step
        self._published(self.writer.save(self.model, self.optimizer, self.state, self.recipe.model, extras))
        self.last_checkpoint_s = time.monotonic()

    def _published(self, path: Path | None) -> None:
        """Rank 0, after checkpoint `path` was published (None: nothing was): says so, and prunes the batches."""
        if path is None or not self.is_rank0:
            return
        log.info("checkpoint %s", path)
        # keep the batch before the oldest checkpoint a resume may use: that checkpoint's copy of the orchestrator
        # state may end there, and a resume rewound to it goes on after it (orchestrator/state.py); the
        # `keep_every` ones, for evaluation, hold nothing back
        self.stream.prune(before=min(self.store.resumable()) - 1)

    def log(self, metrics: dict) -> None:
        """Rank 0: append `metrics` with the compute so far (`ComputeMeter.figures`: wall_hours, gpus, gpu_hours,
        gpu_hours_source) as the `trainer` record at step = steps taken. Other ranks log nothing (nor ask sacct)."""
        if self.is_rank0:
            self.metrics_log.log(self.state.step, {**metrics, **self.compute.figures()})

    def stopping(self) -> bool:
        """Asked on rank 0: SIGTERM (`stop`) or the launcher's RUN/stop_requested."""
        return self.stop.is_set() or stop_requested(self.run_dir)

    def _wait_s(self) -> tuple[float, str]:
        """The deadline of a wait (seconds) and its words: `batch_timeout_s` if given, else the run's."""
        if self.batch_timeout_s is not None:
            return self.batch_timeout_s, f"{minutes(self.batch_timeout_s)} (--batch-timeout-s)"
        return self.deadline.seconds(), self.deadline.words()

    def _silent(self, index: int, waiting: float) -> str | None:
        """Rank 0, waiting for batch `index` since `waiting`: the error once the orchestrator's heartbeat has not
        moved for the deadline, else None."""
        bound, words = self._wait_s()
        if self.heartbeat.silent_s() <= bound:
            return None
        return (f"{self.stream.missing(index, time.monotonic() - waiting)} (no heartbeat from it, "
                f"RUN/{HEARTBEAT_FILE}, for {words})")

    def _next_batch(self) -> TrainBatch | None:
        """Batch `state.step` once the orchestrator wrote it, or None once `stopping()`; TimeoutError once the
        orchestrator's heartbeat stood still for the deadline (`_wait_s`). Meanwhile a generator that restarted
        gets the current weights. Rank 0 decides for all."""
        index = self.state.step
        waiting = time.monotonic()
        self.heartbeat.reset()
        while True:
            ready, stop, silent = from_rank0((self.stream.ready(index), self.stopping(),
                                              self._silent(index, waiting)) if self.is_rank0 else None)
            if stop:
                return None
            if ready:
                try:
                    return self.stream.read(index, self.recipe.model.vocab_size)[0]
                except CorruptBatchError as exc:  # the restart's rewind sets it aside: it is made again
                    raise CorruptBatchError(f"{exc} (a restart of the launch, or `scalerl train --resume`, sets it and "
                                            "the batches after it aside; the orchestrator writes them again)") from None
            if silent is not None:
                raise TimeoutError(silent)
            if self.link is None or not self.link.catch_up(self.model, index):
                time.sleep(BATCH_POLL_S)

    def run(self, max_steps: int | None = None) -> None:
        """Train until `max_steps` (default: trainer.max_steps) optimizer steps have been taken, or until a stop
        (then at the next batch boundary); checkpoints the last step either way."""
        end = max_steps if max_steps is not None else self.recipe.trainer.max_steps
        rollout = self.recipe.rollout
        if self.link is not None:  # even with nothing left to train: the orchestrator validates the last weights
            self.link.first_push(self.model, self.state.step, timeout_s=self._wait_s()[0], stopping=self.stopping)
        self.deadline.mark()  # the clock of the steps starts
        stopped = False
        while self.state.step < end:
            waiting = time.monotonic()
            batch = self._next_batch()
            batch_wait_s = time.monotonic() - waiting
            self.waited_s += batch_wait_s
            if batch is None:
                log.info("stop requested: checkpointing step %d", self.state.step)
                faulthandler.dump_traceback_later(STOP_STACKS_AFTER_S)  # a checkpoint that hangs shows where
                stopped = True
                break
            metrics = self.train_step(batch)
            step = self.state.step
            if self.link is not None and pushes_weights_after(rollout.off_policy, rollout.k, step, end):
                metrics.update(self.link.push(self.model, step))
            since_start_s = max(time.monotonic() - self.compute.started, 1e-9)
            metrics.update({"trainer/idle_fraction": self.waited_s / since_start_s,
                            "trainer/batch_wait_s": batch_wait_s})  # seconds this step waited for its batch
            if step % self.recipe.logging.log_interval == 0:
                self.log(metrics)
            if step % self.recipe.trainer.checkpoint_interval == 0 or self._checkpoint_clock_due():
                self.checkpoint()
            else:
                self._published(self.writer.poll())  # a checkpoint written in the background
            self.deadline.mark()
        if self.saved_step != self.state.step:
            self.checkpoint()
        self._published(self.writer.poll(blocking=True))
        if self.link is not None and not stopped:  # checkpointed first: nothing is lost
            self.link.deliver(self.model, self.state.step, stopping=self.stopping)

    def close(self) -> None:
        """The metrics log (wandb's run), the weight broadcast group and the checkpoint writer."""
        self.writer.close()
        self.metrics_log.close()
        if self.link is not None:
            self.link.close()


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
    parser.add_argument("--batch-timeout-s", type=float, default=None,
                        help="seconds to wait for the next TrainBatch (and a first generator) before failing, instead "
                             "of the deadline of the run's recent steps (launch.wait_floor_min, launch.first_wait_min)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")

    try:
        recipe = (load_recipe(args.recipe, args.overrides) if args.recipe
                  else load_run_recipe(args.run_dir, RECIPE_FILE, args.overrides))
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
            trainer = Trainer(args.run_dir, recipe, batch_timeout_s=args.batch_timeout_s, stop=stop)
            try:
                trainer.run(args.max_steps)
            finally:
                trainer.close()
        finally:
            destroy_distributed()
    except (UserError, TimeoutError, NonFiniteError, WeightSyncError, dist.DistError) as exc:
        log.error("%s", exc)
        return 2 if isinstance(exc, UserError) else 1
    return 0
