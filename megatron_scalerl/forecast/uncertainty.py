"""Bootstrap intervals for the sigmoid's parameters and for the run's pass rate, from a noise model of the run.

Noise model: an evaluation at compute C (GPU-hours) reads y(C) = R(C) + d(C) + e(C), where
- R(C) is the sigmoid (`sigmoid.reward_at`);
- d(C) is the run's drift: a stationary Gaussian process with sd `drift_sd` and correlation exp(-|C - C'| / scale)
  between two evaluations (an Ornstein-Uhlenbeck process in compute; on evenly spaced evaluations it is the AR(1)
  process of `synthetic.simulate_run`, with correlation `drift_corr` between neighbours);
- e(C) is evaluation noise, independent between evaluations: variance p (1 - p) / eval_draws for a mean over
  `eval_draws` = prompts x samples scored completions when that is given (for a fixed prompt set whose prompts differ
  in difficulty this is an upper bound), else one sd estimated from the data.
The run's pass rate p(C) = R(C) + d(C) is what an infinitely precise evaluation of this run would read.

Estimation: a run of ~40 evaluations holds only a few independent stretches of a slow drift, so the noise parameters
(drift sd, drift correlation between neighbouring evaluations, evaluation sd when not given) are uncertain, and each
replicate draws its own from their posterior: the restricted (REML) likelihood of the base fit's residuals, i.e. the
Gaussian likelihood of their part orthogonal to the fit's Jacobian (which accounts for the part of the drift the fitted
parameters absorb; plain residual moments underestimate a slow drift badly), evaluated on grids, times the priors
below. Plugging in one estimate instead leaves the intervals too narrow on runs whose drift happens to look small (in
development, a plug-in REML estimate covered the pass rate on about 78% of synthetic runs, against 93% for the
posterior draws).

Priors. A drift slower than the fitted window is largely absorbed by the fitted A, B and C_mid, so the residuals
barely tell a slow large drift from a fast small one; along that ridge the likelihood is flat and the prior sets the
intervals, of A above all. Hence:
- drift correlation: log-uniform in its correlation length, from 0.3 to 30 evaluation spacings (no time scale
  preferred, whatever the evaluation frequency), times the AR(1) Jeffreys factor (1 - corr^2)^(-1/2);
- drift sd: exponential with mean min(1.5 x the residual rms, 0.02): a drift far above the scatter the fit leaves, or
  above the paper's run-to-run margin on A (+-0.02 between identical runs), would show;
- evaluation sd, when estimated: uniform.
The priors used before (uniform in each sd up to the grid's end and uniform in the neighbour correlation) favoured
fast drifts and let the grid's edge bound the slow ones: on runs whose drift correlation is 0.9, A's interval covered
the true A on 89% of fits to budget / 2 (calibration below).

Replicates: each draws a drift path and evaluation noise from the model, adds them to the fitted curve (a measured R0,
the first evaluation, gets evaluation noise too; a given R0 stays fixed) and refits with the base method.

Intervals (all at `level`):
- parameters (A, B, C_mid, R0), compute to reach a reward, slopes: percentile intervals over the refitted curves;
- the run's pass rate p(C) (`rewards`), the quantity predictions target: in each replicate the forecast error is the
  refitted curve minus the replicate's own pass rate, i.e. the fitted curve plus the replicate's drift, continued past
  the fitted window by the drift model (so a prediction far beyond the window carries the drift's full variance at
  that horizon, and one just past it the drift's persistence). The draws are the fitted curve minus those errors
  (a basic bootstrap), so their percentile interval is the prediction interval for p(C). Being wider than an interval
  for R(C) alone, it covers the noiseless curve too (bench/forecast.py measures both). Past the fitted window each
  draw of the sigmoid is its running maximum from the window's last point on (`sigmoid_draws`): R never falls, so
  neither may a draw beyond the data. Reflected, the refits' upward spread of A (wide on a run near its ceiling)
  became draws far below what the run had shown: the demo's report once gave [0.324, 0.663] at 1 GPU-h after
  reading 0.527 at 0.15 GPU-h;
- a new evaluation (`observation_interval`, backtests): the pass-rate draws plus evaluation noise.

Calibration (`OMP_NUM_THREADS=1 .venv/bin/python bench/forecast.py [--drift-corr RHO]`, 100 replicates, nominal 95%;
docs/benchmarks.md has the tables, CHANGELOG.md the figures before). 200 reruns of Table 1 with AR(1) drift of correlation
0.5-0.9 and binomial noise: fit on [1.5k GPU-h, budget / 2], the interval at the budget covers the run's pass rate
on 96.5-97% of runs (93.5-94.5% with the priors before, 63% with the moving-block residual bootstrap before that);
A's interval covers the true A on 96.7% of fits (both windows), 95.5-99.1% per window and correlation half. Every
drift at correlation 0.9: A 92.7% (budget / 2) and 96.0% (budget), the pass rate 91-92% (before: 89.2%, 92.5%,
87.5-90.5%); at 0.5: A 97.5%, the pass rate 97-98%. 200 demo-like runs (16 evaluations to 0.15 GPU-h, 64 prompts x
4 samples, the bench's `small_runs`): A covered on 98%; the pass rate at 1 GPU-h on 95.9% of the runs past 90% of
their gain (before 96.7%, with intervals twice as wide) and on 75.6% of those still rising (before 82.1%); the lower
end there a median 0.048 below the mean of the last 4 evaluations (before 0.171).

The paper estimated the run-to-run margin on A as +-0.02 from three identical runs; the bootstrap models the noise
inside one run, so reports show both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_scalerl.forecast.sigmoid import (
    SigmoidFit,
    compute_to_reach,
    fit_sigmoid,
    reward_at,
    reward_gradient,
    slope_at,
)

# Grids on which the posterior of the noise parameters is evaluated, each draw spread over its cell; the priors
# (module docstring, "Priors") weight the cells.
DRIFT_SD_GRID = np.geomspace(0.03, 3.0, 14)  # x the residual rms: drift sd, evaluation noise known
DRIFT_RATIO_GRID = np.geomspace(0.05, 10.0, 14)  # drift sd / evaluation sd, evaluation noise estimated
EVAL_SD_GRID = np.geomspace(0.1, 1.5, 9)  # x the residual rms: evaluation sd, when estimated
DRIFT_SCALE_GRID = np.geomspace(0.3, 30.0, 17)  # drift correlation length, in median spacings between evaluations
DRIFT_CORR_GRID = np.exp(-1.0 / DRIFT_SCALE_GRID)  # drift correlation between evaluations a median spacing apart
DRIFT_SD_SCALE = 1.5  # prior mean of the drift sd, x the residual rms ...
DRIFT_SD_CAP = 0.02  # ... or this many pass-rate units if fewer: the paper's run-to-run margin on A (+-0.02)
CORR_PRIOR_POWER = 0.5  # x (1 - corr^2)^(-power) on top of log-uniform in the scale: 0.5 is the AR(1) Jeffreys
ENVELOPE_POINTS = 64  # log-spaced points from the last fitted compute on, for the draws' running maximum


@dataclass(frozen=True)
class NoiseModel:
    """Noise parameters (module docstring), one set per row: arrays of shape (k,). Rewards in pass-rate units."""

    drift_sd: np.ndarray  # stationary sd of the drift d(C)
    drift_corr: np.ndarray  # correlation of the drift between evaluations `spacing` GPU-h apart
    eval_sd: np.ndarray  # sd of one evaluation's noise (when eval_draws is given: its rms over the fit)
    spacing: float  # GPU-hours: the median gap between the fitted evaluations
    eval_draws: int | None = None  # scored completions per evaluation (prompts x samples per prompt), when given

    def correlation(self, gap) -> np.ndarray:
        """Drift correlation of each row between evaluations `gap` GPU-hours apart: shape (k, *gap.shape)."""
        gap = np.abs(np.asarray(gap, dtype=float)) / self.spacing
        return self.drift_corr.reshape((-1,) + (1,) * gap.ndim) ** gap

    def eval_variance(self, pass_rate) -> np.ndarray:
        """Variance of one evaluation of a run at `pass_rate`, shape (k, ...), row i under parameter set i."""
        pass_rate = np.clip(np.asarray(pass_rate, dtype=float), 0.0, 1.0)
        if self.eval_draws is not None:
            return pass_rate * (1.0 - pass_rate) / self.eval_draws
        return np.broadcast_to(self.eval_sd.reshape((-1,) + (1,) * (pass_rate.ndim - 1)) ** 2, pass_rate.shape)

    def summary(self) -> dict:
        """Medians over the rows; the drift's correlation scale in GPU-hours (correlation falls by e)."""
        corr = float(np.median(self.drift_corr))
        return {"drift_sd": float(np.median(self.drift_sd)), "drift_corr": corr, "spacing_gpu_hours": self.spacing,
                "drift_scale_gpu_hours": -self.spacing / np.log(corr), "eval_sd": float(np.median(self.eval_sd)),
                "eval_sd_source": "estimated" if self.eval_draws is None else "eval_draws"}


