"""Ablations: a base recipe against variants of it, each run with one or more seeds, and a verdict per variant.

`make_ablation(base, variants, options)` fits every run (`make_forecast`, each with its own bootstrap) and compares
each variant with the base; `Ablation.to_dict()` is the content of ablation.json. Compute is GPU-hours, rewards are
pass rates in [0, 1], intervals `[X_lo, X_hi]` at `options.level`; inf (never reached) is null in the JSON:

    {"schema": "scalerl.sweep-report/1", "curve", "level", "rule", "options": {...},
     "base": {"name", "run", "runs", "curve", "A", "A_lo", "A_hi", "B", ..., "C_mid", ..., "R0", ...,
              "compute_to_50pct_base_gain", "compute_to_50pct_base_gain_lo", ..._hi, the same for 90pct,
              "predictions": [{"gpu_hours", "reward", "lo", "hi"}, ...] (one per budget: the pass rate there),
              "targets": [{"reward", "gpu_hours", "lo", "hi", "reachable"}, ...], "warnings": [...]},
     "variants": [{the same fields, and "dA", "dA_lo", "dA_hi", "compute_ratio_50pct_base_gain" (variant / base)
                   with _lo and _hi, the same for 90pct, "compute_ratio_50pct_own_gain" (the compute each
                   needs to 50% of its own gain, variant / base: the ratio of their C_mid) with _lo and _hi, the
                   same for 90pct, "crossovers": [GPU-h where it crosses the base],
                   "verdict", "verdict_reason", "needs" (too-early: what would call it, as numbers; else null),
                   "power" ({verdict: share of studies of this design simulated from the fits reaching it}, or
                   null where not simulated), "power_designs" ({"SEEDSxCOMPLETIONS[xLENGTH]": the same at that
                   design} for the designs asked for, or null)},
                  ...]}

Seeds. The noise model (`uncertainty`) is per run: each seed drifts on its own. So each seed is fitted and
bootstrapped alone, and a recipe's curve is the mean of its seeds' fitted curves, R(C) = mean_s R_s(C): its ceiling is
the seeds' mean A, its R0 their mean R0, its C_mid the compute where it reaches half its gain A - R0, and its B the
steepness ln(81) / ln(C_90 / C_10) between 10% and 90% of that gain (for one seed: the seed's own A, B, C_mid, R0).
Its bootstrap draws are the same means taken replicate by replicate (replicate i of every seed), so their spread is
that of the mean of independent runs. Every run gets its own bootstrap seed (`options.seed` + its index, base seeds
first): the base and a variant are independent runs, so their replicates must be independent too; common random
numbers would cancel the noise the two runs do not share and make every difference look significant. Differences
between seeds beyond what their noise models explain (a rerun landing on other parameters) are not modelled; the
A_MARGIN floor of the verdict rule stands for them, as in the paper.

Differences to the base, taken replicate by replicate (draw i of the variant minus draw i of the base):
- dA = A_variant - A_base;
- the compute ratio C_variant(r_q) / C_base(r_q) at r_q = R0_base + q (A_base - R0_base) for q = 50% and 90% of the
  base's gain, each draw with its own r_q (inf where the variant never reaches r_q): when the variant reaches the
  base's levels, which mixes its ceiling in (a lower one reaches them later);
- the compute ratio to q = 50% and 90% of each recipe's own gain, C_variant(R0_v + q (A_v - R0_v)) /
  C_base(r_q): the paper's efficiency, C_mid and the steepness B, free of the ceiling.
Intervals are percentile intervals at `options.level` of those draws (a draw where a ratio is undefined, 0/0 or
inf/inf, is left out).

Verdict per variant (the rule, `RULE`, is printed in every report):
1. `too-early` when the base or the variant is not pinned down: its curve has not bent (last fitted compute below
   its C_mid, so A is an extrapolation), fewer than MIN_BENT_SHARE (80%) of a run's bootstrap refits bend inside its
   data (C_mid at or below its last fitted compute; the intervals are taken over those refits: one that bends only
   past the data puts A wherever its extrapolation goes), it shows no gain, or a seed's fit ended on a search bound
   of A or C_mid. A
   wide A interval alone is no reason: the dA and compute-ratio intervals carry it (until 2026-11-28 an A interval
   wider than WIDE_A_INTERVAL, 0.1, made a recipe too-early too; on demo-sized runs, 16 validations of 64 prompts x
   16 samples, 2 seeds a recipe, that rule called a C_mid x2 shift `efficiency` in 0 of 12 noise seeds and A + 0.08
   `ceiling` in 7 of 12; without it 12 of 12 and 11 of 12, identical runs called different in 0 of 12);
2. `ceiling` when the dA interval excludes 0 and |dA| >= A_MARGIN (0.02, the paper's run-to-run margin on A);
3. `efficiency` otherwise, when the interval of the compute ratio to 50% or to 90% of each one's own gain excludes
   1 and that ratio is at least EFFICIENCY_MARGIN (or at most its inverse). Until 2026-11-28 this was the ratio to
   the base's gain, which calls a lower ceiling whose dA interval still reaches 0 `efficiency` (it reaches the
   base's levels later): a real variant that could never score on a fifth of the problems, C_mid unchanged
   (`demo_length_cap`), was called `efficiency` 1.61x [1.27, 2.13]; its C_mid ratio was 0.94. On demo-sized
   synthetic runs (2 seeds, 16 validations of 64 x 16) a ceiling down 0.08 at equal C_mid was `efficiency` in 3 of
   10 studies under that rule, 1 of 10 under this one;
4. `indistinguishable` when nothing was found and the intervals rule out a relevant difference: the dA interval
   lies within +-EQUIVALENCE_A and the ratio interval to 50% of each one's own gain within
   [1 / EQUIVALENCE_RATIO, EQUIVALENCE_RATIO];
5. `too-early` otherwise: nothing found, but the intervals are too wide to say there is nothing.
A `too-early` verdict says what would call it (`forecast.design`): runs long enough for an unbent curve to pass ~2x
its C_mid, or the first study design (more seeds, more completions per validation) whose studies, simulated from the
ablation's own fits, reach a verdict.
Rates on synthetic runs of known parameters (the paper's 8B run, A 0.61, C_mid 2.5k GPU-h, 81 evaluations to 16k
GPU-h, one seed per recipe, 100 replicates; tests/test_forecast_ablation.py): A + 0.05 at equal B and C_mid is
`ceiling` in 91% of 160 noise seeds (`efficiency` in 6%: it is faster too); C_mid x2 at equal A is `efficiency`
in 96% of 120, C_mid x0.5 in 98% of 60; identical parameters are `ceiling` or `efficiency` in 1% of 210
(`indistinguishable` in 91%, `too-early` in 8%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast.compare import crossovers
from megatron_scalerl.forecast.data import Curve
from megatron_scalerl.forecast.design import Design, designs_to_call, longer_runs, power
from megatron_scalerl.forecast.predict import (
    A_MARGIN,
    NO_GAIN,
    Forecast,
    ForecastOptions,
    format_gpu_hours,
    make_forecast,
)
from megatron_scalerl.forecast.sigmoid import reward_at
from megatron_scalerl.forecast.uncertainty import interval

SCHEMA = "scalerl.sweep-report/1"
PARAMS = ("A", "B", "C_mid", "R0")
GAIN_FRACTIONS = (0.5, 0.9)  # fractions of a gain (the base's, or each recipe's own) whose compute is compared
MIN_BENT_SHARE = 0.8  # below this share of a seed's refits bent inside its data, a recipe is too-early
EFFICIENCY_MARGIN = 1.2  # a compute ratio counts from 20% faster or slower
EQUIVALENCE_A = 0.05  # `indistinguishable` needs the dA interval within +-this
EQUIVALENCE_RATIO = 2.0  # ... and the compute ratio to 50% of each one's own gain within [1/this, this]
RULE = (f"Differences are taken replicate by replicate between independent bootstraps of the variant and the base, "
        f"intervals are their percentile intervals, over the refits that bend inside their run's data. too-early: the "
        f"base or the variant is not pinned down (its curve has not bent past C_mid, fewer than "
        f"{MIN_BENT_SHARE:.0%} of a run's refits bend inside its data, it shows no gain, or a seed's fit ended on a "
        f"bound of A or C_mid). ceiling: the interval of dA = A_variant - A_base excludes 0 and |dA| "
        f">= {A_MARGIN} (the paper's run-to-run margin on A). efficiency: not a ceiling, and the interval of the "
        f"compute ratio (variant / base) to reach 50% or 90% of each one's own gain (C_mid and the steepness B, free "
        f"of the ceiling) excludes 1, the ratio being at least {EFFICIENCY_MARGIN:g}x either way. indistinguishable: "
        f"none of these, with the dA interval within +-{EQUIVALENCE_A} and the 50% own-gain compute ratio's interval "
        f"within [1/{EQUIVALENCE_RATIO:g}, "
        f"{EQUIVALENCE_RATIO:g}]. too-early otherwise: nothing found, but the intervals are too wide to rule out a "
        f"difference that size.")


def _mean_curve(compute, A, B, C_mid, R0) -> np.ndarray:
    """Mean over seeds of the sigmoids: parameters of shape (k, m) (k draws, m seeds), compute (n,) -> (k, n)."""
    compute = np.asarray(compute, dtype=float)
    return reward_at(compute[None, :, None], *(p[:, None, :] for p in (A, B, C_mid, R0))).mean(axis=-1)


def _mean_compute_to_reach(reward, A, B, C_mid, R0, steps: int = 60) -> np.ndarray:
    """GPU-hours at which the mean of the seeds' sigmoids (parameters (k, m)) reaches `reward` (scalar or (k,)):
    shape (k,); inf where it never does (reward >= mean A), 0 where it starts there (reward <= mean R0).
    Bisection in log compute, the bracket widened by decades from the seeds' geometric-mean C_mid."""
    reward = np.broadcast_to(np.asarray(reward, dtype=float), A.shape[:1])

    def mean_at(c):  # the mean curve of row j at compute c[j]
        return reward_at(c[:, None], A, B, C_mid, R0).mean(axis=1)

    start = np.exp(np.log(C_mid).mean(axis=1))
    lo, hi = start.copy(), start.copy()
    for _ in range(40):  # 1e40 either way: far past any budget
        lo = np.where(mean_at(lo) > reward, lo / 10.0, lo)
        hi = np.where(mean_at(hi) < reward, hi * 10.0, hi)
    for _ in range(steps):
        mid = np.sqrt(lo * hi)
        below = mean_at(mid) < reward
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    out = np.sqrt(lo * hi)
    out[reward >= A.mean(axis=1)] = np.inf
    out[reward <= R0.mean(axis=1)] = 0.0
    return out


