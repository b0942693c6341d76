"""Bootstrap confidence intervals for the sigmoid's parameters and for anything computed from them.

Method: a moving-block residual bootstrap. The base fit's residuals (centred, and scaled by sqrt(n / (n - 3)) for the
three fitted parameters) are resampled in blocks of consecutive evaluations, so the slow drift of a run (neighbouring
evaluations err together) survives the resampling; each replicate is fitted curve + resampled residuals, refitted
with the same method. When R0 is measured (the first evaluation) it is a noisy observation too, so each replicate
also perturbs R0 by one resampled residual; a given R0 stays fixed. Intervals are percentile intervals.

The paper estimated the run-to-run margin on A as +-0.02 from three identical runs; the bootstrap measures only the
noise inside one run, so reports show both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_scalerl.forecast.sigmoid import SigmoidFit, compute_to_reach, fit_sigmoid, reward_at, slope_at


@dataclass(frozen=True)
class Bootstrap:
    """Parameter draws, one per replicate: arrays of shape (k,)."""

    A: np.ndarray
    B: np.ndarray
    C_mid: np.ndarray  # GPU-hours
    R0: np.ndarray
    residuals: np.ndarray  # the scaled, centred residuals of the base fit, shape (n,)
    block_length: int
    level: float  # e.g. 0.95
    seed: int

    @property
    def resamples(self) -> int:
        return int(self.A.size)

    def interval(self, values) -> tuple[float, float]:
        return interval(values, self.level)

    def rewards(self, compute) -> np.ndarray:
        """Predicted reward of each replicate at `compute` GPU-hours: shape (k, len(compute))."""
        compute = np.atleast_1d(np.asarray(compute, dtype=float))
        return reward_at(compute[None, :], *(p[:, None] for p in (self.A, self.B, self.C_mid, self.R0)))

    def compute_to_reach(self, reward: float) -> np.ndarray:
        """GPU-hours each replicate needs to reach `reward` (inf where it never does): shape (k,)."""
        return compute_to_reach(reward, self.A, self.B, self.C_mid, self.R0)

    def slopes(self, compute: float) -> np.ndarray:
        """dR/dC of each replicate at `compute` GPU-hours: shape (k,)."""
        return slope_at(compute, self.A, self.B, self.C_mid, self.R0)

    def observation_interval(self, compute) -> tuple[np.ndarray, np.ndarray]:
        """Interval for a new evaluation at each `compute`: curve uncertainty plus one resampled residual."""
        draws = self.rewards(compute)
        rng = np.random.default_rng(self.seed + 1)
        draws = draws + rng.choice(self.residuals, size=draws.shape)
        tail = (1.0 - self.level) / 2.0
        return np.quantile(draws, tail, axis=0), np.quantile(draws, 1.0 - tail, axis=0)


def interval(values, level: float) -> tuple[float, float]:
    """Central percentile interval; inf draws (e.g. a target never reached) make the upper end inf, not NaN."""
    values = np.asarray(values, dtype=float)
    tail = (1.0 - level) / 2.0
    method = "linear" if np.all(np.isfinite(values)) else "inverted_cdf"
    lo, hi = np.quantile(values, [tail, 1.0 - tail], method=method)
    return float(lo), float(hi)


def bootstrap_sigmoid(compute, reward, base: SigmoidFit, r0_measured: bool, resamples: int = 200,
                      level: float = 0.95, seed: int = 0) -> Bootstrap:
    """Refit `resamples` block-resampled replicates of the fitted points with `base.method`."""
    compute = np.asarray(compute, dtype=float)
    reward = np.asarray(reward, dtype=float)
    n = compute.size
    fitted = base.predict(compute)
    residuals = reward - fitted
    residuals = (residuals - residuals.mean()) * np.sqrt(n / max(n - 3, 1))
    block = max(1, round(n ** (1.0 / 3.0)))
    rng = np.random.default_rng(seed)
    draws = np.empty((resamples, 4))
    for k in range(resamples):
        starts = rng.integers(0, n - block + 1, size=-(-n // block))
        picked = (starts[:, None] + np.arange(block)[None, :]).ravel()[:n]
        replicate = np.clip(fitted + residuals[picked], 0.0, 1.0)
        r0 = base.R0 + (rng.choice(residuals) if r0_measured else 0.0)
        r0 = float(np.clip(r0, 0.0, 1.0 - 1e-6))
        fit = fit_sigmoid(compute, replicate, r0, base.method)
        draws[k] = fit.A, fit.B, fit.C_mid, fit.R0
    return Bootstrap(*draws.T, residuals=residuals, block_length=block, level=level, seed=seed)
