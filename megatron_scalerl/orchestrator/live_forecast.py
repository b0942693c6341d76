"""The orchestrator's live forecast: after each validation the run's curve is refitted in a process of its own, so
the fit (a bootstrap of a few hundred refits, seconds of CPU) never holds up generation, grading or the trainer.

    live = LiveForecaster(run_dir, recipe.forecast)  # recipe.forecast None or live: false -> `enabled` is False
    live.validated(version)          # the validation row of policy version `version` is in metrics.jsonl
    async for version, result in live.results():  # FitResult of each fit as it finishes
    live.close()

The fitting process (at the lowest CPU priority) only reads `RUN/metrics.jsonl` (the orchestrator's `val/pass_rate` against its `gpu_hours`) and
writes `RUN/forecast/` (forecast.json, report.md, report.html, forecast.png, each file replaced atomically); the
orchestrator writes the figures to metrics.jsonl. One fit runs at a time: validations that land meanwhile are
covered by the next fit, which reads the whole curve as it then is.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast import report
from megatron_scalerl.forecast.data import DEFAULT_METRIC, MetricsTable
from megatron_scalerl.forecast.live import LiveForecast, ceiling_reached, live_forecast, run_options
from megatron_scalerl.recipe import ForecastConfig

log = logging.getLogger("megatron_scalerl.orchestrator")
FORECAST_DIR = "forecast"
# The fitting process yields the CPU to every role of the run: where they share cores (a CPU run) the fit takes
# what they leave (bench/live_forecast.py: at niceness 0 the demo trained 8% fewer samples/s with fits every 3 s).
FIT_NICENESS = 19
PR_SET_PDEATHSIG = 1  # prctl(2)


def _init_fit_process() -> None:
    """The fitting process: the lowest CPU priority, and (Linux) killed with the orchestrator, which may leave with
    `os._exit` on SIGTERM while a fit runs."""
    os.nice(FIT_NICENESS)
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# Further curves the live forecast fits beside the primary `val/pass_rate`, found in metrics.jsonl by their names:
# a downstream evaluation (the eval watcher's `eval/<dataset>/mean_at_k`) and a domain's validation
# (`val/<domain>/pass_rate`, logged for recipes with several domains). Curve name: the metric without its last part
# (`eval/aime24`, `val/code`); keys `forecast/<curve>/...`, report in `RUN/forecast/<curve>/`.
FURTHER_CURVE = re.compile(r"^((?:val|eval)/[^/]+)/(?:pass_rate|mean_at_k)$")


def further_curves(metrics: MetricsTable) -> dict[str, str]:
    """{curve name: metric} of the further curves in a run's metrics (see FURTHER_CURVE)."""
    return {match.group(1): key for key in sorted(metrics.columns()) if (match := FURTHER_CURVE.match(key))}


@dataclass(frozen=True)
class FitResult:
    """What one fit in the fitting process hands back to the orchestrator."""

    figures: dict  # forecast/... (and forecast/<curve>/...) figures for metrics.jsonl
    words: str  # the progress line's: the primary curve's status and A with its interval
    reason: str  # why the primary curve has its status
    stop_reason: str | None  # set when forecast.stop_at_fraction asks the run to end now
    cpu_s: float  # CPU seconds the fit took


def fit_run(run_dir: str, forecast_config: ForecastConfig, eval_draws: int | None) -> FitResult:
    """In the fitting process: the live forecast of the run's primary curve (`eval_draws`: its evaluation noise) and
    of its further curves (noise estimated), their reports into RUN/forecast/[<curve>/]."""
    started = time.process_time()
    try:
        metrics = MetricsTable.read(run_dir)  # read once for every curve
    except UserError as exc:  # e.g. a torn line: said, and the run goes on
        primary, further = _unfittable(exc, forecast_config), {}
    else:
        primary = _fit_curve(metrics, DEFAULT_METRIC, forecast_config, eval_draws, Path(run_dir) / FORECAST_DIR)
        further = further_curves(metrics)
    figures = primary.figures()
    for name, metric in further.items():
        live = _fit_curve(metrics, metric, forecast_config, None, Path(run_dir) / FORECAST_DIR / name)
        figures.update(live.figures(prefix=f"forecast/{name}/"))
    fraction = forecast_config.stop_at_fraction
    stop = ceiling_reached(primary, fraction) if fraction is not None else None
    return FitResult(figures, primary.progress(), primary.reason, stop, time.process_time() - started)


