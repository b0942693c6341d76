"""One sweep's runs on disk: where each lives, whether it is done, and getting it ready to (re)start.

    SWEEP/sweep.json                    the manifest (sweep/manifest.py)
    SWEEP/VARIANT/seedI/                the run directory (what `scalerl train` makes)
    SWEEP/VARIANT/seedI.recipe.yaml     the run's resolved recipe, written by the sweep for its first start
    SWEEP/VARIANT/seedI.console.log     a local run's console output (`scalerl train`), appended across starts
    SWEEP/VARIANT/seedI.slurm-JOB.out   a SLURM run's job output, one file per job
    SWEEP/report/                       the ablation report (sweep/report.py)

A run whose first start was stopped while its directory was being prepared (no role ran yet) starts anew.
A run is done when its orchestrator recorded that it ended on its own (`RUN/finished.json`, `run_dir.read_finished`)
and that end still covers what the sweep asks: a `max_steps` end at or past the sweep's `--steps`, a
`max_gpu_hours` end at or past its `--budget`; any other reason (`stop_at_fraction`) is final. A run that is not done
and has a `RUN/recipe.yaml` was started: it continues with `--resume`. Before that, its recipe.yaml gets the sweep's
current `trainer.max_steps` / `trainer.max_gpu_hours` (rewritten atomically), which is how a sweep extends finished
runs; the orchestrator removes finished.json when it resumes.
"""

from __future__ import annotations

import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_text, load_yaml
from megatron_scalerl.recipe import Recipe, validate
from megatron_scalerl.run_dir import GENERATORS_FILE, read_finished
from megatron_scalerl.sweep.manifest import manifest_path, save_manifest

RUN_RECIPE = "recipe.yaml"
# What a launch writes once the run directory is prepared (generators.json) and what its roles write: a run that has
# none of them was stopped while `scalerl train` (or the SLURM job) was still preparing it, and starts anew.
LAUNCHED = (GENERATORS_FILE, "metrics.jsonl", "checkpoints", "rollouts")


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
        return (self.run_dir / RUN_RECIPE).is_file()

    @property
    def processes(self) -> int:
        """Processes (GPUs) the run takes: trainer ranks + generator GPUs (on CPU a "GPU" is a process)."""
        return self.recipe.cluster.total_gpus


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
        """Whether run `key` ended on its own covering the sweep's steps and budget (module docstring); records
        its finished.json in the manifest when it is."""
        finished = read_finished(self.runs[key].run_dir)
        if finished is None:
            return False
        reason, covered = finished["reason"], True
        if reason == "max_steps" and self.steps is not None:
            covered = finished["step"] >= self.steps
        if reason == "max_gpu_hours" and self.budget is not None:
            covered = finished["gpu_hours"] >= self.budget
        entry = self.manifest["runs"][key]
        if covered and (entry.get("finished"), entry["state"]) != (finished, "done"):
            self.update(key, state="done", finished=finished)
        return covered

    def prepare(self, key: str) -> bool:
        """Get run `key` ready to start; True: it was started before and continues (`--resume`). A new run gets its
        recipe file; a started one its recipe.yaml brought to the sweep's steps and budget."""
        run = self.runs[key]
        if run.started and not any((run.run_dir / name).exists() for name in LAUNCHED):
            print(f"sweep: {key}: its first start was cut short before any role ran; starting it anew", flush=True)
            shutil.rmtree(run.run_dir)
        if not run.started:
            if run.run_dir.exists() and any(run.run_dir.iterdir()):
                raise UserError(f"{run.run_dir} holds files but no {RUN_RECIPE}: not a run the sweep started; move it "
                                "away and run the sweep again")
            atomic_write_text(run.recipe_file, run.recipe.to_yaml())
            return False
        self._extend(run)
        return True

    def _extend(self, run: SweepRun) -> None:
        path = run.run_dir / RUN_RECIPE
        data = load_yaml(path)
        trainer, old_steps = data["trainer"], data["trainer"]["max_steps"]
        wanted = {**({"max_steps": self.steps} if self.steps is not None else {}),
                  **({"max_gpu_hours": self.budget} if self.budget is not None else {})}
        if all(trainer.get(k) == v for k, v in wanted.items()):
            return
        trainer.update(wanted)
        recipe = validate(data, source=str(path))
        atomic_write_text(path, recipe.to_yaml())
        print(f"sweep: {run.key}: {path} now has " + ", ".join(f"trainer.{k}={v:g}" for k, v in wanted.items()),
              flush=True)
        if recipe.trainer.lr_schedule == "cosine" and recipe.trainer.max_steps != old_steps:
            print(f"sweep: note: {run.key} decays its LR on a cosine to trainer.max_steps; moved from {old_steps} to "
                  f"{recipe.trainer.max_steps}, the rate of its steps still to come rises again: it is not the run "
                  f"a {recipe.trainer.max_steps}-step sweep would have made", flush=True)


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
    """A run whose earlier launcher still runs must not get a second one on the same directory."""
    for key, entry in sweep.manifest["runs"].items():
        if launcher_alive(entry.get("pid"), sweep.runs[key].run_dir):
            raise UserError(f"run {key} is still running (scalerl train, pid {entry['pid']}), left by an earlier sweep "
                            f"process: wait for it, or stop it (kill -{signal.SIGTERM.value} {entry['pid']}: it "
                            f"checkpoints), then run the sweep again ({manifest_path(sweep.dir)})")

