"""Validation: the held-out prompts, sampled at policy versions along the run; `val/pass_rate` is the forecaster's
input.

When (`ValidationSchedule`): the scheduled versions are policy version 0, each multiple of `data.validation_interval`
(under PPO-off-policy-k the first version the generators serve from it on: the next k-th step) and the run's last
step. Each owns the versions up to the next one, its interval, and is validated once, at the first version of its
interval that the orchestrator sees the generators serve (`Validation.due`): the scheduled version itself unless
the trainer moved on before a poll saw it. A row is labelled with the version its weights are (its step, and the
run's compute as it ends), and carries the scheduled version it stands for, `val/scheduled_step`.

The trainer cannot leave an interval before its validation has started: the orchestrator holds back the batch that
would take the policy past it (`Validation.may_write`). The hold binds only where an interval is at most
PipelineRL-k's k steps long: a batch b is admitted only once the orchestrator has seen version b - k, and every
version it sees starts the validation then due (under PPO-off-policy-k, only once it has seen b's own block's
version). Only a resumed run can still leave an interval without its validation: the trainer trains the batches
already on disk (up to bound + 1 of them) before the orchestrator's first poll, and a validation still running when
the run stopped left no row. A scheduled version without a validation whose interval the generators have left is
recorded as missed: `val/missed` at its step with `val/missed_reason`, and a warning in the log. A resume knows the
validations taken and missed up to the checkpoint's step from the saved state and metrics.jsonl (`restore`).

Each validation gives every held-out prompt `data.validation_generations` samples; their mean correctness is
`val/pass_rate` (mean@k), and with several domains each domain's is `val/<domain>/pass_rate` too (each a curve the
live forecast fits). The figures go to metrics.jsonl at the validated version with the run's compute then, and the
live forecast is told (`live_forecast.LiveForecaster.validated`), which refits the curve in a process of its own.
"""

from __future__ import annotations

import asyncio
import logging
from bisect import bisect_right
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

from megatron_scalerl.algo.off_policy import next_push_step
from megatron_scalerl.orchestrator.batch_building import RolloutGroup, outcome_figures
from megatron_scalerl.orchestrator.live_forecast import LiveForecaster
from megatron_scalerl.run.gpu_hours import ComputeMeter
from megatron_scalerl.run.metrics_log import MetricsLog, read_metrics
from megatron_scalerl.tasks.problems import Problem

log = logging.getLogger(__name__)

# (prompt, request key, samples) -> the prompt's samples, graded
Generate = Callable[[Problem, str, int], Awaitable[RolloutGroup]]


def validation_figures(groups: list[RolloutGroup], domains: list[str]) -> dict[str, float]:
    """`val/*` of one validation: pass rate (mean correctness over every sample), samples, mean completion length
    (tokens), the share of samples cut at the length cap, failures by kind and, for a recipe with several `domains`,
    each domain's `val/<domain>/pass_rate` (groups.outcome_figures)."""
    correct = [c for g in groups for c in g.correct]
    lengths = [len(s.completion_ids) for g in groups for s in g.samples]
    truncated = [s.truncated for g in groups for s in g.samples]
    return {"val/pass_rate": sum(correct) / len(correct), "val/samples": float(len(correct)),
            "val/length_mean": sum(lengths) / len(lengths), "val/truncation_rate": sum(truncated) / len(lengths),
            **outcome_figures(groups, "val", domains)}


@dataclass(frozen=True)
class ValidationSchedule:
    """The policy versions validated along a run (the module docstring); versions in optimizer steps."""

    interval: int  # data.validation_interval
    last: int  # the run's last step: trainer.max_steps (or the orchestrator's --max-batches)
    off_policy: str = "pipeline"  # rollout.off_policy and rollout.k: which versions the generators serve
    k: int = 1

    @cached_property
    def versions(self) -> list[int]:
        """Every scheduled version, ascending."""
        firsts = {next_push_step(self.off_policy, self.k, m, self.last) for m in range(0, self.last + 1, self.interval)}
        return sorted(firsts | {self.last})

    def owner(self, version: int) -> int:
        """The scheduled version whose interval holds `version` (the last one's goes on past the run's end)."""
        return self.versions[bisect_right(self.versions, version) - 1]

    def end(self, scheduled: int) -> int | None:
        """The first version past the interval of `scheduled`: the next scheduled version (None after the last)."""
        after = bisect_right(self.versions, scheduled)
        return self.versions[after] if after < len(self.versions) else None


