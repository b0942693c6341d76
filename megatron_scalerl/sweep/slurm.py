"""A sweep's runs as SLURM jobs: one job per run, with the repository's own sbatch files.

Each run is submitted from the checkout that holds `slurm/` (as the README's walk does), with the job's sizes taken
from the run's recipe (its cluster section: trainer nodes : generator nodes, `gpus_per_node` GPUs each; its
partition and account when it names them, and its time limit, unless an SBATCH_* variable or an `#SBATCH` line of
the sbatch file chooses them: `launch.slurm.cluster_options`; each sbatch file's `#SBATCH` lines are read once per
sweep, `SbatchFiles`) and its settings exported:

    sbatch --parsable --job-name=sweep-<id>-<variant>-seedI --output=SWEEP/VARIANT/seedI.slurm-%j.out \
        [--partition=P --account=A] --time=L --nodes=T --gpus-per-node=G : [...] --time=L --nodes=N ... \
        --export=ALL,SCALERL_RUN_DIR=<run>,SCALERL_RECIPE=SWEEP/VARIANT/seedI.recipe.yaml,SCALERL_MODEL=,... \
        slurm/scalerl_moe.sbatch            # scalerl_dense.sbatch for a dense model

A job finds a started run's recipe.yaml and continues it; the time-limit requeue is the sbatch files' own. The sweep
first finds, by name, every job of its runs still queued or running (left by an earlier sweep process) and follows
it: it counts towards `--max-concurrent` at once and its run is never submitted twice. It then keeps at most
`--max-concurrent` of its jobs queued or running, polling `squeue` every `--poll` seconds; a job gone from the queue
(twice in a row: a requeued job may briefly be missing) has ended, and its run is done or failed. Whether a run is
done is checked again right before it is submitted (`Sweep.prepare`). A failed `squeue` is said and tried again on
the next poll; `SQUEUE_TRIES` failures in a row end the watching (the jobs go on). `sbatch` and `squeue` run in
sessions of their own, bounded by SLURM_TIMEOUT_S each, so that a Ctrl-C reaches only the sweep. Ctrl-C or SIGTERM
stops the watching only: the jobs go on, and `scalerl sweep` again follows them. A run's start (its job first seen
running) and end get a line with the sweep's progress (sweep/progress.py).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.launch.allocation import slurm_client
from megatron_scalerl.launch.slurm import cluster_options, sbatch_lines
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.sweep.progress import SweepProgress
from megatron_scalerl.sweep.runs import Sweep, SweepRun, outcome

CHECKOUT = Path(__file__).resolve().parents[2]  # the repository: slurm/*.sbatch and the venv the jobs run
SLURM_TIMEOUT_S = 60.0  # each sbatch / squeue call
GONE_POLLS = 2  # polls a job must be missing from squeue before it counts as ended
SQUEUE_TRIES = 3  # squeue polls that may fail in a row before the watching ends


def job_name(sweep_dir: Path, key: str) -> str:
    """The SLURM job name of run `key`: unique to the sweep directory (a hash of its absolute path)."""
    tag = hashlib.sha256(str(sweep_dir.resolve()).encode()).hexdigest()[:8]
    return f"sweep-{tag}-{key.replace('/', '-')}"


def _slurm(*command: str) -> str:
    return slurm_client(*command, timeout_s=SLURM_TIMEOUT_S, cwd=CHECKOUT)


def queued(names: list[str]) -> dict[str, tuple[int, str]]:
    """{job name: (job id, "running" or "queued")} of the jobs with these names still in the queue (pending,
    running, requeued, ...); a het-job is running when any of its components is."""
    if not names:
        return {}
    out = _slurm("squeue", "-h", "-o", "%i|%j|%T", f"--name={','.join(names)}")
    jobs: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        job, name, state = (part.strip() for part in line.split("|", 2))
        running = state == "RUNNING" or jobs.get(name, (0, ""))[1] == "running"
        jobs[name] = (int(job.split("+")[0].split("_")[0]), "running" if running else "queued")
    return jobs


class SbatchFiles:
    """The repository's sbatch files a sweep submits, each read once (on first use): its path and the options of
    its `#SBATCH` lines (`launch.slurm.sbatch_lines`)."""

    def __init__(self) -> None:
        self._options: dict[Path, list[str]] = {}

    def for_recipe(self, recipe: Recipe) -> tuple[Path, list[str]]:
        """(the sbatch file of `recipe`'s model, MoE or dense; its `#SBATCH` options)."""
        script = CHECKOUT / "slurm" / ("scalerl_moe.sbatch" if recipe.model.is_moe else "scalerl_dense.sbatch")
        if script not in self._options:
            if not script.is_file():
                raise UserError(f"{script}: not found; --slurm submits the repository's sbatch files: run the sweep "
                                "from the checkout's venv")
            self._options[script] = sbatch_lines(script)
        return script, self._options[script]


def sbatch_command(sweep: Sweep, run: SweepRun, files: SbatchFiles) -> list[str]:
    """The `sbatch` command line of run `run` (see the module docstring); `files`: the sweep's sbatch files."""
    cluster = run.recipe.cluster
    script, chosen = files.for_recipe(run.recipe)
    settings = {"SCALERL_RUN_DIR": str(run.run_dir.resolve()), "SCALERL_RECIPE": str(run.recipe_file.resolve()),
                "SCALERL_MODEL": "", "SCALERL_SET": "", "SCALERL_TOKENIZER": sweep.manifest.get("tokenizer") or "",
                "SCALERL_PYTHON": sys.executable}
    for name, value in settings.items():
        if "," in value:
            raise UserError(f"{name}={value}: sbatch --export cannot carry a comma; choose paths without one")
    where = cluster_options(cluster, chosen, os.environ)  # per het component: sbatch propagates not all of them
    sizes = [*where, f"--nodes={cluster.trainer_nodes}", f"--gpus-per-node={cluster.gpus_per_node}", ":",
             *where, f"--nodes={cluster.generator_nodes}", f"--gpus-per-node={cluster.gpus_per_node}"]
    output = run.run_dir.with_name(f"{run.run_dir.name}.slurm-%j.out").resolve()
    return ["sbatch", "--parsable", f"--job-name={job_name(sweep.dir, run.key)}", f"--output={output}", *sizes,
            "--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in settings.items())]), str(script)]


def run_slurm(sweep: Sweep, keys: list[str], max_concurrent: int | None, poll_s: float) -> int:
    """Submit and follow the sweep's runs `keys` (in order; done ones skipped) with `squeue` polls every `poll_s`
    seconds; 0 when every one is done, 1 when some failed, 128 + a stop signal when the watching was stopped (the
    jobs go on)."""
    names = {key: job_name(sweep.dir, key) for key in keys}
    active: dict[str, int] = {}  # run key -> polls it was missing from the queue
    failed: list[str] = []
    stop: list[int] = []
    files, progress = SbatchFiles(), SweepProgress(keys, sweep.manifest["runs"], max_concurrent)
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        jobs = _poll(list(names.values()), poll_s, stop) or {}
        for key in keys:  # every job of the sweep an earlier sweep process left in the queue
            if names[key] in jobs:
                job, state = jobs[names[key]]
                active[key] = 0
                sweep.update(key, state=state, slurm_job=job)
                print(f"sweep: {key}: following job {job} ({state})", flush=True)
        todo = [key for key in keys if key not in active and not sweep.done(key)]
        while (todo or active) and not stop:
            jobs = _poll([names[k] for k in active], poll_s, stop)
            if jobs is None:
                break
            for key in list(active):
                active[key] = 0 if names[key] in jobs else active[key] + 1
                if names[key] in jobs and sweep.manifest["runs"][key]["state"] != jobs[names[key]][1]:
                    sweep.update(key, state=jobs[names[key]][1])
                    if jobs[names[key]][1] == "running" and key not in progress.running:  # not again after a requeue
                        print(progress.start(key), flush=True)
                if active[key] >= GONE_POLLS:
                    del active[key]
                    if not _ended(sweep, key):
                        failed.append(key)
                    print(progress.end(key, f"job {sweep.manifest['runs'][key]['slurm_job']}"), flush=True)
            while todo and (max_concurrent is None or len(active) < max_concurrent) and not stop:
                key = todo.pop(0)
                if _submit(sweep, sweep.runs[key], files):
                    active[key] = 0
            _sleep(poll_s if active else 0, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return outcome(stop, failed, stopped="stopped watching", going_on=f"; {len(active)} job(s) go on",
                   to_continue="follow them", failed_as="ended without finishing",
                   detail=lambda k: f"job {sweep.manifest['runs'][k]['slurm_job']}")


def _poll(names: list[str], poll_s: float, stop: list[int]) -> dict[str, tuple[int, str]] | None:
    """`queued(names)`, tried again `poll_s` seconds after a failure, up to SQUEUE_TRIES times in a row (then the
    last failure's UserError); None when a stop signal came meanwhile."""
    failures = 0
    while True:
        try:
            return queued(names)
        except UserError as exc:
            failures += 1
            if failures == SQUEUE_TRIES:
                raise UserError(f"{exc} ({SQUEUE_TRIES} squeue polls in a row failed; the sweep's jobs go on: run the "
                                "same `scalerl sweep` again to follow them)") from None
            print(f"sweep: {exc}; trying again in {poll_s:g} s ({failures} of {SQUEUE_TRIES} in a row)",
                  file=sys.stderr, flush=True)
        _sleep(poll_s, stop)
        if stop:
            return None


def _sleep(seconds: float, stop: list[int]) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop:
        time.sleep(min(1.0, deadline - time.monotonic()))


def _submit(sweep: Sweep, run: SweepRun, files: SbatchFiles) -> bool:
    """Submit run `run` (`Sweep.prepare` first); False when it turned out to be done (nothing submitted)."""
    mode = sweep.prepare(run.key)
    if mode is None:
        print(f"sweep: {run.key}: done ({sweep.manifest['runs'][run.key]['finished']}); not submitted", flush=True)
        return False
    run.run_dir.parent.mkdir(parents=True, exist_ok=True)
    job = int(_slurm(*sbatch_command(sweep, run, files)).strip().split(";")[0])
    sweep.update(run.key, state="queued", slurm_job=job, exit_code=None)
    print(f"sweep: {run.key}: {'resubmitted' if mode == 'resume' else 'submitted'} as job {job} (output "
          f"{run.run_dir.with_name(f'{run.run_dir.name}.slurm-{job}.out')})", flush=True)
    return True


def _ended(sweep: Sweep, key: str) -> bool:
    """Record the end of run `key`'s job; True when the run is done."""
    job = sweep.manifest["runs"][key]["slurm_job"]
    if sweep.done(key):
        print(f"sweep: {key}: done (job {job}: {sweep.manifest['runs'][key]['finished']})", flush=True)
        return True
    sweep.update(key, state="failed")
    output = sweep.runs[key].run_dir.with_name(f"{sweep.runs[key].run_dir.name}.slurm-{job}.out")
    tail = "\n".join(output.read_text(errors="replace").splitlines()[-15:]) if output.is_file() else "(no output)"
    print(f"sweep: {key}: job {job} ended without finishing the run; {output}:\n{tail}", file=sys.stderr, flush=True)
    return False
