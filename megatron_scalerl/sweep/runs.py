"""One sweep's runs on disk: where each lives, whether it is done, and getting it ready to (re)start.

    SWEEP/sweep.json                    the manifest (sweep/manifest.py)
    SWEEP/VARIANT/seedI/                the run directory (what `scalerl train` makes)
    SWEEP/VARIANT/seedI.recipe.yaml     the run's resolved recipe, written by the sweep for its first start
    SWEEP/VARIANT/seedI.console.log     a local run's console output (`scalerl train`), appended across starts
    SWEEP/VARIANT/seedI.slurm-JOB.out   a SLURM run's job output, one file per job
    SWEEP/report/                       the ablation report (sweep/report.py)

A run whose first start was stopped while its directory was being prepared (no role ran yet) starts anew.
A run is done (`not_done`, the one definition the launchers and the report share) when its orchestrator recorded
that it ended on its own (`RUN/finished.json`, `run_dir.read_finished`), that end still covers what the sweep asks
(`covers`: a `max_steps` end at or past the sweep's `--steps`, a `max_gpu_hours` end at or past its `--budget`; any
other reason, `stop_at_fraction`, is final), and the manifest does not record its last launch as failed (a non-zero
exit code: the orchestrator writes finished.json before the trainer has stopped, so a launch that failed after it
may have lost the trainer's last steps). A run that is not done and has a `RUN/recipe.yaml` was started: it continues
with `--resume`. Before that, its recipe.yaml gets the sweep's current `trainer.max_steps` /
`trainer.max_gpu_hours` (rewritten atomically), which is how a sweep extends finished runs; the orchestrator removes
finished.json when it resumes (a resumed run that had finished validates nothing new and ends again).

Every process of a local run carries `SWEEP_RUN_ENV=<its absolute run directory>/` in its environment (its launcher
gets it from the sweep, its roles inherit it): how a stop finds what is left of a run, and how a later sweep finds a
run still running.
"""

from __future__ import annotations

import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_text
from megatron_scalerl.launch.supervise import processes_with_environment
from megatron_scalerl.recipe import Recipe, load_run_recipe, validate
from megatron_scalerl.run.directory import GENERATORS_FILE, RECIPE_FILE, read_finished
from megatron_scalerl.sweep.manifest import manifest_path, save_manifest

# What a launch writes once the run directory is prepared (generators.json) and what its roles write: a run that has
# none of them was stopped while `scalerl train` (or the SLURM job) was still preparing it, and starts anew.
LAUNCHED = (GENERATORS_FILE, "metrics.jsonl", "checkpoints", "rollouts")
SWEEP_RUN_ENV = "SCALERL_SWEEP_RUN"  # in the environment of every process of a local run (module docstring)


@dataclass(frozen=True)
class SweepRun:
    """One (variant, seed) run of a sweep: its manifest key, directory and files, and its planned recipe."""

    key: str
    run_dir: Path
    recipe: Recipe  # what a new run starts with (a started run keeps its own RUN/recipe.yaml)

    @property
    def recipe_file(self) -> Path:
        return self.run_dir.with_name(self.run_dir.name + ".recipe.yaml")

    @property
    def console(self) -> Path:
        return self.run_dir.with_name(self.run_dir.name + ".console.log")

    @property
    def started(self) -> bool:
        return (self.run_dir / RECIPE_FILE).is_file()

    @property
    def gpus(self) -> int:
        """GPUs the run takes: trainer GPUs + generator GPUs (its cluster section)."""
        return self.recipe.cluster.total_gpus

    @property
    def servers(self) -> int:
        """Generator servers the run starts (`Recipe.generator_servers`)."""
        return self.recipe.generator_servers

    @property
    def processes(self) -> int:
        """The run's busy processes, as `scalerl train` counts them on CPU: trainer ranks + generator servers."""
        return self.recipe.cluster.trainer_gpus + self.servers

    @property
    def marker(self) -> str:
        """The value of SWEEP_RUN_ENV for this run: its absolute directory with a trailing slash, so that one run's
        marker is never the start of another's (`seed1/` is no prefix of `seed10/`; `processes_with_environment`
        matches prefixes)."""
        return f"{self.run_dir.resolve()}/"

    def live_processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process of this machine carrying the run's marker (module docstring)."""
        return processes_with_environment(f"{SWEEP_RUN_ENV}={self.marker}")


def covers(finished: dict, steps: int | None, budget: float | None) -> bool:
    """Whether a run's end (`finished`: its finished.json, {"reason", "step", "gpu_hours"}) covers `steps`
    (optimizer steps; None: the run's own trainer.max_steps) and `budget` (GPU-hours; None: no budget)."""
    if finished["reason"] == "max_steps" and steps is not None:
        return finished["step"] >= steps
    if finished["reason"] == "max_gpu_hours" and budget is not None:
        return finished["gpu_hours"] >= budget
    return True


def not_done(entry: dict[str, Any], finished: dict | None, steps: int | None, budget: float | None) -> str | None:
    """Why a run (`entry`: its manifest entry; `finished`: its finished.json or None) is not done for a sweep of
    `steps` and `budget` (module docstring), or None when it is done."""
    if finished is None:
        return "not finished"
    if not covers(finished, steps, budget):
        return "not extended yet"
    if entry.get("exit_code") not in (None, 0):
        return f"its last launch failed (exit {entry['exit_code']}) after it finished"
    return None