def sample_noise(compute, residuals, gradient, fitted, size: int, rng: np.random.Generator,
                 eval_draws: int | None = None) -> NoiseModel:
    """`size` draws of the noise parameters from their posterior given a fit's `residuals` at `compute` (GPU-h,
    increasing), shape (n,): the restricted likelihood on the grids above, times the priors. `gradient` (n, p) is
    the fit's Jacobian (`sigmoid.reward_gradient`), `fitted` (n,) the fitted rewards."""
    compute, residuals = np.asarray(compute, dtype=float), np.asarray(residuals, dtype=float)
    left, singular, _ = np.linalg.svd(gradient, full_matrices=True)
    basis = left[:, int(np.sum(singular > max(singular[0], 1e-300) * 1e-9)):]  # contrasts the fit does not touch
    contrasts = basis.T @ residuals
    spacing = float(np.median(np.diff(compute)))
    gap = np.abs(compute[:, None] - compute[None, :]) / spacing  # in median spacings
    rms = max(float(np.sqrt(np.mean(residuals**2))), 1e-6)
    # covariance = v (a^2 corr^gap + diag(white)). Known evaluation noise: white = its variances, v = 1, a = drift sd.
    # Estimated: white = 1, v = its variance (in closed form once the (a, corr) grid is factorised), a = drift / eval sd
    if eval_draws is not None:
        p = np.clip(fitted, 0.0, 1.0)
        white, a_grid, eval_sd = p * (1.0 - p) / eval_draws, DRIFT_SD_GRID * rms, None
    else:
        white, a_grid, eval_sd = np.ones(compute.size), DRIFT_RATIO_GRID, EVAL_SD_GRID * rms
    a, corr = (g.ravel() for g in np.meshgrid(a_grid, DRIFT_CORR_GRID, indexing="ij"))
    reduced = basis.T @ (a[:, None, None] ** 2 * corr[:, None, None] ** gap + np.diag(white)) @ basis
    _, logdet = np.linalg.slogdet(reduced)
    quad = np.einsum("i,gi->g", contrasts, np.linalg.solve(reduced, contrasts[None, :, None])[..., 0])
    v = np.ones(1) if eval_sd is None else eval_sd**2
    loglik = -0.5 * (contrasts.size * np.log(v)[None, :] + logdet[:, None] + quad[:, None] / v[None, :])
    drift_sd = a[:, None] * (1.0 if eval_sd is None else eval_sd[None, :])
    prior = (drift_sd * (1.0 if eval_sd is None else eval_sd[None, :])  # the log grids' cell widths
             * np.exp(-drift_sd / min(DRIFT_SD_SCALE * rms, DRIFT_SD_CAP))
             * (1.0 - corr[:, None] ** 2) ** -CORR_PRIOR_POWER)
    weight = (np.exp(loglik - loglik.max()) * prior).ravel()
    cell, col = np.divmod(rng.choice(weight.size, size=size, p=weight / weight.sum()), v.size)
    jitter = rng.uniform(-0.5, 0.5, size=(3, size))  # spread each draw over its grid cell
    a_draw = a[cell] * np.exp(jitter[0] * np.log(a_grid[1] / a_grid[0]))
    corr_draw = corr[cell] ** np.exp(-jitter[1] * np.log(DRIFT_SCALE_GRID[1] / DRIFT_SCALE_GRID[0]))  # log scale
    if eval_sd is None:
        return NoiseModel(a_draw, corr_draw, np.full(size, float(np.sqrt(np.mean(white)))), spacing, eval_draws)
    sd_draw = eval_sd[col] * np.exp(jitter[2] * np.log(EVAL_SD_GRID[1] / EVAL_SD_GRID[0]))
    return NoiseModel(a_draw * sd_draw, corr_draw, sd_draw, spacing)


