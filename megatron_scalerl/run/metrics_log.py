"""Run metrics: one JSON object per line in `RUN/metrics.jsonl`, mirrored to wandb (offline by default).

Each record has `step` (optimizer steps), `time` (unix seconds) and `role` (trainer, orchestrator, eval, ...) plus
its figures under slash-separated names (`train/loss`, `val/pass_rate`, `gpu_hours`). Several processes may append
to the same file: each record is one `write`, under an exclusive `flock` of the file, on a file opened with
O_APPEND, so lines never interleave. The forecaster reads this file (compute column `gpu_hours`, metric column e.g.
`val/pass_rate`).

One record per step: when a run resumes from a checkpoint, the records of the work it lost (`set_aside`, called by
`orchestrator.state.rewind_to_checkpoint`) move to `RUN/metrics.rewound.jsonl`, appended there with a
`rewound` note, never deleted. The move rewrites metrics.jsonl under the same lock; a writer that was waiting for it
finds the file replaced and appends to the new one, so no record is lost.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_scalerl.fileio import atomic_write_text, json_safe

METRICS_FILE = "metrics.jsonl"
REWOUND_FILE = "metrics.rewound.jsonl"  # records of lost work (`set_aside`)


class MetricsLog:
    """`role`'s records of the run in `run_dir`, mirrored to wandb unless `wandb_mode` is "disabled". One wandb run
    per run directory and role over every launch (its id in `RUN/logs/wandb_<role>.id`, resumed with "allow"); a
    process that resumed from checkpoint step N (`resumed_from`) marks it there as `run/resumed_from_step` at step N
    (wandb's own rewind does not suit our step axis, and metrics.jsonl holds the clean history)."""

    def __init__(self, run_dir: str | Path, role: str, *, wandb_mode: str = "disabled",
                 wandb_project: str | None = None, run_name: str | None = None, config: dict | None = None,
                 resumed_from: int | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.role = role
        self._wandb = None
        if wandb_mode != "disabled":
            import wandb  # heavy: only when asked for

            wandb_dir = Path(run_dir) / "logs"
            wandb_dir.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(project=wandb_project, name=f"{run_name or Path(run_dir).name}-{role}",
                                     id=_wandb_run_id(wandb_dir / f"wandb_{role}.id"), resume="allow",
                                     dir=str(wandb_dir), mode=wandb_mode, config=config, reinit="create_new")
            # Every figure is plotted against our `step`, not wandb's own counter: a role's records may come out of
            # step order (the orchestrator logs a validation at policy version v after batches up to v + k), and
            # wandb drops a row whose own step goes backwards.
            self._wandb.define_metric("step", hidden=True)
            self._wandb.define_metric("*", step_metric="step")
            if resumed_from is not None:
                self._wandb.log({"step": int(resumed_from), "run/resumed_from_step": float(resumed_from)})

    def log(self, step: int, figures: dict[str, Any]) -> dict[str, Any]:
        record = {"step": int(step), "time": time.time(), "role": self.role,
                  **json_safe(figures)}
        _append(self.path, (json.dumps(record) + "\n").encode())
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, int | float)})
            for key, value in figures.items():  # a text figure (e.g. forecast/status): the run's summary holds it
                if isinstance(value, str):
                    self._wandb.summary[key] = value
        return record

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _wandb_run_id(path: Path) -> str:
    """The wandb run id kept in `path`: made (random) by the first process that asks, then read. Linked into place
    whole, so a reader never sees it half-written."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(secrets.token_hex(8))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process was first: its id holds
        finally:
            tmp.unlink()
    return path.read_text().strip()


def _append(path: Path, line: bytes) -> None:
    """One `write` of `line` at the end of `path`, under its lock; again on the new file when `set_aside` replaced
    it while we waited for the lock."""
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                os.write(fd, line)
                return
        finally:
            os.close(fd)  # the lock goes with it


def read_metrics(run_dir: str | Path, role: str | None = None, *, rewound: bool = False) -> list[dict[str, Any]]:
    """All records (optionally of one role), in file order; with `rewound`, those set aside as lost work after them
    (for what was spent all the same: the run's wall-clock hours)."""
    records = []
    for name in (METRICS_FILE, REWOUND_FILE) if rewound else (METRICS_FILE,):
        path = Path(run_dir) / name
        if path.exists():
            records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if role is None or r.get("role") == role]


def logged_wall_hours(run_dir: str | Path, role: str) -> float:
    """The most wall-clock hours `role`'s records hold, those set aside as lost work included (it was paid for all
    the same); 0 before its first record."""
    return max((float(r.get("wall_hours") or 0.0) for r in read_metrics(run_dir, role, rewound=True)), default=0.0)


def set_aside(run_dir: str | Path, lost: Callable[[dict[str, Any]], bool], note: str) -> int:
    """Move the records `lost` selects from metrics.jsonl to metrics.rewound.jsonl (appended, each with `"rewound":
    note`); the number moved. Under the file's lock: appends that come meanwhile wait and land in the new file."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with open(path) as current:
            lines = [line for line in current.read().splitlines() if line.strip()]
        kept, moved = [], []
        for line in lines:
            record = json.loads(line)
            if lost(record):
                moved.append(json.dumps({**record, "rewound": note}))
            else:
                kept.append(line)
        if moved:
            with open(Path(run_dir) / REWOUND_FILE, "a") as aside:  # first: a move cut short duplicates, never loses
                aside.write("".join(m + "\n" for m in moved))
                aside.flush()
                os.fsync(aside.fileno())
            atomic_write_text(path, "".join(k + "\n" for k in kept))
        return len(moved)
    finally:
        os.close(fd)