def _interval(draws, level: float) -> tuple[float, float]:
    """Percentile interval of the draws that are defined (NaN marks a draw where the quantity is not)."""
    draws = np.asarray(draws, dtype=float)
    return interval(draws[~np.isnan(draws)], level)


def _bent(forecast: Forecast) -> np.ndarray:
    """Which of a run's bootstrap refits bend inside its data (C_mid at or below its last fitted GPU-hours): (k,)."""
    return forecast.boot.C_mid <= forecast.fitted_until


def _summarise(A, B, C_mid, R0) -> dict[str, np.ndarray]:
    """A, B, C_mid, R0 of the mean curve of each row of the seeds' parameters (each (k, m)): arrays of shape (k,)."""
    A_mean, R0_mean = A.mean(axis=1), R0.mean(axis=1)
    c10, c50, c90 = (_mean_compute_to_reach(R0_mean + q * (A_mean - R0_mean), A, B, C_mid, R0) for q in (0.1, 0.5, 0.9))
    with np.errstate(divide="ignore", invalid="ignore"):
        steepness = np.log(81.0) / np.log(c90 / c10)  # a sigmoid's C_90 / C_10 is 81^(1/B)
    return {"A": A_mean, "B": steepness, "C_mid": c50, "R0": R0_mean}


@dataclass(frozen=True)
class ArmForecasts:
    """The base or a variant: the forecasts of its seeds (one run each) and their mean curve (module docstring)."""

    name: str
    forecasts: tuple[Forecast, ...]

    @property
    def runs(self) -> list[str]:
        return [f.curve.source for f in self.forecasts]

    @property
    def level(self) -> float:
        return self.forecasts[0].options.level

    @property
    def fitted_until(self) -> float:
        """The last fitted compute over the seeds, GPU-hours."""
        return max(f.fitted_until for f in self.forecasts)

    @cached_property
    def params(self) -> tuple[np.ndarray, ...]:
        """The seeds' fitted (A, B, C_mid, R0), each of shape (1, m)."""
        return tuple(np.array([[getattr(f.fit, p) for f in self.forecasts]]) for p in PARAMS)

    @cached_property
    def bent_share(self) -> float:
        """The least share, over the seeds, of bootstrap refits that bend inside their run's data (C_mid <= its last
        fitted GPU-hours): the refits whose A the run identifies."""
        return float(min(np.mean(_bent(f)) for f in self.forecasts))

    @cached_property
    def draws(self) -> tuple[np.ndarray, ...]:
        """The seeds' bootstrap draws of (A, B, C_mid, R0), each (k, m): row i holds a draw of every seed. Only a
        seed's refits that bend inside its data count (`bent_share`), cycled to fill the k rows (the seeds' and the
        recipes' draws are independent, so any row pairs independent draws). A refit that bends only past the data
        (noise read as a late rise) puts A wherever its extrapolation goes, up to the bound of 1: on a demo run that
        plateaued early at 0.07, 17% of refits did, and made its A interval [0.05, 1.0] (bent ones: [0.05, 0.11])."""
        columns = {p: [] for p in PARAMS}
        for f in self.forecasts:
            bent = np.flatnonzero(_bent(f))
            rows = bent if bent.size else np.arange(f.boot.C_mid.size)
            pick = rows[np.arange(f.boot.C_mid.size) % rows.size]
            for p in PARAMS:
                columns[p].append(getattr(f.boot, p)[pick])
        return tuple(np.column_stack(columns[p]) for p in PARAMS)

    @cached_property
    def fitted(self) -> dict[str, float]:
        """A, B, C_mid (GPU-h), R0 of the mean fitted curve."""
        return {name: float(values[0]) for name, values in _summarise(*self.params).items()}

    @cached_property
    def sampled(self) -> dict[str, np.ndarray]:
        """Bootstrap draws of the same, shape (k,) each."""
        return _summarise(*self.draws)

    def param_interval(self, name: str) -> tuple[float, float]:
        return _interval(self.sampled[name], self.level)

    def predict(self, compute) -> np.ndarray:
        """The mean fitted curve at `compute` GPU-hours, of `compute`'s shape (duck-types `SigmoidFit.predict`)."""
        compute = np.asarray(compute, dtype=float)
        return _mean_curve(np.atleast_1d(compute), *self.params)[0].reshape(compute.shape)

    def rewards(self, compute) -> np.ndarray:
        """Draws of the recipe's pass rate (its seeds' mean, drift included) at `compute` GPU-h: shape (k, n)."""
        return np.mean([f.boot.rewards(compute) for f in self.forecasts], axis=0)

    def compute_to_reach(self, reward: float, draw_rewards=None) -> tuple[float, np.ndarray]:
        """GPU-hours the mean fitted curve needs to reach `reward`, and the draws' (shape (k,)) to reach
        `draw_rewards` (one reward per draw; default `reward`); inf where never."""
        value = _mean_compute_to_reach(reward, *self.params)[0]
        return float(value), _mean_compute_to_reach(reward if draw_rewards is None else draw_rewards, *self.draws)

    def unpinned(self) -> str | None:
        """Why the recipe's curve does not pin its ceiling down (verdict rule 1), or None."""
        A, R0, C_mid = self.fitted["A"], self.fitted["R0"], self.fitted["C_mid"]
        if A - R0 <= NO_GAIN:
            return f"{self.name} shows no gain over R0 = {R0:.3f}"
        if self.fitted_until < C_mid:
            return (f"{self.name} has not bent yet: its last fitted evaluation ({format_gpu_hours(self.fitted_until)} "
                    f"GPU-h) is below its C_mid ({format_gpu_hours(C_mid)} GPU-h), so A is an extrapolation")
        if self.bent_share < MIN_BENT_SHARE:
            return (f"{self.name} has barely bent: only {self.bent_share:.0%} of a run's bootstrap refits bend inside "
                    f"its data (at least {MIN_BENT_SHARE:.0%} needed), so its A is too often an extrapolation")
        for f in self.forecasts:
            bound = [name for name in f.fit.at_bounds if name in ("A", "C_mid")]
            if bound:
                return f"{f.curve.source}: the fit's {' and '.join(bound)} ended on its search bound"
        return None


