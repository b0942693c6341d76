"""Run metrics: one JSON object per line in `RUN/metrics.jsonl`, mirrored to wandb (offline by default).

Each record has `step` (optimizer steps), `time` (unix seconds) and `role` (trainer, orchestrator, eval, ...) plus
its figures under slash-separated names (`train/loss`, `val/pass_rate`, `gpu_hours`). Several processes may append
to the same file: each record is one `write` on a file opened with O_APPEND, so lines never interleave.
The forecaster reads this file (compute column `gpu_hours`, metric column e.g. `val/pass_rate`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from megatron_scalerl.fileio import json_safe


class MetricsLog:
    def __init__(self, run_dir: str | Path, role: str, *, wandb_mode: str = "disabled",
                 wandb_project: str | None = None, run_name: str | None = None, config: dict | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.role = role
        self._wandb = None
        if wandb_mode != "disabled":
            import wandb  # heavy: only when asked for

            wandb_dir = Path(run_dir) / "logs"
            wandb_dir.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(project=wandb_project, name=f"{run_name or Path(run_dir).name}-{role}",
                                     dir=str(wandb_dir), mode=wandb_mode, config=config, reinit="create_new")
            # Every figure is plotted against our `step`, not wandb's own counter: a role's records may come out of
            # step order (the orchestrator logs a validation at policy version v after batches up to v + k), and
            # wandb drops a row whose own step goes backwards.
            self._wandb.define_metric("step", hidden=True)
            self._wandb.define_metric("*", step_metric="step")

    def log(self, step: int, figures: dict[str, Any]) -> dict[str, Any]:
        record = {"step": int(step), "time": time.time(), "role": self.role,
                  **json_safe(figures)}
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
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


def read_metrics(run_dir: str | Path, role: str | None = None) -> list[dict[str, Any]]:
    """All records (optionally of one role), in file order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if role is None or r.get("role") == role]