class Sweep:
    """A sweep directory and its manifest, which this process alone writes (it holds the manifest's SweepLock)."""

    def __init__(self, sweep_dir: Path, manifest: dict[str, Any], runs: dict[str, SweepRun]):
        self.dir, self.manifest, self.runs = sweep_dir, manifest, runs

    @property
    def steps(self) -> int | None:
        return self.manifest.get("steps")

    @property
    def budget(self) -> float | None:
        return self.manifest.get("budget")

    def save(self) -> None:
        save_manifest(self.dir, self.manifest)

    def update(self, key: str, **fields: Any) -> None:
        """Record what the sweep saw of run `key` (state, pid, job id, exit code) in the manifest."""
        self.manifest["runs"][key].update(fields)
        self.save()

    def done(self, key: str) -> bool:
        """Whether run `key` is done (`not_done`); records its finished.json in the manifest when it is."""
        entry = self.manifest["runs"][key]
        finished = read_finished(self.runs[key].run_dir)
        if not_done(entry, finished, self.steps, self.budget) is not None:
            return False
        if (entry.get("finished"), entry["state"]) != (finished, "done"):
            self.update(key, state="done", finished=finished)
        return True

    def prepare(self, key: str) -> str | None:
        """Get run `key` ready to start, checking first that it is not done meanwhile: "start" (a new run: its recipe
        file written), "resume" (started before: its recipe.yaml brought to the sweep's steps and budget; launched
        with `--resume`), or None (done: nothing to start)."""
        if self.done(key):
            return None
        run = self.runs[key]
        if run.started and not any((run.run_dir / name).exists() for name in LAUNCHED):
            print(f"sweep: {key}: its first start was cut short before any role ran; starting it anew", flush=True)
            shutil.rmtree(run.run_dir)
        if not run.started:
            if run.run_dir.exists() and any(run.run_dir.iterdir()):
                raise UserError(f"{run.run_dir} holds files but no {RECIPE_FILE}: not a run the sweep started; move it "
                                "away and run the sweep again")
            atomic_write_text(run.recipe_file, run.recipe.to_yaml())
            return "start"
        self._extend(run)
        return "resume"

    def _extend(self, run: SweepRun) -> None:
        path = run.run_dir / RECIPE_FILE
        old = load_run_recipe(run.run_dir, RECIPE_FILE)  # a damaged file: an error naming it and the field
        wanted = {**({"max_steps": self.steps} if self.steps is not None else {}),
                  **({"max_gpu_hours": self.budget} if self.budget is not None else {})}
        if all(getattr(old.trainer, k) == v for k, v in wanted.items()):
            return
        data = old.to_dict()
        data["trainer"].update(wanted)
        recipe = validate(data, source=str(path))
        atomic_write_text(path, recipe.to_yaml())
        print(f"sweep: {run.key}: {path} now has " + ", ".join(f"trainer.{k}={v:g}" for k, v in wanted.items()),
              flush=True)
        if recipe.trainer.lr_schedule.type == "cosine" and recipe.trainer.max_steps != old.trainer.max_steps:
            print(f"sweep: note: {run.key} decays its LR on a cosine to trainer.max_steps; moved from "
                  f"{old.trainer.max_steps} to {recipe.trainer.max_steps}, the rate of its steps still to come rises "
                  f"again: it is not the run a {recipe.trainer.max_steps}-step sweep would have made", flush=True)


def launcher_alive(pid: int | None, run_dir: Path) -> bool:
    """Whether `pid` is a live `scalerl train` of `run_dir` (left by an earlier sweep process that was killed)."""
    if not pid:
        return False
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(run_dir).encode() in command and b"train" in command


def refuse_live_launchers(sweep: Sweep) -> None:
    """A run whose earlier launcher, or any process of it (its marker, module docstring), still runs on this
    machine must not get a second launcher on the same directory."""
    for key, entry in sweep.manifest["runs"].items():
        run = sweep.runs[key]
        if launcher_alive(entry.get("pid"), run.run_dir):
            raise UserError(f"run {key} is still running (scalerl train, pid {entry['pid']}), left by an earlier sweep "
                            f"process: wait for it, or stop it (kill -{signal.SIGTERM.value} {entry['pid']}: it "
                            f"checkpoints), then run the sweep again ({manifest_path(sweep.dir)})")
        left = run.live_processes()
        if left:
            pids = " ".join(str(pid) for pid, _ in left)
            raise UserError(f"run {key} still has {len(left)} process(es) on this machine ({SWEEP_RUN_ENV}="
                            f"{run.marker} in their environment; pid {pids}: "
                            f"{left[0][1][:100]}), left by an earlier sweep process: wait for them to end, or stop "
                            f"them (kill {pids}), then run the sweep again ({manifest_path(sweep.dir)})")


def outcome(stop: list[int], failed: list[str], *, stopped: str, to_continue: str, failed_as: str,
            detail: Callable[[str], str], going_on: str = "") -> int:
    """A launcher's last words and exit code: 128 + the signal when a stop signal came (`stop`), 1 when runs
    `failed` (each named with `detail(key)`), else 0."""
    if stop:
        print(f"sweep: {stopped} ({signal.Signals(stop[0]).name}){going_on}; run the same `scalerl sweep` again to "
              f"{to_continue}", flush=True)
        return 128 + stop[0]
    if failed:
        print(f"sweep: {len(failed)} run(s) {failed_as}: " + "; ".join(f"{k} ({detail(k)})" for k in failed)
              + "; run the same `scalerl sweep` again to resume them", file=sys.stderr, flush=True)
        return 1
    return 0