@dataclass(frozen=True)
class Contrast:
    """A variant against the base: differences (value and bootstrap draws of shape (k,)) and the verdict."""

    dA: tuple[float, np.ndarray]  # A_variant - A_base
    compute: dict[float, tuple[float, np.ndarray]]  # q -> the variant's GPU-h to reach q of the base's gain
    ratio: dict[float, tuple[float, tuple[float, float]]]  # q -> compute ratio variant / base: value, interval
    own_ratio: dict[float, tuple[float, tuple[float, float]]]  # q -> the same to q of each one's own gain
    verdict: str
    reason: str
    needs: str | None  # too-early: what would let the rule call it, as numbers; else None
    power: dict[str, float] | None = None  # verdict -> share of simulated studies of this design (`design.power`)
    power_designs: dict[str, dict[str, float]] | None = None  # "SEEDSxCOMPLETIONS" -> the same at that design


def _needs(base: ArmForecasts, variant: ArmForecasts, options: ForecastOptions) -> str:
    """What a `too-early` verdict would take (`forecast.design`): longer runs for a curve that has not bent, else
    the study designs simulated from the fits."""
    for recipe in (base, variant):
        if recipe.fitted["A"] - recipe.fitted["R0"] <= NO_GAIN:
            return f"{recipe.name} to learn at all: no study of these runs could compare its gain"
        if recipe.fitted_until < recipe.fitted["C_mid"]:
            return longer_runs(recipe)
    return designs_to_call(base, variant, options, _judge)