@dataclass(frozen=True)
class Bootstrap:
    """Replicates of a fit: parameter draws of shape (k,), and the drift path each replicate was drawn with."""

    A: np.ndarray
    B: np.ndarray
    C_mid: np.ndarray  # GPU-hours
    R0: np.ndarray
    base: SigmoidFit  # the fit to the data, which the replicates were drawn around
    noise: NoiseModel  # the noise parameters of each replicate
    compute: np.ndarray  # GPU-hours of the fitted evaluations, shape (n,)
    drift: np.ndarray  # each replicate's drift at `compute`, shape (k, n)
    continuation: np.ndarray  # one standard normal per replicate, shape (k,): its drift's innovation off the window
    level: float  # e.g. 0.95
    seed: int

    @property
    def resamples(self) -> int:
        return int(self.A.size)

    def interval(self, values) -> tuple[float, float]:
        return interval(values, self.level)

    def curves(self, compute) -> np.ndarray:
        """Each replicate's refitted curve at `compute` GPU-hours: shape (k, len(compute))."""
        compute = np.atleast_1d(np.asarray(compute, dtype=float))
        return reward_at(compute[None, :], *(p[:, None] for p in (self.A, self.B, self.C_mid, self.R0)))

    def drift_at(self, compute) -> np.ndarray:
        """Each replicate's drift at `compute` GPU-hours, shape (k, len(compute)): interpolated inside the fitted
        window, continued by the drift model (decaying from the nearest end, plus the innovation) outside it."""
        compute = np.atleast_1d(np.asarray(compute, dtype=float))
        x = self.compute
        upper = np.clip(np.searchsorted(x, compute), 1, x.size - 1)
        weight = np.clip((compute - x[upper - 1]) / (x[upper] - x[upper - 1]), 0.0, 1.0)
        inside = self.drift[:, upper - 1] * (1 - weight) + self.drift[:, upper] * weight
        anchor = np.where(compute > x[-1], self.drift[:, [-1]], self.drift[:, [0]])
        corr = self.noise.correlation(np.maximum(compute - x[-1], x[0] - compute).clip(min=0.0))
        outside = anchor * corr + np.sqrt(1 - corr**2) * (self.noise.drift_sd * self.continuation)[:, None]
        return np.where((compute < x[0]) | (compute > x[-1]), outside, inside)

    def sigmoid_draws(self, compute) -> np.ndarray:
        """Draws of the sigmoid R(C) at `compute` GPU-hours, shape (k, len(compute)): the fitted curve minus each
        replicate's error (its refitted curve minus the fitted one), and past the fitted window their running maximum
        from its last point on (module docstring: R never falls, so neither may a draw beyond the data)."""
        compute = np.atleast_1d(np.asarray(compute, dtype=float))
        draws = 2 * self.base.predict(compute)[None, :] - self.curves(compute)
        beyond = compute > self.compute[-1]
        if beyond.any():  # the running maximum on a log grid from the last fitted point, holding each C asked for
            grid = np.union1d(np.geomspace(self.compute[-1], compute[beyond].max(), ENVELOPE_POINTS), compute[beyond])
            envelope = np.maximum.accumulate(2 * self.base.predict(grid)[None, :] - self.curves(grid), axis=1)
            draws[:, beyond] = envelope[:, np.searchsorted(grid, compute[beyond])]
        return draws

    def rewards(self, compute) -> np.ndarray:
        """Draws of the run's pass rate p(C) at `compute` GPU-hours, shape (k, len(compute)), pass-rate units:
        `sigmoid_draws` plus each replicate's drift (`drift_at`), kept in [0, 1] (a pass rate; on a small noisy run
        the error draws alone would reach below 0)."""
        return np.clip(self.sigmoid_draws(compute) + self.drift_at(compute), 0.0, 1.0)

    def compute_to_reach(self, reward: float) -> np.ndarray:
        """GPU-hours each refitted curve needs to reach `reward` (inf where it never does): shape (k,)."""
        return compute_to_reach(reward, self.A, self.B, self.C_mid, self.R0)

    def slopes(self, compute: float) -> np.ndarray:
        """dR/dC of each refitted curve at `compute` GPU-hours: shape (k,)."""
        return slope_at(compute, self.A, self.B, self.C_mid, self.R0)

    def observation_interval(self, compute) -> tuple[np.ndarray, np.ndarray]:
        """Interval for a new evaluation at each `compute` (GPU-h): pass-rate draws plus evaluation noise."""
        draws = self.rewards(compute)
        rng = np.random.default_rng(self.seed + 1)
        draws = draws + rng.standard_normal(draws.shape) * np.sqrt(self.noise.eval_variance(draws))
        tail = (1.0 - self.level) / 2.0
        return np.quantile(draws, tail, axis=0), np.quantile(draws, 1.0 - tail, axis=0)