def _unfittable(why: UserError, config: ForecastConfig) -> LiveForecast:
    return LiveForecast("too-early", f"the run's curve cannot be fitted: {why}", None, config.target)


def _fit_curve(metrics: MetricsTable, metric: str, config: ForecastConfig, eval_draws: int | None, out_dir: Path):
    """The LiveForecast of the run's curve of `metric`, its report written into `out_dir` when there is a fit."""
    from megatron_scalerl.forecast import plots  # deferred: matplotlib, wanted in the fitting process only

    options = run_options(config, eval_draws)
    try:
        curve = metrics.curve(metric)
    except UserError as exc:  # e.g. a validation logged twice across a resume: said, and the run goes on
        return _unfittable(exc, config)
    live = live_forecast(curve, options, target=config.target)
    if live.forecast is not None:
        document = report.forecast_document(live.forecast, plots.forecast_png(live.forecast))
        data = {**live.forecast.to_dict(), "status": live.status, "status_reason": live.reason}
        report.write_report(out_dir, document, "forecast.json", data)
    return live


class LiveForecaster:
    def __init__(self, run_dir: Path, config: ForecastConfig | None, eval_draws: int | None = None):
        """`eval_draws`: completions scored per validation (held-out prompts x samples), the evaluation noise."""
        self.run_dir, self.config, self.eval_draws = run_dir, config, eval_draws
        self.enabled = config is not None and config.live
        self.pool: ProcessPoolExecutor | None = None
        self.running: tuple[int, Future] | None = None  # (latest version the fit covers, its future)
        self.pending: int | None = None  # a newer validation that the running fit does not cover
        self.words = ""  # the progress line's: the latest status and A with its interval
        self.wakeup = asyncio.Event()

    def validated(self, version: int) -> None:
        if not self.enabled:
            return
        if self.running is None:
            self._submit(version)
        else:
            self.pending = max(version, self.pending if self.pending is not None else version)

    def _submit(self, version: int) -> None:
        if self.pool is None:  # spawn: a clean interpreter, not a fork of the event loop's process
            self.pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init_fit_process)
        try:
            future = self.pool.submit(fit_run, str(self.run_dir), self.config, self.eval_draws)
        except (BrokenProcessPool, RuntimeError) as exc:  # the process died: the next fit starts a new one
            log.warning("live forecast for validation %d not started: %s", version, exc)
            self._discard_pool()
            return
        self.running = (version, future)
        self.wakeup.set()

    def _discard_pool(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    async def results(self):
        """Async generator: (version, FitResult) of each finished fit, forever (cancel it to stop). A failed fit is
        logged and skipped: the run goes on without that forecast."""
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.running is not None:
                version, future = self.running
                try:
                    result = await asyncio.wrap_future(future)
                except Exception as exc:  # noqa: BLE001 - a forecast must never end the run
                    log.warning("live forecast after validation %d failed: %s: %s", version, type(exc).__name__, exc)
                    result = None
                    if isinstance(exc, BrokenProcessPool):
                        self._discard_pool()
                self.running = None
                if self.pending is not None:
                    self._submit(self.pending)
                    self.pending = None
                    self.wakeup.clear()
                if result is not None:
                    self.words = result.words
                    log.info("forecast after validation %d: %s (%s; %.1f CPU s)", version,
                             result.figures["forecast/status"], result.reason, result.cpu_s)
                    yield version, result

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until no fit is running or pending."""
        deadline = time.monotonic() + timeout_s
        while (self.running is not None or self.pending is not None) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)

    def close(self) -> None:
        """Stop the fitting process (a fit still running is abandoned: its report files are each whole)."""
        if self.pool is not None:
            for process in list(getattr(self.pool, "_processes", {}).values()):
                process.kill()
        self._discard_pool()