def _judge(base: list[Curve], variant: tuple[str, list[Curve]], options: ForecastOptions) -> str:
    """The verdict on one variant's runs against the base's (`forecast.design`'s simulated studies)."""
    return make_ablation(base, [variant], options, judge_only=True).contrasts[0].verdict


def _contrast(base: ArmForecasts, base_compute: dict, gain_levels: dict, variant: ArmForecasts,
              options: ForecastOptions | None, power_trials: int = 0,
              power_designs: tuple[Design, ...] = ()) -> Contrast:
    """Differences of `variant` to `base` replicate by replicate; `gain_levels[q]` is the reward at q of the base's
    gain (value, draws), `base_compute[q]` the base's GPU-hours to it (value, draws). With `options`, a too-early
    verdict says what would call it (`_needs`)."""
    dA = (variant.fitted["A"] - base.fitted["A"], variant.sampled["A"] - base.sampled["A"])

    def over_base(q: float, compute: tuple[float, np.ndarray]) -> tuple[float, tuple[float, float]]:
        with np.errstate(divide="ignore", invalid="ignore"):  # 0/0 and inf/inf are NaN, left out of the interval
            value = np.float64(compute[0]) / base_compute[q][0]  # a base with no gain reaches its levels at 0 GPU-h
            return float(value), _interval(compute[1] / base_compute[q][1], base.level)

    compute, ratio, own_ratio = {}, {}, {}
    for q in GAIN_FRACTIONS:
        compute[q] = variant.compute_to_reach(*gain_levels[q])
        ratio[q] = over_base(q, compute[q])
        own_ratio[q] = over_base(q, variant.compute_to_reach(*_gain_level(variant, q)))
    verdict, reason = _verdict(base, variant, dA, own_ratio)
    needs = _needs(base, variant, options) if verdict == "too-early" and options is not None else None
    simulable = all(r.fitted["A"] - r.fitted["R0"] > NO_GAIN and r.fitted_until >= r.fitted["C_mid"]
                    for r in (base, variant))
    simulated = options is not None and power_trials and simulable
    chances = power(base, variant, options, _judge, power_trials) if simulated else None
    at_designs = ({d.name: power(base, variant, options, _judge, power_trials, d) for d in power_designs}
                  if simulated and power_designs else None)
    return Contrast(dA, compute, ratio, own_ratio, verdict, reason, needs, chances, at_designs)


