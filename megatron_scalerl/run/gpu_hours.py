"""GPU-hours of a run, the forecaster's compute axis (`gpu_hours` in metrics.jsonl).

Under SLURM with accounting, the figure is SLURM's own: `sacct` over every job of the run (`RUN/slurm_jobs.txt`, one
job id per line, appended by each job's batch step), requeued runs included, each allocation's elapsed seconds x its
allocated GPUs (`gres/gpu` in AllocTRES). Elsewhere (a local run, a cluster without accounting or without GPU
TRES), it is wall time x the recipe's GPUs, the wall time summed over the orchestrator's restarts.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import time
from pathlib import Path

from megatron_scalerl.fileio import atomic_write_text

JOBS_FILE = "slurm_jobs.txt"
SACCT_FIELDS = "JobID,ElapsedRaw,AllocTRES"
SACCT_TIMEOUT_S = 30.0
SACCT_REFRESH_S = 60.0  # seconds between sacct calls; the figure in between adds wall time x GPUs
_GPU_TRES = re.compile(r"(?:^|,)gres/gpu=(\d+)(?:,|$)")


def record_job(run_dir: Path, job_id: int) -> None:
    """Add `job_id` to the run's job list (once).

    The list is read, extended and written back whole by an atomic replace (`atomic_write_text`), under an exclusive
    `flock` of `.slurm_jobs.txt.lock` beside it: a reader sees the old list or the new one, never a torn line (an
    append cut short by a crash, or on a network filesystem, where O_APPEND is not atomic, could leave one), and two
    jobs recording at once both stay (the lock orders their read-modify-writes). The lock is a file of its own since
    the list's inode changes at each replace; the kernel releases it when the descriptor closes."""
    path = run_dir / JOBS_FILE
    fd = os.open(run_dir / f".{JOBS_FILE}.lock", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        known = run_jobs(run_dir)
        if str(job_id) not in known:
            atomic_write_text(path, "".join(f"{job}\n" for job in [*known, str(job_id)]))
    finally:
        os.close(fd)


def run_jobs(run_dir: Path) -> list[str]:
    path = run_dir / JOBS_FILE
    return path.read_text().split() if path.is_file() else []


def parse_sacct(text: str) -> float | None:
    """GPU-hours in `sacct -X -n -P --duplicates -o JobID,ElapsedRaw,AllocTRES` output (one row per allocation: each
    het component and each requeued run has its own); None when no row holds GPUs."""
    gpu_seconds, rows_with_gpus = 0.0, 0
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 3 or not fields[1].isdigit():
            continue
        match = _GPU_TRES.search(fields[2])
        if match:
            rows_with_gpus += 1
            gpu_seconds += int(fields[1]) * int(match.group(1))
    return gpu_seconds / 3600.0 if rows_with_gpus else None


def sacct_gpu_hours(job_ids: list[str]) -> float | None:
    """GPU-hours of these jobs from sacct; None when sacct is missing, fails (accounting disabled) or counts no GPU."""
    if not job_ids:
        return None
    try:
        done = subprocess.run(["sacct", "-X", "-n", "-P", "--duplicates", "-o", SACCT_FIELDS, "-j", ",".join(job_ids)],
                              capture_output=True, text=True, timeout=SACCT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_sacct(done.stdout) if done.returncode == 0 else None


class ComputeMeter:
    """The run's compute so far: `figures()` -> wall_hours (over restarts), gpus, gpu_hours, gpu_hours_source
    ("sacct" or "wall")."""

    def __init__(self, run_dir: Path, gpus: int, wall_hours_before: float = 0.0):
        self.run_dir, self.gpus, self.wall_hours_before = run_dir, gpus, wall_hours_before
        self.started = time.monotonic()
        self.sacct: tuple[float, float] | None = None  # (monotonic time of the call, GPU-hours then)
        self.sacct_works = bool(run_jobs(run_dir))

    def wall_hours(self) -> float:
        return self.wall_hours_before + (time.monotonic() - self.started) / 3600.0

    def figures(self) -> dict[str, float | str]:
        hours = self.wall_hours()
        gpu_hours, source = hours * self.gpus, "wall"
        now = time.monotonic()
        if self.sacct_works and (self.sacct is None or now - self.sacct[0] > SACCT_REFRESH_S):
            measured = sacct_gpu_hours(run_jobs(self.run_dir))
            self.sacct_works = measured is not None
            self.sacct = (now, measured) if measured is not None else None
        if self.sacct is not None:
            gpu_hours, source = self.sacct[1] + (now - self.sacct[0]) / 3600.0 * self.gpus, "sacct"
        return {"wall_hours": hours, "gpus": self.gpus, "gpu_hours": gpu_hours, "gpu_hours_source": source}
