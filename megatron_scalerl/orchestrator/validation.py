"""Validation: the held-out prompts, sampled at policy versions along the run; `val/pass_rate` is the forecaster's
input.

When (`Validation.due`): at policy version 0, at the first version seen at or past each multiple of
`data.validation_interval`, and at the run's last step. Each validation gives every held-out prompt
`data.validation_generations` samples; their mean correctness is `val/pass_rate` (mean@k), and with several domains
each domain's is `val/<domain>/pass_rate` too (each a curve the live forecast fits). The figures go to
metrics.jsonl at the validated version with the run's compute then, and the live forecast is told
(`live_forecast.LiveForecaster.validated`), which refits the curve in a process of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from megatron_scalerl.orchestrator.batch_building import RolloutGroup, outcome_figures
from megatron_scalerl.orchestrator.live_forecast import LiveForecaster
from megatron_scalerl.run.gpu_hours import ComputeMeter
from megatron_scalerl.run.metrics_log import MetricsLog
from megatron_scalerl.tasks.problems import Problem

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


class Validation:
    """The run's validations: which are due, running one, which are done."""

    def __init__(self, problems: list[Problem], *, domains: list[str], interval: int, samples: int, last: int,
                 metrics: MetricsLog, compute: ComputeMeter, live: LiveForecaster):
        self.problems, self.interval, self.samples, self.last = problems, interval, samples, last
        self.domains = domains  # the recipe's (data.domains()): several give one pass rate per domain
        self.metrics, self.compute, self.live = metrics, compute, live
        self.done: set[int] = set()  # policy versions whose validation is in metrics.jsonl
        self.started: dict[int, asyncio.Task] = {}  # this process's validation tasks, by policy version
        self.compute_at: dict[int, dict] = {}  # policy version -> the run's compute at its validation, until its
        # forecast is logged

    def due(self, version: int) -> bool:
        """Due when `version` reached the next multiple of the interval past the last validation (the policy may move
        several steps between two polls), or is the run's last step."""
        started = self.done | set(self.started)
        if not self.problems or version in started:
            return False
        return version == self.last or (version // self.interval) * self.interval > max(started, default=-1)

    async def run(self, version: int, generate: Generate) -> None:
        """Validate policy `version` (the generators serve it or a newer one): log the figures, tell the forecast."""
        groups = await asyncio.gather(*(generate(p, f"val{version}/{p.key}", self.samples) for p in self.problems))
        compute = self.compute.figures()
        figures = validation_figures(groups, self.domains)
        self.metrics.log(version, {**figures, **compute})
        self.done.add(version)
        self.compute_at[version] = compute
        self.live.validated(version)
        print(f"validation at step {version}: pass rate {figures['val/pass_rate']:.3f} "
              f"({figures['val/samples']:.0f} samples)", flush=True)