def _gain_level(recipe: ArmForecasts, q: float) -> tuple[float, np.ndarray]:
    """The pass rate at `q` of the recipe's own gain, R0 + q (A - R0): fitted value, and per draw (shape (k,))."""
    fitted, sampled = recipe.fitted, recipe.sampled
    return fitted["R0"] + q * (fitted["A"] - fitted["R0"]), sampled["R0"] + q * (sampled["A"] - sampled["R0"])


def _verdict(base: ArmForecasts, variant: ArmForecasts, dA: tuple[float, np.ndarray], own_ratio: dict
             ) -> tuple[str, str]:
    """The rule of the module docstring (`own_ratio`: q -> the compute ratio to q of each one's own gain, value and
    interval); returns (verdict, the reason in one sentence)."""
    for recipe in (base, variant):
        why = recipe.unpinned()
        if why:
            return "too-early", f"{why}; keep training before judging"
    lo, hi = _interval(dA[1], base.level)
    span = f"dA = {dA[0]:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    if (lo > 0 or hi < 0) and abs(dA[0]) >= A_MARGIN:
        return "ceiling", f"{span} excludes 0 and exceeds the paper's +-{A_MARGIN} margin: the ceiling moves"
    found = [f"{'slower' if value > 1 else 'faster'} to {q:.0%} of its gain: {value:.2f}x the base's compute "
             f"[{r_lo:.2f}, {r_hi:.2f}]" for q, (value, (r_lo, r_hi)) in own_ratio.items()
             if (r_lo > 1 or r_hi < 1) and (value >= EFFICIENCY_MARGIN or value <= 1 / EFFICIENCY_MARGIN)]
    if found:
        return "efficiency", f"{span}, no ceiling shift; " + "; ".join(found)
    r_lo, r_hi = own_ratio[GAIN_FRACTIONS[0]][1]
    shown = f"{span} and the compute ratio to 50% of each one's gain [{r_lo:.2f}, {r_hi:.2f}] show no difference"
    if -EQUIVALENCE_A <= lo and hi <= EQUIVALENCE_A and 1 / EQUIVALENCE_RATIO <= r_lo and r_hi <= EQUIVALENCE_RATIO:
        return "indistinguishable", shown
    return "too-early", (f"{shown} yet, but are too wide to rule out a dA of {EQUIVALENCE_A} or "
                         f"{EQUIVALENCE_RATIO:g}x the compute")


