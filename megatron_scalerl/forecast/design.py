"""What a `too-early` ablation verdict would take to be called, from simulated studies of the ablation's own fits.

A curve that has not bent yet needs longer runs: `longer_runs` says how much longer (to about twice its C_mid),
without simulation. Otherwise `designs_to_call` tries study designs, cheapest first (`DESIGNS`: seeds per recipe and
scored completions per validation, each a multiple of the study's own), on `TRIALS` simulated studies each: every
seed of the base and of the variant becomes a synthetic run (`synthetic.simulate_run`) of its recipe's fitted mean
curve (A, B, C_mid, R0), simulated seed i with the evaluations of the recipe's run i mod (its runs) (their count and
span in GPU-hours), that run's drift (the median drift sd and neighbour correlation of its noise model) and binomial
evaluation noise of the design's completions; each simulated study is judged by the ablation's own rule. The drift
is each run's own because the runs of one recipe differ in it (on the demo's studies a recipe's three seeds' drift
sd differ up to 5x, 0.005-0.026), and a study's intervals are as wide as its noisiest runs make them; their fitted
parameters, by contrast, differ no more than each run's bootstrap says (method of moments: a between-seed variance
of 0 for A in every recipe of three studies), so all seeds share the mean curve. The answer lists every design
tried with how many of its studies reached a verdict, and stops at the first that does in at least `CALLED` of
`TRIALS`. More completions per validation narrow only the evaluation-noise part of an interval, more seeds narrow
every part but slowly: the A draws of a demo-sized run are heavy-tailed upwards, so their mean over seeds narrows
far less than 1 / sqrt(seeds) (on demo-like synthetic runs, 64 prompts x 4 samples at 16 validations, the median A
interval was 0.14 wide for 1 seed, 0.16 for 2 and 0.12 for 4; with 16 samples per prompt 0.08, 0.06, 0.06).

`power` is the same simulation at the study's own design (or at another one asked for: a `Design`, whose runs may
also be longer than the study's, extrapolating the fitted curves), for every variant, called or not: how often a
study of that size reaches each verdict if the fitted difference is the real one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from megatron_scalerl.forecast.predict import FIT_ERRORS, format_gpu_hours
from megatron_scalerl.forecast.synthetic import PaperRun, simulate_run

if TYPE_CHECKING:
    from megatron_scalerl.forecast.ablation import ArmForecasts
    from megatron_scalerl.forecast.data import Curve
    from megatron_scalerl.forecast.predict import ForecastOptions

DESIGNS = ((1, 4), (2, 1), (2, 4), (4, 4))  # (x seeds per recipe, x completions per validation), cheapest first
TRIALS = 4  # simulated studies per design
CALLED = 3  # ... of which this many must reach a verdict other than too-early
SIMULATION_RESAMPLES = 40  # bootstrap refits per simulated run (the verdicts' intervals)
DEFAULT_DRAWS = 256  # completions per validation assumed when the options do not say (64 prompts x 4 samples)
POWER_TRIALS = 12  # simulated studies of a sweep report's own design behind each variant's power


class Design(NamedTuple):
    """A study's size: runs per recipe, scored completions per validation, and each run's length as a multiple of the
    study's own (its GPU-hours and its validations, at the same spacing)."""

    seeds: int
    draws: int
    length: float = 1.0

    @property
    def valid(self) -> bool:
        """At least one seed and one completion, and a finite positive length."""
        return self.seeds >= 1 and self.draws >= 1 and 0 < self.length < float("inf")

    @property
    def name(self) -> str:
        """As ablation.json's `power_designs` keys it: "3x2048", "3x2048x1.5" for runs 1.5x as long."""
        return f"{self.seeds}x{self.draws}" + (f"x{self.length:g}" if self.length != 1.0 else "")


def longer_runs(recipe: ArmForecasts) -> str:
    """For a recipe whose curve has not bent: how much longer its runs would need to be (to ~2x its C_mid)."""
    c_mid = recipe.fitted["C_mid"]
    return (f"{recipe.name}'s runs about {2 * c_mid / recipe.fitted_until:.1f}x as long (to ~2x its C_mid, "
            f"{format_gpu_hours(2 * c_mid)} GPU-h), so that its curve bends inside them")