class Validation:
    """The run's validations: which are due, which are running, taken or missed."""

    def __init__(self, problems: list[Problem], *, domains: list[str], schedule: ValidationSchedule, samples: int,
                 metrics: MetricsLog, compute: ComputeMeter, live: LiveForecaster):
        self.problems, self.schedule, self.samples = problems, schedule, samples
        self.domains = domains  # the recipe's (data.domains()): several give one pass rate per domain
        self.metrics, self.compute, self.live = metrics, compute, live
        self.done: set[int] = set()  # policy versions whose validation is in metrics.jsonl
        self.missed: set[int] = set()  # scheduled versions recorded as missed (`val/missed` in metrics.jsonl)
        self.started: dict[int, asyncio.Task] = {}  # this process's validation tasks, by policy version
        self.resumed: tuple[int, int] | None = None  # after a resume: (the trainer's step, the stream's last batch)
        self.compute_at: dict[int, dict] = {}  # policy version -> the run's compute at its validation, until its
        # forecast is logged

    def restore(self, validated: Iterable[int], missed: Iterable[int], *, up_to: int, last_batch: int) -> None:
        """Go on after a resume from the trainer's checkpoint of step `up_to`, the stream ending at `last_batch`: the
        validations taken and missed up to that step, as the saved state (`validated`, `missed`) and metrics.jsonl
        hold them (one that landed after the state was saved counts too); those of later policies were of lost work
        (their rows are set aside)."""
        rows = read_metrics(self.metrics.path.parent, "orchestrator")
        self.done = {v for v in [*validated, *(r["step"] for r in rows if "val/pass_rate" in r)] if v <= up_to}
        self.missed = {v for v in [*missed, *(r["step"] for r in rows if "val/missed" in r)] if v <= up_to}
        self.resumed = (up_to, last_batch)

    def settled(self) -> set[int]:
        """The scheduled versions whose validation is taken or running, or that are recorded as missed."""
        return {self.schedule.owner(v) for v in self.done | set(self.started)} | self.missed

    def due(self, version: int) -> tuple[bool, list[int]]:
        """The generators now serve `version`: whether to validate it (its interval's validation is yet to be taken),
        and the scheduled versions before its interval that never were (missed: their weights are gone)."""
        if not self.problems:
            return False, []
        settled, own = self.settled(), self.schedule.owner(version)
        pending = [s for s in self.schedule.versions if s <= version and s not in settled]
        return own in pending, [s for s in pending if s != own]

    def may_write(self, batch: int) -> bool:
        """Whether batch `batch` may be written now: training it takes the policy to version `batch` + 1, which must
        not leave an interval whose validation has not started."""
        if not self.problems:
            return True
        settled = self.settled()
        return all(s in settled for s in self.schedule.versions[:bisect_right(self.schedule.versions, batch)]
                   if (end := self.schedule.end(s)) is not None and end <= batch + 1)

    async def run(self, version: int, generate: Generate) -> None:
        """Validate policy `version` (the generators serve it or a newer one): log the figures, tell the forecast."""
        scheduled = self.schedule.owner(version)
        groups = await asyncio.gather(*(generate(p, f"val{version}/{p.key}", self.samples) for p in self.problems))
        compute = self.compute.figures()
        figures = validation_figures(groups, self.domains)
        self.metrics.log(version, {**figures, "val/scheduled_step": float(scheduled), **compute})
        self.done.add(version)
        self.compute_at[version] = compute
        self.live.validated(version)
        late = "" if version == scheduled else f" (scheduled at step {scheduled}: the trainer had moved on)"
        print(f"validation at step {version}: pass rate {figures['val/pass_rate']:.3f} "
              f"({figures['val/samples']:.0f} samples){late}", flush=True)

    def record_missed(self, scheduled: int, version: int) -> None:
        """The validation scheduled at `scheduled` was never taken and the generators serve `version`, past its
        interval: `val/missed` at its step, with why (`val/missed_reason`, and a warning)."""
        end = self.schedule.end(scheduled)
        why = f"the generators served step {version} before the orchestrator saw any of steps {scheduled}..{end - 1}"
        if self.resumed is not None:
            step, last_batch = self.resumed
            if end <= step:
                why += f": the trainer resumed from step {step}, and the saved state holds no validation of them"
            elif end <= last_batch + 1:
                why += f": the resumed trainer trained batches {step}..{last_batch}, on disk, before the first poll"
        self.missed.add(scheduled)
        self.metrics.log(scheduled, {"val/missed": 1.0, "val/missed_reason": why, **self.compute.figures()})
        log.warning("validation of step %d missed: %s", scheduled, why)
