"""Synthetic validation curves from the paper's fitted parameters, with realistic evaluation noise.

Use them to test the forecaster, to benchmark fit methods, or to plan: "if our run behaves like the paper's 8B run,
what does a fit at 8k GPU-h tell us about 50k?".

A curve is the sigmoid R(C) (see `sigmoid.reward_at`) sampled at evenly spaced compute points, observed through
1. evaluation noise: mean@16 on 1,000 prompts, i.e. Binomial(16 x 1000, p) / 16000 around the run's pass rate p;
2. run-to-run drift: a slow wander of the run's pass rate around the curve, an AR(1) process that starts at 0 at
   C = 0 (the base model), with stationary standard deviation `drift_sd` and correlation `drift_corr` between
   consecutive evaluations, so no two seeds give the same run even at the same parameters.
With the defaults (drift 0.005 sd, correlation 0.8) the A fitted to one run's seeds spreads by about +-0.01 (the
math+code "code" curve, still far from its ceiling at its budget, by about +-0.02), the order of the +-0.015 the paper
measured across three identical runs.

`replicate_run` goes one step further and varies the parameters themselves, as a rerun of the same recipe would:
benchmarks use it so that the true parameters do not sit exactly on the published values (several published C_mid lie
within 1% of the paper-grid's C_mid values, which would flatter that method). `simulate_run` also returns the
pass rate and drift under the evaluations: the truth that forecast intervals are calibrated against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_scalerl.forecast.data import DEFAULT_METRIC, Curve
from megatron_scalerl.forecast.sigmoid import reward_at

DEFAULT_R0 = 0.30  # starting pass rate; the paper does not report R0 (its plots start near 0.3-0.4)


@dataclass(frozen=True)
class PaperRun:
    """One row of the paper's table of fitted curves. `budget` (GPU-h) is the compute its run used, as we read it."""

    name: str
    C_mid: float  # GPU-hours
    B: float
    A: float
    budget: float  # GPU-hours


TABLE1: tuple[PaperRun, ...] = (
    PaperRun("scalerl-8b-14k-gen", 2542, 1.92, 0.610, 16000),
    PaperRun("scalerl-8b-32k-gen", 11272, 1.89, 0.645, 50000),
    PaperRun("8-gens-per-prompt", 2542, 2.44, 0.585, 16000),
    PaperRun("24-gens-per-prompt", 3054, 2.22, 0.590, 16000),
    PaperRun("32-gens-per-prompt", 2936, 2.07, 0.595, 16000),
    PaperRun("moe-17bx16-scout", 4242, 1.65, 0.710, 50000),
    PaperRun("batch-512", 2818, 1.77, 0.605, 16000),
    PaperRun("batch-2048-100k", 10909, 1.70, 0.645, 100000),
    PaperRun("math+code-math", 2896, 2.05, 0.595, 16000),
    PaperRun("math+code-code", 1675, 1.09, 0.615, 16000),
)


def paper_run(name: str) -> PaperRun:
    for run in TABLE1:
        if run.name == name:
            return run
    raise KeyError(f"no paper run {name!r}; known: {', '.join(r.name for r in TABLE1)}")


def replicate_run(run: PaperRun, seed: int, a_spread: float = 0.015, c_mid_spread: float = 0.15,
                  b_spread: float = 0.10) -> PaperRun:
    """Another run of the same recipe: A +- `a_spread` (the paper's run-to-run margin), C_mid and B within relative
    +-`c_mid_spread` and +-`b_spread` (our assumption; the paper does not measure them), drawn uniformly."""
    rng = np.random.default_rng([seed, 7])
    return PaperRun(f"{run.name}-rerun{seed}", run.C_mid * (1 + rng.uniform(-c_mid_spread, c_mid_spread)),
                    run.B * (1 + rng.uniform(-b_spread, b_spread)), run.A + rng.uniform(-a_spread, a_spread),
                    run.budget)


def true_reward(run: PaperRun, compute, r0: float = DEFAULT_R0) -> np.ndarray:
    """The noiseless curve of `run` at `compute` GPU-hours."""
    return reward_at(compute, run.A, run.B, run.C_mid, r0)


@dataclass(frozen=True)
class SyntheticRun:
    """A simulated run: its noisy evaluations and what lies under them, each of shape (num_evals,)."""

    curve: Curve  # the evaluations: compute (GPU-hours) and the observed mean@k reward
    pass_rate: np.ndarray  # the run's own pass rate p: the sigmoid plus its drift (an infinitely precise evaluation)
    drift: np.ndarray  # p minus the noiseless sigmoid


def simulate_run(run: PaperRun, seed: int = 0, r0: float = DEFAULT_R0, budget: float | None = None,
                 num_evals: int = 81, prompts: int = 1000, samples_per_prompt: int = 16,
                 drift_sd: float = 0.005, drift_corr: float = 0.8) -> SyntheticRun:
    """`num_evals` noisy evaluations of `run`, evenly spaced over [0, budget] GPU-h (budget defaults to the run's),
    with the pass rate and drift they were drawn from."""
    rng = np.random.default_rng(seed)
    compute = np.linspace(0.0, budget or run.budget, num_evals)
    drift = np.zeros(num_evals)
    innovation_sd = drift_sd * np.sqrt(1.0 - drift_corr**2)
    for i in range(1, num_evals):
        drift[i] = drift_corr * drift[i - 1] + rng.normal(0.0, innovation_sd)
    p = np.clip(true_reward(run, compute, r0) + drift, 0.0, 1.0)
    draws = prompts * samples_per_prompt
    reward = rng.binomial(draws, p) / draws
    curve = Curve.from_arrays(compute, reward, name=f"{run.name}-seed{seed}", metric=DEFAULT_METRIC,
                              source=f"synthetic:{run.name}:seed{seed}", compute_rule="synthetic")
    return SyntheticRun(curve, p, drift)


def synthetic_curve(run: PaperRun, seed: int = 0, **options) -> Curve:
    """The evaluations of `simulate_run(run, seed, **options)`."""
    return simulate_run(run, seed, **options).curve