def _simulated_recipe(recipe: ArmForecasts, design: Design, rng: np.random.Generator) -> list[Curve]:
    """`design.seeds` synthetic runs of `recipe`'s fitted mean curve, simulated seed i with the evaluations and drift
    of the recipe's run i mod (its runs) (one more evaluation, at 0 GPU-h, outside every fit window: the fitted ones
    keep their count), `design.length` times as long with as many more evaluations at the same spacing, each of
    `design.draws` completions."""
    seeds, draws, length = design
    fitted = recipe.fitted
    like_runs = []  # per run of the recipe: (the mean curve over its fitted GPU-hours, its evaluations, its noise)
    for forecast in recipe.forecasts:
        compute = forecast.curve.compute[forecast.in_fit]
        like_runs.append((PaperRun(recipe.name, C_mid=fitted["C_mid"], B=fitted["B"], A=fitted["A"],
                                   budget=float(compute[-1]) * length), round(compute.size * length) + 1,
                          forecast.boot.noise.summary()))
    curves = []
    for s in range(seeds):
        run, evals, noise = like_runs[s % len(like_runs)]
        simulated = simulate_run(run, int(rng.integers(2**31)), r0=fitted["R0"], num_evals=evals, prompts=draws,
                                 samples_per_prompt=1, drift_sd=noise["drift_sd"], drift_corr=noise["drift_corr"]).curve
        curves.append(replace(simulated, name=f"{recipe.name}-sim{s}", source=f"{recipe.name}/sim{s}"))
    return curves


Judge = Callable[[list["Curve"], tuple[str, list["Curve"]], "ForecastOptions"], str]  # (base, variant, options) -> verdict


def _simulated_verdicts(base: ArmForecasts, variant: ArmForecasts, options: ForecastOptions, judge: Judge,
                        design: Design, trials: int, rng: np.random.Generator) -> Counter:
    """The verdicts of `trials` studies of `design`, simulated from the two recipes' fits ("unfitted": a simulated
    run the fit could not take, so no verdict)."""
    judged = replace(options, eval_draws=design.draws, resamples=SIMULATION_RESAMPLES)
    found = Counter()
    for _ in range(trials):
        try:
            found[judge(_simulated_recipe(base, design, rng),
                        (variant.name, _simulated_recipe(variant, design, rng)), judged)] += 1
        except FIT_ERRORS:
            found["unfitted"] += 1
    return found


def designs_to_call(base: ArmForecasts, variant: ArmForecasts, options: ForecastOptions, judge: Judge) -> str:
    """The designs tried for a too-early `variant` against `base` and what their simulated studies concluded;
    `judge` gives the ablation's verdict on simulated runs (the ablation's own rule, passed in by it)."""
    seeds = max(len(base.forecasts), len(variant.forecasts))
    draws = options.eval_draws or DEFAULT_DRAWS
    rng = np.random.default_rng(options.seed)
    tried = []
    for seed_factor, draw_factor in DESIGNS:
        found = _simulated_verdicts(base, variant, options, judge, Design(seeds * seed_factor, draws * draw_factor),
                                    TRIALS, rng)
        called = TRIALS - found["too-early"] - found["unfitted"]
        verdicts = ", ".join(f"{v} {n}" for v, n in sorted(found.items()))
        tried.append(f"{seeds * seed_factor} seeds per recipe and {draws * draw_factor} completions per validation: "
                     f"{called} of {TRIALS} called ({verdicts})")
        if called >= CALLED:
            return "in studies simulated from these fits (their difference taken as real), " + "; ".join(tried)
    return ("no design tried calls it in studies simulated from these fits (their difference taken as real: "
            + "; ".join(tried) + "): the difference may be smaller than these runs can resolve")


def power(base: ArmForecasts, variant: ArmForecasts, options: ForecastOptions, judge: Judge, trials: int,
          design: Design | None = None) -> dict[str, float]:
    """The study's power: the share of `trials` studies of its own design (its seeds per recipe, its completions
    per validation, its runs' length), or of `design`, simulated from these fits (their difference taken as real)
    that reach each verdict, in the verdicts' order ("unfitted" last: no verdict)."""
    design = design or Design(max(len(base.forecasts), len(variant.forecasts)), options.eval_draws or DEFAULT_DRAWS)
    found = _simulated_verdicts(base, variant, options, judge, design, trials, np.random.default_rng(options.seed + 1))
    order = ("ceiling", "efficiency", "indistinguishable", "too-early", "unfitted")
    return {verdict: found[verdict] / trials for verdict in order if found[verdict]}
