"""The orchestrator: one process per run that turns prompts into the TrainBatches the trainer reads.

    python -m megatron_scalerl.orchestrator --run-dir RUN [--tokenizer DIR] [--resume]

Reads `RUN/recipe.yaml` and `RUN/generators.json` (the launcher writes both; the API key comes from
$SCALERL_API_KEY). Generation never stops: prompts are drawn (`PromptSampler`, No-Positive-Resampling), each becomes a
group of `generations_per_prompt` samples on the fleet, graded and rewarded (`group_generation.py`), and every
`prompts_per_step` finished groups become one TrainBatch (`groups.build_train_batch`: filters, advantages) appended to
the rollout stream. Which prompt may start when, and which finished group is too stale to train on: `admission.py`.

State (`state.py`): saved as `RUN/curriculum.json` before each batch, so `--resume` continues from the
state that matches the stream's last batch; a resume first sets aside the batches sampled after the state the
trainer's checkpoint holds (policies the resumed trainer no longer has) and goes on from that state.

Validation (`validation.py`): at policy version 0, at each multiple of `data.validation_interval` and at the last
step, each at the first version of its interval seen; the batch that would take the trainer past an interval whose
validation has not started is held back until it has, and one a resumed run left without its validation is
recorded as missed (`val/missed`). After each validation the run's curve is refitted in a process of
its own (`live_forecast`, the recipe's `forecast` section): its `forecast/*` figures are logged at the validation's
step, the progress line shows the status and A, and `RUN/forecast/` holds the latest report. Metrics
(`metrics.jsonl`, role orchestrator) per batch at step b + 1, the trainer step that trains it; the console line
per batch ends with the time so far and to go (`progress.py`).

The end: after `trainer.max_steps` batches and the validation of the last step; or earlier, once the run's compute
reaches `trainer.max_gpu_hours` (checked after each batch) or the live forecast finds the ceiling reached
(`forecast.stop_at_fraction`): then no further batch is written, the reason goes to the log and to metrics.jsonl
(`run/stopped_early`, `run/stop_reason`), and the trainer is asked to stop (`RUN/stop_requested`: it checkpoints its
current step and exits 0). Either way `RUN/finished.json` records the reason, the batches written and the compute.

Deadline (`_watch_progress`): the run's generation must move: a group finished (training or validation), a new
policy version served, or a batch written. Nothing moving for the deadline (`run.deadlines.Deadline` over the
intervals between the policy versions it saw: max(`launch.wait_floor_min`, 3x the slowest of the last 5), or
`launch.first_wait_min` before one is timed) while a generator is up fails the orchestrator (exit 1) naming what it
waits on (the trainer's next or final weights, a validation, the generators), and the launch heals or ends the run.
The same task moves `RUN/orchestrator.heartbeat` every PROGRESS_POLL_S: the trainer waits for a batch as long as it
moves. With every generator down the wait is the fleet's (`Fleet.max_wait_s`). A sample may take (k + 1) deadlines
(`Fleet.request_timeout_s`: older, it is stale anyway); a generator that comes back must serve the current policy
within one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from megatron_scalerl.algo.off_policy import staleness_bound
from megatron_scalerl.algo.resampling import NoPositiveResampling
from megatron_scalerl.algo.versions import NO_VERSION
from megatron_scalerl.batches.stream import BatchWriter, RolloutStream
from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast.live import validation_draws
from megatron_scalerl.inference.fleet import Fleet, FleetError
from megatron_scalerl.orchestrator.admission import Admission
from megatron_scalerl.orchestrator.batch_building import RolloutGroup, build_train_batch
from megatron_scalerl.orchestrator.group_generation import GroupGenerator
from megatron_scalerl.orchestrator.live_forecast import LiveForecaster
from megatron_scalerl.orchestrator.progress import Progress
from megatron_scalerl.orchestrator.state import (
    SavedState,
    load_state,
    rewind_to_checkpoint,
    save_state,
)
from megatron_scalerl.orchestrator.validation import Validation, ValidationSchedule
from megatron_scalerl.recipe import Recipe, load_run_recipe
from megatron_scalerl.run.deadlines import Deadline, beat
from megatron_scalerl.run.directory import (
    API_KEY_ENV,
    CURRICULUM_FILE,
    HEARTBEAT_FILE,
    RECIPE_FILE,
    clear_finished,
    read_generators,
    request_stop,
    write_finished,
)
from megatron_scalerl.run.gpu_hours import ComputeMeter
from megatron_scalerl.run.metrics_log import MetricsLog, logged_wall_hours
from megatron_scalerl.tasks.problems import Problem, load_sources
from megatron_scalerl.tasks.prompts import PromptSampler, split_validation
from megatron_scalerl.tasks.rewards import RewardGrader
from megatron_scalerl.tasks.sandbox import require_sandbox

log = logging.getLogger("megatron_scalerl.orchestrator")

VERSION_POLL_S = 0.5
HOLD_POLL_S = 0.1  # while a batch is held back for a validation (validation.py): the trainer waits for the poll
FORECAST_DRAIN_S = 120.0  # at the end: how long the last live forecast may take to land
IDLE_SAMPLE_S = 0.2
PROGRESS_POLL_S = 2.0  # the progress watch looks (and moves the heartbeat) this often


class Orchestrator:
    def __init__(self, run_dir: Path, recipe: Recipe, tokenizer: Any, urls: list[str], *, api_key: str | None = None,
                 resume: bool = False, max_batches: int | None = None, grader_workers: int | None = None):
        self.run_dir, self.recipe = run_dir, recipe
        self.batch_size = recipe.rollout.prompts_per_step
        self.max_batches = max_batches if max_batches is not None else recipe.trainer.max_steps
        self.stream: BatchWriter = RolloutStream(run_dir)
        self.resampling = NoPositiveResampling.from_config(recipe.algorithm.no_positive_resampling)
        train, held_out = split_validation(load_sources(recipe.data.train, seed=recipe.data_seed),
                                           recipe.data.validation_holdout, seed=recipe.data_seed)
        self.sampler = PromptSampler(train, seed=recipe.trainer.seed, resampling=self.resampling)
        self.admission = Admission({p.key: p for source in train for p in source.problems}, self.sampler.next,
                                   prompts_per_step=self.batch_size, max_batches=self.max_batches,
                                   bound=staleness_bound(recipe.rollout.off_policy, recipe.rollout.k))
        self.fleet = Fleet(urls, api_key=api_key, on_server_back=self._wait_for_current_weights)
        self.deadline = Deadline.of(recipe.launch)  # marked at each new policy version seen: the run's steps
        self.progressed = time.monotonic()  # the last time generation moved (`_watch_progress`)
        self._set_request_timeout()
        # a run with code sources or the Python tool refuses to start on a sandbox that does not work; the weaker one
        # warns every step
        uses_code = any(source.verifier == "code" or source.environment == "python_tool" for source in recipe.data.train)
        self.sandbox_warning = require_sandbox(recipe.data.code_sandbox, "this run") if uses_code else None
        if self.sandbox_warning:
            print(self.sandbox_warning, flush=True)
        self.grader = RewardGrader(num_workers=grader_workers, code_sandbox=recipe.data.code_sandbox)
        self.groups = GroupGenerator(recipe, tokenizer, self.fleet, self.grader)
        self.metrics = MetricsLog(run_dir, "orchestrator", wandb_mode=recipe.logging.wandb_mode,
                                  wandb_project=recipe.logging.wandb_project, run_name=recipe.name)
        self.compute = ComputeMeter(run_dir, recipe.cluster.total_gpus)
        self.live = LiveForecaster(run_dir, recipe.forecast, eval_draws=validation_draws(recipe))
        schedule = ValidationSchedule(recipe.data.validation_interval, self.max_batches, recipe.rollout.off_policy,
                                      recipe.rollout.k)
        self.validation = Validation(held_out, domains=recipe.data.domains(), schedule=schedule,
                                     samples=recipe.data.validation_generations, metrics=self.metrics,
                                     compute=self.compute, live=self.live)
        self.finished: dict[int, RolloutGroup] = {}  # group index -> finished group, not yet in a batch
        self.tasks: set[asyncio.Task] = set()
        self.failure: BaseException | None = None  # the first task that raised: it ends the run
        self.failed = asyncio.Event()
        self.ended_early: tuple[str, str] | None = None  # (finish reason, why) of a run that ends itself early
        self.end_now = asyncio.Event()
        self.version: int | None = None
        self.changed = asyncio.Condition()
        self.window = {"idle": 0, "polls": 0}  # generator idle polls since the last batch
        self.generated = {"tokens": 0, "samples": 0}  # completion tokens and samples of finished groups
        if resume:
            self._restore()
            clear_finished(run_dir)  # continued: it ends again on its own terms (e.g. a raised max_steps)
        elif self.stream.next_index() > 0 or (run_dir / CURRICULUM_FILE).exists():
            raise UserError(f"{run_dir} already has rollouts or {CURRICULUM_FILE}: pass --resume to continue that run")
        self.progress = Progress(max_batches=self.max_batches, budget=recipe.trainer.max_gpu_hours,
                                 written=self.admission.written, gpu_hours=float(self.compute.figures()["gpu_hours"]))

    # ---- state ----------------------------------------------------------------------------------------------

    def _save_state(self, *, new_batch: bool) -> None:
        """Save the state (`state.save_state`; `new_batch`: before a new batch is written)."""
        admission = self.admission
        save_state(self.run_dir, SavedState(
            batch=admission.written - 1, next_group=admission.next_group, sampler=self.sampler.state_dict(),
            resampling=self.resampling.state_dict(), validated=sorted(self.validation.done),
            pending=admission.pending_keys(), wall_hours=self.compute.wall_hours(),
            missed=sorted(self.validation.missed)), new_batch=new_batch)

    def _restore(self) -> None:
        """Continue from the saved state after the stream's last batch, once the stream is rewound to the trainer's
        checkpoint (`state.rewind_to_checkpoint`)."""
        resumed_step = rewind_to_checkpoint(self.run_dir, log.warning)
        self.compute.wall_hours_before = logged_wall_hours(self.run_dir, "orchestrator")
        found = load_state(self.run_dir, self.stream.next_index() - 1)
        if found is None:
            return
        state, path = found
        self.resampling.load_state_dict(state.resampling, source=str(path))
        try:
            self.sampler.load_state_dict(state.sampler)
        except UserError as exc:
            raise UserError(f"{path}: {exc}") from None
        self.admission.restore(state.batch + 1, state.next_group, state.pending)
        self.validation.restore(state.validated, state.missed, up_to=resumed_step, last_batch=state.batch)
        self.compute.wall_hours_before = max(state.wall_hours, self.compute.wall_hours_before)
        log.info("resumed from %s: %d batches written, %d prompts to admit again", path.name, self.admission.written,
                 len(self.admission.requeued))

    # ---- generation -----------------------------------------------------------------------------------------

    async def _generate(self, problem: Problem, key: str, samples: int, *args) -> RolloutGroup:
        """One group (`GroupGenerator.generate`), training or validation; its end is progress."""
        group = await self.groups.generate(problem, key, samples, *args)
        self.progressed = time.monotonic()
        return group

    async def _run_group(self, index: int, problem: Problem, admitted_version: int) -> None:
        group = await self._generate(problem, f"g{index}", self.recipe.rollout.generations_per_prompt,
                                     admitted_version)
        group.index = index
        self.generated["tokens"] += group.completion_tokens()
        self.generated["samples"] += len(group.samples)
        async with self.changed:
            self.finished[index] = group
            self.changed.notify_all()

    def _spawn(self, coro) -> asyncio.Task:
        """Run `coro` as a task whose failure ends the run (`run` raises it)."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()
            self.failed.set()

    async def _admit(self) -> None:
        """Start groups for as long as admission control allows (forever)."""
        while True:
            async with self.changed:
                await self.changed.wait_for(lambda: self.admission.may_admit(self.version))
                index, problem = self.admission.admit()
                version = self.version
            self._spawn(self._run_group(index, problem, version))

    # ---- batches --------------------------------------------------------------------------------------------

    async def _write_batches(self) -> None:
        """Form and write batches from finished groups, oldest admitted first, until `max_batches` are written."""
        admission = self.admission
        while admission.written < self.max_batches and self.ended_early is None:
            async with self.changed:
                await self.changed.wait_for(lambda: len(self.finished) >= self.batch_size
                                            and self.validation.may_write(admission.written))
                chosen = [self.finished.pop(i) for i in sorted(self.finished)[:self.batch_size]]
            fresh, stale = admission.settle(chosen)
            self.progressed = time.monotonic()
            for group in fresh:
                self.resampling.record(group.problem.key, sum(group.correct), len(group.correct))
            batch, figures = build_train_batch(fresh, batch_index=admission.written, recipe=self.recipe) if fresh \
                else (None, {})
            if batch is None:  # every group filtered or stale: these prompts are used up, the batch index is not
                self._save_state(new_batch=False)
                log.info("batch %d: no sample reached the loss (%d groups, %d of them stale); drawing more",
                         admission.written, len(chosen), len(stale))
            else:
                admission.written += 1
                self._save_state(new_batch=True)
                self.stream.put(batch, {"groups": [g.index for g in fresh], "prompts": [g.problem.key for g in fresh],
                                        "domains": [g.problem.domain for g in fresh]}, index=admission.written - 1)
                figures["rollout/stale_groups_regenerated"] = float(len(stale))
                self._log_batch(figures)
            async with self.changed:
                self.changed.notify_all()

    def _log_batch(self, figures: dict[str, float]) -> None:
        seconds = max(time.monotonic() - self.compute.started, 1e-9)
        figures.update({
            "rollout/generator_idle_fraction": self.window["idle"] / max(self.window["polls"], 1),
            "rollout/tokens_per_s": self.generated["tokens"] / seconds,  # since this process started
            "rollout/samples_per_s": self.generated["samples"] / seconds,
            "rollout/policy_version": float(self.version or 0),
            "curriculum/retired_prompts": float(len(self.resampling.retired)),
            "curriculum/epoch": float(self.sampler.epoch),
            **self.compute.figures(),
        })
        self.window = {"idle": 0, "polls": 0}
        written = self.admission.written
        self.metrics.log(written, figures)
        time_words = self.progress.words(written=written, gpu_hours=figures["gpu_hours"],
                                         wall_hours=figures["wall_hours"])
        print(f"batch {written}/{self.max_batches} | reward {figures['rollout/reward_mean']:+.3f} | "
              f"pass {figures['rollout/pass_rate']:.3f} | filtered {figures['rollout/filtered_groups']:.0f} | "
              f"staleness {figures['staleness/max']:.0f} | generator idle "
              f"{100 * figures['rollout/generator_idle_fraction']:.0f}% | {figures['rollout/tokens_per_s']:.0f} tok/s"
              f" | {time_words}"
              + (f" | {self.live.words}" if self.live.words else "")
              + (f" | {self.sandbox_warning}" if self.sandbox_warning else ""), flush=True)
        budget = self.recipe.trainer.max_gpu_hours
        if budget is not None and figures["gpu_hours"] >= budget:
            self._end_early("max_gpu_hours", f"the run's compute reached {figures['gpu_hours']:.4g} GPU-h "
                                             f"(trainer.max_gpu_hours {budget:g})")

    # ---- policy version, validation, idle time ----------------------------------------------------------------

    async def _watch_versions(self) -> None:
        """Poll the generators' policy version (more often while a batch is held back for a validation)."""
        while True:
            versions = [v for v in await asyncio.gather(*(self.fleet.weight_version(s.url)
                                                          for s in self.fleet.servers.values() if s.up))
                        if v != NO_VERSION]
            latest = max(versions, default=None)
            if latest is not None and latest != self.version:
                await self._set_version(latest)
            for _ in range(round(VERSION_POLL_S / HOLD_POLL_S)):
                await asyncio.sleep(HOLD_POLL_S)
                if not self.validation.may_write(self.admission.written):
                    break  # a batch is held back until a version the trainer may have pushed by now is seen

    def _validate(self, version: int) -> None:
        """The generators serve `version`: start its validation if its interval's is due, and record the scheduled
        validations whose intervals passed unseen as missed (validation.py)."""
        start, missed = self.validation.due(version)
        for scheduled in missed:
            self.validation.record_missed(scheduled, version)
        if start:
            self.validation.started[version] = self._spawn(self.validation.run(version, self._generate))

    async def _count_idle(self) -> None:
        while True:
            for stats in self.fleet.stats().values():
                if stats["up"]:
                    self.window["polls"] += 1
                    self.window["idle"] += stats["outstanding_tokens"] == 0
            await asyncio.sleep(IDLE_SAMPLE_S)

    async def _wait_for_current_weights(self, url: str, timeout_s: float | None = None) -> None:
        """A generator that comes back must serve the current policy (the trainer re-syncs it) before it gets work,
        within `timeout_s` (default: the deadline; past it the fleet tries again later).

        The trainer sends it its own current step, which may be newer than the last version this process saw (the
        trainer kept stepping while every generator was down, and `_watch_versions` polls only servers that are up):
        any trained version at least as new as the one last seen will do, and a newer one becomes the current."""
        timeout_s = self.deadline.seconds() if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            version = await self.fleet.weight_version(url)
            if version != NO_VERSION and (self.version is None or version >= self.version):
                break
            if time.monotonic() > deadline:
                raise FleetError(f"{url} did not get policy version {self.version} or newer within {timeout_s:g} s "
                                 f"(it serves {version if version != NO_VERSION else 'its start-up weights'})")
            await asyncio.sleep(VERSION_POLL_S)
        if self.version is None or version > self.version:
            await self._set_version(version)

    async def _set_version(self, version: int) -> None:
        """The generators' policy version is now `version`: start the validation it calls for, wake admission
        control, a held-back batch and the final validation."""
        async with self.changed:
            self.version = version
            self.deadline.mark()
            self.progressed = time.monotonic()
            self._set_request_timeout()
            self._validate(version)
            self.changed.notify_all()

    def _set_request_timeout(self) -> None:
        """A sample may take (staleness bound + 1) deadlines: one that old is stale anyway."""
        self.fleet.request_timeout_s = (self.admission.bound + 1) * self.deadline.seconds()

    def _waiting_on(self) -> str:
        """What the run waits on now, for the progress watch's error."""
        admission, validation = self.admission, self.validation
        served = (f"the generators serve policy {self.version}" if self.version is not None
                  else "no generator serves the trainer's weights yet")
        if admission.written >= self.max_batches:
            running = sorted(v for v, task in validation.started.items() if not task.done())
            if running:
                return f"waiting on the validation of policy {running[-1]}: its samples on the generators"
            return f"waiting on the trainer's final weights (policy {self.max_batches}): {served}"
        if not validation.may_write(admission.written):
            return f"batch {admission.written} is held back until a validation starts: {served}"
        generating = len(admission.pending) - len(self.finished)
        if generating <= 0 and not admission.may_admit(self.version):
            needed = admission.next_batch_index() - admission.bound
            return f"waiting on the trainer's weights (policy {needed} or later, to admit more prompts): {served}"
        return (f"waiting on the generators: {max(generating, 0)} groups generating, {len(self.finished)} of "
                f"{self.batch_size} finished for batch {admission.written}; {served}")

    async def _watch_progress(self) -> None:
        """Move the heartbeat every PROGRESS_POLL_S; TimeoutError (the run fails) once generation has not moved for
        the deadline while a generator is up (the module docstring)."""
        heartbeat = self.run_dir / HEARTBEAT_FILE
        while True:
            beat(heartbeat)
            await asyncio.sleep(PROGRESS_POLL_S)
            if not any(server.up for server in self.fleet.servers.values()):
                self.progressed = time.monotonic()  # the fleet's wait for a server (`max_wait_s`) bounds this one
            elif time.monotonic() - self.progressed > self.deadline.seconds():
                raise TimeoutError(f"{self._waiting_on()}; nothing moved for {self.deadline.words()}")

    # ---- run ------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        async with self.fleet:
            loops = [self._spawn(coro) for coro in (self._watch_versions(), self._admit(), self._count_idle(),
                                                    self._log_forecasts(), self._watch_progress())]
            try:
                writer = self._spawn(self._write_batches())
                failed, end_now = asyncio.create_task(self.failed.wait()), asyncio.create_task(self.end_now.wait())
                await asyncio.wait([writer, failed, end_now], return_when=asyncio.FIRST_COMPLETED)
                for waiting in (failed, end_now, writer):
                    waiting.cancel()  # the writer too after an early end (it writes each batch whole, no await inside)
                if self.failure is not None:
                    raise self.failure
                if self.ended_early is None:
                    await self._unless_failed(self._final_validation())
                    await self.live.drain(FORECAST_DRAIN_S)
                self._finish()
            finally:
                for task in [*loops, *self.tasks]:
                    task.cancel()
                await asyncio.gather(*loops, *self.tasks, return_exceptions=True)

    async def _unless_failed(self, coro) -> None:
        """Await `coro`, unless a task of the run fails first (the progress watch's deadline): that is raised."""
        task, failed = asyncio.ensure_future(coro), asyncio.create_task(self.failed.wait())
        try:
            await asyncio.wait([task, failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not task.done():
                task.cancel()
        if self.failure is not None:
            raise self.failure
        task.result()

    async def _final_validation(self) -> None:
        """After the last batch: the validation of the trained policy, once the trainer has sent it."""
        validation, last = self.validation, self.max_batches
        if not validation.problems:
            return
        log.info("all %d batches written; waiting for the trainer's final weights to validate them",
                 self.admission.written)
        async with self.changed:
            await self.changed.wait_for(lambda: validation.schedule.owner(last) in validation.settled())
        if validation.started:  # the last one, and any still running
            await asyncio.wait(list(validation.started.values()))
        if self.failure is not None:
            raise self.failure
        self._save_state(new_batch=False)

    def _finish(self) -> None:
        """The run has ended on its own: `RUN/finished.json`, and after an early end the reason in the log and the
        metrics and the trainer asked to stop (it checkpoints its current step and exits 0)."""
        reason, words = self.ended_early or ("max_steps", f"all {self.max_batches} batches written and validated")
        compute = self.compute.figures()
        written = self.admission.written
        # for a resume that extends the run: the validations since the last batch, and the compute up to here (saved
        # after `compute` was taken, so the extended run's GPU-hours go on from at least what finished.json says)
        self._save_state(new_batch=False)
        if self.ended_early is not None:
            self.metrics.log(written, {"run/stopped_early": 1.0, "run/stop_reason": f"{reason}: {words}", **compute})
            request_stop(self.run_dir)
        log.info("the run has ended (%s): %s", reason, words)
        print(f"run ended ({reason}): {words}", flush=True)
        write_finished(self.run_dir, reason, written, compute["gpu_hours"])

    async def _log_forecasts(self) -> None:
        """The live forecast's figures, logged at the policy version of the validation they follow, with the run's
        compute at that validation (the forecast is of the curve up to there)."""
        async for version, result in self.live.results():
            self.metrics.log(version, {**result.figures, "forecast/fit_cpu_s": result.cpu_s,
                                       **(self.validation.compute_at.pop(version, None) or self.compute.figures())})
            if result.stop_reason is not None:
                self._end_early("stop_at_fraction", result.stop_reason)

    def _end_early(self, reason: str, words: str) -> None:
        """End the run before `max_batches` (`reason`: a run_dir.FINISH_REASONS; `words`: why, for the log and
        metrics): `run` stops writing batches and asks the trainer to stop (it checkpoints its current step)."""
        if self.ended_early is None and self.admission.written < self.max_batches:  # else it ends on max_steps anyway
            self.ended_early = (reason, words)
            self.end_now.set()

    def close(self) -> None:
        self.live.close()
        self.grader.close()
        self.metrics.close()


def _stop_now(state_path: Path):
    """SIGTERM / Ctrl-C: the state on disk is always that of the last batch written (it is saved before each batch),
    so the orchestrator leaves at once; in-flight samples are dropped (their prompts are in the saved state's
    `pending`, admitted again on resume), the grader's workers exit when their pipe closes and the live forecast's
    fitting process is killed by the kernel as its parent leaves (`live_forecast`, PR_SET_PDEATHSIG)."""

    def handler(*_: object) -> None:
        log.info("stopped; the state of the last batch written is in %s", state_path)
        logging.shutdown()
        os._exit(0)

    return handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_scalerl.orchestrator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: RUN/model)")
    parser.add_argument("--resume", action="store_true", help="continue the run's stream and curriculum")
    parser.add_argument("--max-batches", type=int, help="stop after this many batches (default: trainer.max_steps)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s")
    from transformers import AutoTokenizer  # deferred: a heavy import, not needed for --help

    orchestrator = None
    try:
        recipe = load_run_recipe(args.run_dir, RECIPE_FILE)
        generators = read_generators(args.run_dir)
        if generators is None:
            raise UserError(f"{args.run_dir}: no generators.json: the orchestrator needs the run's generators")
        tokenizer_dir = args.tokenizer or args.run_dir / "model"
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        except (OSError, ValueError) as exc:
            raise UserError(f"--tokenizer {tokenizer_dir}: no usable tokenizer: {exc}") from None
        orchestrator = Orchestrator(args.run_dir, recipe, tokenizer, generators[0], api_key=os.environ.get(API_KEY_ENV),
                                    resume=args.resume, max_batches=args.max_batches)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stop_now(args.run_dir / CURRICULUM_FILE))
        asyncio.run(orchestrator.run())
    except (UserError, FleetError, TimeoutError) as exc:
        log.error("%s", exc)
        return 2 if isinstance(exc, UserError) else 1
    finally:
        if orchestrator is not None:
            orchestrator.close()
    return 0
