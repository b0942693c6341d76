"""The power law the paper compares against: R(C) = A - D / C ** B, fitted on the same window as the sigmoid.

For C >> C_mid the sigmoid reduces to this form with D = (A - R0) * C_mid ** B, but fitted to the rising part of a
saturating curve the power law overestimates the ceiling (the paper's appendix A.4: A = 1.0 fitted on 1.5k-50k
GPU-h where the sigmoid gives 0.645 and the run saturates near 0.65). The forecaster reports it beside the sigmoid
for that reason.

Fit: for a fixed B the model is linear in (A, D), so A and D come from linear least squares (with A <= 1, a pass rate,
and D >= 0, a rising curve); B is found by a scan over ln B followed by a bounded 1-D search around the best cell.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar

POWER_B_BOUNDS = (0.01, 5.0)


@dataclass(frozen=True)
class PowerLawFit:
    A: float  # ceiling (reward as C -> infinity), at most 1
    B: float  # exponent
    D: float  # reward units x GPU-hours ** B
    rmse: float

    def predict(self, compute) -> np.ndarray:
        """Reward at `compute` GPU-hours (> 0)."""
        return self.A - self.D * np.asarray(compute, dtype=float) ** -self.B


def _best_linear(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(A, D) minimising sum (A - D x - y)^2 subject to A <= 1 and D >= 0."""
    dx = x - x.mean()
    D = -float(dx @ (y - y.mean()) / max(dx @ dx, 1e-300))
    if D < 0:
        return float(min(y.mean(), 1.0)), 0.0
    A = float(y.mean() + D * x.mean())
    if A > 1.0:
        A, D = 1.0, max(float(x @ (1.0 - y) / max(x @ x, 1e-300)), 0.0)
    return A, D


def fit_power_law(compute, reward) -> PowerLawFit:
    """Fit R = A - D / C**B to points with compute > 0 GPU-h."""
    C = np.asarray(compute, dtype=float)
    y = np.asarray(reward, dtype=float)

    def sse(ln_b: float) -> float:
        x = C ** -np.exp(ln_b)
        A, D = _best_linear(x, y)
        return float(np.sum((A - D * x - y) ** 2))

    grid = np.linspace(np.log(POWER_B_BOUNDS[0]), np.log(POWER_B_BOUNDS[1]), 40)
    best = int(np.argmin([sse(g) for g in grid]))
    bracket = (grid[max(best - 1, 0)], grid[min(best + 1, grid.size - 1)])
    ln_b = minimize_scalar(sse, bounds=bracket, method="bounded", options={"xatol": 1e-6}).x
    B = float(np.exp(ln_b))
    A, D = _best_linear(C ** -B, y)
    return PowerLawFit(A, B, D, float(np.sqrt(sse(ln_b) / C.size)))
