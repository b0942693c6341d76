"""A sweep's progress, one line when a run starts and one when it ends (local and SLURM sweeps alike):

    sweep: run 3/8 base/seed1 started
    sweep: run 3/8 base/seed1 finished in 4m12s (exit 0); 3 of 8 done, ~21m04s left
    sweep: run 4/8 loo_dapo_loss/seed1 failed after 41s (exit 1); 3 of 8 done, 1 failed, ~19m30s left

`3/8`: the run's place among the runs this `scalerl sweep` was asked for (in the order it starts them; those done
before count as done). "Left" is an estimate: the mean duration of the runs that finished in this sweep process,
for each run not yet ended (less what a running one has run already), shared over the runs that go at once
(`--parallel`, `--max-concurrent`); none until a run has finished. On SLURM a run starts when its job is first seen
running and ends when its job has left the queue (its time in the queue is not counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_scalerl.orchestrator.progress import duration  # the console line's time words: 41s, 4m12s, 2h05m


@dataclass
class SweepProgress:
    """The progress lines of a sweep over `keys` (run keys, in order). `entries`: the manifest's run entries (their
    `state` says which runs are done); `slots`: runs at once (None: no limit); `clock`: seconds, monotonic."""

    keys: list[str]
    entries: Mapping[str, dict[str, Any]]
    slots: int | None
    clock: Callable[[], float] = time.monotonic
    running: dict[str, float] = field(default_factory=dict)  # run key -> its start (clock seconds)
    durations: list[float] = field(default_factory=list)  # seconds of each run that finished in this process
    failed: set[str] = field(default_factory=set)

    def _place(self, key: str) -> str:
        return f"run {self.keys.index(key) + 1}/{len(self.keys)} {key}"

    def start(self, key: str) -> str:
        """Record that run `key` started now; its line."""
        self.running[key] = self.clock()
        return f"sweep: {self._place(key)} started"

    def end(self, key: str, how: str) -> str:
        """Record that run `key` ended now, its manifest entry already saying how (state "done", "failed" or
        "stopped"); its line, `how` in brackets (e.g. "exit 0", "job 123")."""
        now = self.clock()
        start = self.running.pop(key, None)
        took = None if start is None else now - start
        finished = self.entries[key]["state"] == "done"
        if not finished:
            self.failed.add(key)
        elif took is not None:
            self.durations.append(took)
        when = "" if took is None else f" {'in' if finished else 'after'} {duration(took)}"
        done = sum(self.entries[k]["state"] == "done" for k in self.keys)
        failed = f", {len(self.failed)} failed" if self.failed else ""
        left = self.left_s(now)
        eta = "" if left is None else f", ~{duration(left)} left"
        return (f"sweep: {self._place(key)} {'finished' if finished else self.entries[key]['state']}{when} ({how}); "
                f"{done} of {len(self.keys)} done{failed}{eta}")

    def left_s(self, now: float) -> float | None:
        """Seconds until every run not yet ended has ended (module docstring); None when none is left, or before a
        run has finished in this process."""
        waiting = [k for k in self.keys if self.entries[k]["state"] != "done" and k not in self.failed]
        if not waiting or not self.durations:
            return None
        mean = sum(self.durations) / len(self.durations)
        work = sum(max(mean - (now - self.running[k]), 0.0) if k in self.running else mean for k in waiting)
        return work / min(self.slots or len(waiting), len(waiting))
