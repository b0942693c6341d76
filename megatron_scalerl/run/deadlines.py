"""How long a run's waits may last: one rule, from the run's own recent steps, for the trainer, the orchestrator and
the launcher's watchdog (docs/design.md, "Every wait has a deadline").

    deadline = Deadline.of(recipe.launch)   # launch.wait_floor_min, launch.first_wait_min
    deadline.mark()                         # at each step's end (the first mark starts the clock)
    deadline.seconds()                      # max(floor, STEP_FACTOR x the slowest of the last RECENT_STEPS steps)
    deadline.words()                        # "12 min (3x the slowest of the last 5 steps)"

Before the first step is timed the bound is `launch.first_wait_min` (the first push, the first batch, a resumed
run's last validation: a model's first step may take far longer than its later ones); once a step is timed,
max(`launch.wait_floor_min`, STEP_FACTOR x the slowest of the last RECENT_STEPS). A fixed number would not fit
every model: a tiny CPU run steps in seconds, DeepSeek-V3 in many minutes.

A role waiting on another one that judges its own progress watches that role's heartbeat (`Heartbeat`, a file whose
modification time the other role moves: `beat`) rather than the thing it waits for: the trainer waits for a batch as
long as the orchestrator beats (the orchestrator knows whether its generation is moving: a validation of a thousand
prompts may hold back a batch for many steps' time).
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path

STEP_FACTOR = 3.0  # a wait ends after this many times the slowest recent step
RECENT_STEPS = 5  # the steps a deadline is measured over


def minutes(seconds: float) -> str:
    """`seconds` in the words of a deadline: `45 s`, `12 min`, `2.5 h`."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Deadline:
    """The bound on a wait (the module docstring). `floor_s`, `first_s`: seconds; `unit`: what one measured
    interval is, plural, in the words (`steps`; `logged steps`: the watchdog's, every `logging.log_interval`)."""

    def __init__(self, floor_s: float, first_s: float, *, factor: float = STEP_FACTOR, recent: int = RECENT_STEPS,
                 unit: str = "steps"):
        self.floor_s, self.first_s, self.factor, self.unit = float(floor_s), float(first_s), float(factor), unit
        self.durations: deque[float] = deque(maxlen=recent)
        self.last_mark: float | None = None

    @classmethod
    def of(cls, launch, **kwargs) -> Deadline:
        """From a recipe's `launch` section (`wait_floor_min`, `first_wait_min`)."""
        return cls(60.0 * launch.wait_floor_min, 60.0 * launch.first_wait_min, **kwargs)

    def record(self, seconds: float) -> None:
        """One step took `seconds`."""
        self.durations.append(max(float(seconds), 0.0))

    def mark(self, now: float | None = None) -> None:
        """A step ended now (`time.monotonic()`): the time since the last mark is one step; the first mark only
        starts the clock."""
        now = time.monotonic() if now is None else now
        if self.last_mark is not None:
            self.record(now - self.last_mark)
        self.last_mark = now

    def seconds(self) -> float:
        if not self.durations:
            return self.first_s
        return max(self.floor_s, self.factor * max(self.durations))

    def why(self) -> str:
        """Where the bound comes from, e.g. "3x the slowest of the last 5 steps"."""
        if not self.durations:
            return f"launch.first_wait_min: no {self.unit} timed yet"
        n = len(self.durations)
        slowest = f"the last {self.unit[:-1]}" if n == 1 else f"the slowest of the last {n} {self.unit}"
        if self.seconds() == self.floor_s:
            return f"launch.wait_floor_min; {slowest} took {minutes(max(self.durations))}"
        return f"{self.factor:g}x {slowest}"

    def words(self) -> str:
        """The bound and where it comes from, e.g. "12 min (3x the slowest of the last 5 steps)"."""
        return f"{minutes(self.seconds())} ({self.why()})"


def beat(path: str | os.PathLike) -> None:
    """Move the modification time of the heartbeat file `path` (created at the first beat)."""
    path = Path(path)
    try:
        os.utime(path)
    except FileNotFoundError:
        path.touch()


class Heartbeat:
    """Another role's heartbeat file as this process sees it: `silent_s()` is how long (this process's monotonic
    clock) since the file's modification time last moved, or since `reset()` if later. Clocks of other machines never
    enter: only a change of the time is read."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.seen: float | None = None
        self.since = time.monotonic()

    def _mtime(self) -> float | None:
        try:
            return self.path.stat().st_mtime
        except FileNotFoundError:
            return None

    def reset(self) -> None:
        """Start counting silence from now (a new wait begins)."""
        self.seen, self.since = self._mtime(), time.monotonic()

    def silent_s(self) -> float:
        mtime = self._mtime()
        if mtime is not None and mtime != self.seen:
            self.seen, self.since = mtime, time.monotonic()
        return time.monotonic() - self.since