@dataclass(frozen=True)
class Ablation:
    base: ArmForecasts
    variants: tuple[ArmForecasts, ...]
    base_compute: dict[float, tuple[float, np.ndarray]]  # q -> the base's GPU-h to q of its gain: value, draws (k,)
    contrasts: tuple[Contrast, ...]  # one per variant
    options: ForecastOptions  # the targets include make_ablation's `target`
    power_trials: int = 0  # simulated studies behind each contrast's `power`
    power_designs: tuple[Design, ...] = ()  # other designs simulated (seeds, completions per validation, length)

    @property
    def metric(self) -> str:
        return self.base.forecasts[0].curve.metric

    def _recipe_dict(self, recipe: ArmForecasts, compute: dict) -> dict:
        level = recipe.level
        out = {"name": recipe.name, "run": recipe.runs[0], "runs": recipe.runs, "curve": self.metric}
        for name in PARAMS:
            out[name] = recipe.fitted[name]
            out[f"{name}_lo"], out[f"{name}_hi"] = recipe.param_interval(name)
        for q, (value, draws) in compute.items():
            key = f"compute_to_{q:.0%}_base_gain".replace("%", "pct")
            out[key] = value
            out[f"{key}_lo"], out[f"{key}_hi"] = _interval(draws, level)
        budgets = sorted(self.options.budgets)
        out["predictions"] = [{"gpu_hours": b, "reward": float(r), "lo": lo, "hi": hi}
                              for b, r, (lo, hi) in zip(budgets, recipe.predict(budgets),
                                                        (_interval(d, level) for d in recipe.rewards(budgets).T),
                                                        strict=True)]
        out["targets"] = []
        for reward in self.options.targets:
            value, draws = recipe.compute_to_reach(reward)
            lo, hi = _interval(draws, level)
            out["targets"].append({"reward": reward, "gpu_hours": value, "lo": lo, "hi": hi,
                                   "reachable": math.isfinite(value)})
        out["warnings"] = [f"{f.curve.source}: {w}" for f in recipe.forecasts for w in f.warnings]
        return out

    def to_dict(self) -> dict:
        """ablation.json's content. A compute never reached stays inf here; `fileio.json_safe` writes it as null."""
        recipes = (self.base, *self.variants)
        low = min(f.curve.compute[f.in_fit][0] for r in recipes for f in r.forecasts)
        high = max([*self.options.budgets] + [r.fitted_until for r in recipes])
        variants = []
        for recipe, contrast in zip(self.variants, self.contrasts, strict=True):
            row = self._recipe_dict(recipe, contrast.compute)
            row["dA"] = contrast.dA[0]
            row["dA_lo"], row["dA_hi"] = _interval(contrast.dA[1], recipe.level)
            for gain, ratios in (("base", contrast.ratio), ("own", contrast.own_ratio)):
                for q, (value, (lo, hi)) in ratios.items():
                    key = f"compute_ratio_{q:.0%}_{gain}_gain".replace("%", "pct")
                    row[key], row[f"{key}_lo"], row[f"{key}_hi"] = value, lo, hi
            row["crossovers"] = crossovers(recipe, self.base, low, high)
            row["verdict"], row["verdict_reason"] = contrast.verdict, contrast.reason
            row["needs"] = contrast.needs
            row["power"] = contrast.power
            row["power_designs"] = contrast.power_designs
            variants.append(row)
        options = self.options
        return {"schema": SCHEMA, "curve": self.metric, "compute_unit": "GPU-hours", "level": options.level,
                "rule": RULE, "options": {"min_compute": options.min_compute, "fit_until": options.fit_until,
                                          "method": options.method, "budgets": sorted(options.budgets),
                                          "targets": list(options.targets), "resamples": options.resamples,
                                          "seed": options.seed, "eval_draws": options.eval_draws,
                                          "power_trials": self.power_trials,
                                          "power_designs": [d.name for d in self.power_designs]},
                "base": self._recipe_dict(self.base, self.base_compute), "variants": variants}