def interval(values, level: float) -> tuple[float, float]:
    """Central percentile interval; inf draws (e.g. a target never reached) make the upper end inf, not NaN."""
    values = np.asarray(values, dtype=float)
    tail = (1.0 - level) / 2.0
    method = "linear" if np.all(np.isfinite(values)) else "inverted_cdf"
    lo, hi = np.quantile(values, [tail, 1.0 - tail], method=method)
    return float(lo), float(hi)


def drift_paths(noise: NoiseModel, compute: np.ndarray, normals: np.ndarray) -> np.ndarray:
    """Stationary drift paths at `compute` (GPU-h, increasing, shape (n,)), row i with noise parameters i, from
    standard normals of shape (k, n)."""
    paths = np.empty_like(normals)
    paths[:, 0] = noise.drift_sd * normals[:, 0]
    corr = noise.correlation(np.diff(compute))  # (k, n - 1)
    for i in range(1, compute.size):
        paths[:, i] = corr[:, i - 1] * paths[:, i - 1] + np.sqrt(1 - corr[:, i - 1] ** 2) * noise.drift_sd * normals[:, i]
    return paths


def bootstrap_sigmoid(compute, reward, base: SigmoidFit, r0_measured: bool, resamples: int = 200,
                      level: float = 0.95, seed: int = 0, eval_draws: int | None = None) -> Bootstrap:
    """Refit `resamples` replicates of the fitted points (compute in GPU-h, shape (n,)) drawn from the noise model,
    its parameters from their posterior given `base`'s residuals; `eval_draws` (prompts x samples per evaluation)
    fixes the evaluation noise."""
    compute = np.asarray(compute, dtype=float)
    reward = np.asarray(reward, dtype=float)
    fitted = base.predict(compute)
    gradient = reward_gradient(compute, base.A, base.B, base.C_mid, base.R0)
    rng = np.random.default_rng(seed)
    noise = sample_noise(compute, reward - fitted, gradient, fitted, resamples, rng, eval_draws)
    drift = drift_paths(noise, compute, rng.standard_normal((resamples, compute.size)))
    pass_rate = np.clip(fitted + drift, 0.0, 1.0)
    replicates = np.clip(pass_rate + rng.standard_normal(pass_rate.shape) * np.sqrt(noise.eval_variance(pass_rate)),
                         0.0, 1.0)
    r0_noise = rng.standard_normal(resamples) * np.sqrt(noise.eval_variance(np.full((resamples, 1), base.R0))[:, 0])
    r0 = np.clip(base.R0 + r0_noise * r0_measured, 0.0, 1.0 - 1e-6)
    draws = np.empty((resamples, 4))
    for k in range(resamples):
        fit = fit_sigmoid(compute, replicates[k], r0[k], base.method)
        draws[k] = fit.A, fit.B, fit.C_mid, fit.R0
    return Bootstrap(*draws.T, base=base, noise=noise, compute=compute, drift=drift,
                     continuation=rng.standard_normal(resamples), level=level, seed=seed)
