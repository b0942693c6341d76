"""The time words of the orchestrator's console line, one per batch: `elapsed 12m03s | eta 8m10s`.

`elapsed`: the orchestrator's wall-clock time over the run's launches (`ComputeMeter.wall_hours`: the time each of
its processes ran, summed over resumes, as the run's saved state and metrics record it; the time between two
launches does not count). `eta`: the time until the run ends at its recent pace (`eta_seconds`): the batches left to
`trainer.max_steps` (or `--max-batches`) at the pace of the last `RECENT_BATCHES` batches, or the GPU-hours left to
`trainer.max_gpu_hours` at the GPU-hours those batches took, whichever ends the run first (neither counts the
validation of the last step); `eta ?` while there is no pace to go by. The pace of a process's first batches
includes its start.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

RECENT_BATCHES = 10  # batches the pace is measured over


def duration(seconds: float) -> str:
    """`seconds` as a person reads it: `45s`, `12m03s`, `3h07m` (whole seconds, rounded down; none below 0)."""
    whole = max(int(seconds), 0)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def eta_seconds(recent: Sequence[tuple[float, int, float]], *, max_batches: int, budget: float | None
                ) -> float | None:
    """Seconds until the run ends at the pace of `recent`: (time in s, batches written, GPU-hours) points, oldest
    first. The batches left to `max_batches` at the pace from the oldest point to the newest, or the GPU-hours left
    to `budget` (None: no budget) at theirs, whichever runs out first; None while the points show no progress."""
    if len(recent) < 2:
        return None
    (then, batches_then, hours_then), (now, batches, hours) = recent[0], recent[-1]
    seconds = now - then
    ends = []
    if seconds > 0 and batches > batches_then:
        ends.append(max(max_batches - batches, 0) * seconds / (batches - batches_then))
    if seconds > 0 and budget is not None and hours > hours_then:
        ends.append(max(budget - hours, 0.0) * seconds / (hours - hours_then))
    return min(ends) if ends else None


class Progress:
    """A run's recent pace and the time words of its console line (the module docstring)."""

    def __init__(self, *, max_batches: int, budget: float | None, written: int, gpu_hours: float,
                 now: float | None = None):
        """`written`, `gpu_hours`: where this process starts (batches in the stream; the run's GPU-hours)."""
        self.max_batches, self.budget = max_batches, budget
        self.recent: deque[tuple[float, int, float]] = deque(maxlen=RECENT_BATCHES + 1)
        self.recent.append((time.monotonic() if now is None else now, written, gpu_hours))

    def words(self, *, written: int, gpu_hours: float, wall_hours: float, now: float | None = None) -> str:
        """After a batch: `elapsed <wall_hours> | eta <time left>` (`written`: batches in the stream now)."""
        self.recent.append((time.monotonic() if now is None else now, written, gpu_hours))
        eta = eta_seconds(self.recent, max_batches=self.max_batches, budget=self.budget)
        return f"elapsed {duration(wall_hours * 3600)} | eta {'?' if eta is None else duration(eta)}"