def make_ablation(base: list[Curve], variants: list[tuple[str, list[Curve]]], options: ForecastOptions,
                  target: float | None = None, judge_only: bool = False, power_trials: int = 0,
                  power_designs: tuple[tuple[int, int] | tuple[int, int, float], ...] = ()) -> Ablation:
    """Fit the base's seeds and each variant's (`variants`: (name, seeds) pairs; a curve's `source` is its run) with
    `options`, and judge each variant against the base (module docstring). The base is named after its first run.
    `target`, a reward in [0, 1], joins `options.targets`: the GPU-hours each recipe needs to reach it.
    `judge_only`: verdicts without saying what a too-early one would take (the simulated studies that say it).
    `power_trials`: each variant's power from that many simulated studies of this design (`design.power`; 0: none),
    and at each of `power_designs` ((seeds per recipe, completions per validation[, runs' length as a multiple of
    these]), for a study to come)."""
    power_designs = tuple(Design(*d) for d in power_designs)
    if not all(d.valid for d in power_designs):
        raise UserError(f"ablation: a design's seeds and completions per validation must be >= 1 and its length > 0, "
                        f"got {', '.join(d.name for d in power_designs)}")
    if options.resamples < 2:
        raise UserError("ablation: the verdicts need bootstrap intervals; resamples must be at least 2")
    if not base or not variants or not all(curves for _, curves in variants):
        empty = "the base" if not base else ", ".join(n for n, c in variants if not c) or "no variant"
        raise UserError(f"ablation: a base and at least one variant, each with one or more runs, are needed "
                        f"({empty} has none)")
    names = [base[0].name] + [name for name, _ in variants]
    if len(set(names)) < len(names):
        raise UserError(f"ablation: the variants' names must differ from each other and from the base's: {names}")
    runs = [*base] + [c for _, curves in variants for c in curves]
    sources = [c.source for c in runs]
    repeated = sorted({s for s in sources if sources.count(s) > 1})
    if repeated:
        raise UserError(f"ablation: the same run is given twice: {', '.join(repeated)}")
    metrics = sorted({c.metric for c in runs})
    if len(metrics) > 1:
        raise UserError(f"ablation: all runs must report one metric, got {', '.join(metrics)}")
    if target is not None:
        options = replace(options, targets=(*options.targets, target))
    seeds = iter(range(options.seed, options.seed + len(runs)))  # independent replicates for independent runs

    def recipe(name: str, curves: list[Curve]) -> ArmForecasts:
        return ArmForecasts(name, tuple(make_forecast(c, replace(options, seed=next(seeds))) for c in curves))

    base_recipe = recipe(names[0], base)
    recipes = tuple(recipe(name, curves) for name, curves in variants)
    gain_levels = {q: _gain_level(base_recipe, q) for q in GAIN_FRACTIONS}
    base_compute = {q: base_recipe.compute_to_reach(*gain_levels[q]) for q in GAIN_FRACTIONS}
    contrasts = tuple(_contrast(base_recipe, base_compute, gain_levels, r, None if judge_only else options,
                                power_trials, power_designs) for r in recipes)
    return Ablation(base_recipe, recipes, base_compute, contrasts, options, power_trials, power_designs)
