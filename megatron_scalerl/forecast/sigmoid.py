"""The paper's sigmoidal compute-performance curve and the two ways to fit it.

    R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B)

C is training compute in GPU-hours, R the validation pass rate, A the ceiling, B the exponent (efficiency), C_mid the
compute at which half of the gain A - R0 is reached. R0 is not fitted: it is the starting reward (given or measured).
We write the curve as R0 + (A - R0) * expit(B * (ln C - ln C_mid)), which equals the formula above and never overflows.

Methods (both minimise the plain sum of squared reward residuals, as the paper does):
- `lsq` (default): a coarse scan over (B, ln C_mid) with A solved in closed form at each cell (for fixed B and C_mid
  the model is linear in A), then Levenberg-Marquardt over (A, B, ln C_mid) with an analytic Jacobian, started from
  each local minimum of the scan (up to three), the bounds kept by a smooth change of variables. Converges to the
  least-squares optimum in about a millisecond.
- `paper-grid`: the paper's procedure, A on {0.450, 0.455, ..., 0.800}, 100 linearly spaced C_mid in [100, 40000]
  GPU-h, B by least squares at every grid point (a 1-D golden-section search over ln B, vectorised over the grid);
  the best grid point wins. Kept as the baseline that `bench/forecast.py` measures `lsq` against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares
from scipy.special import expit

METHODS = ("lsq", "paper-grid")
B_BOUNDS = (0.05, 10.0)  # scaling exponent range searched by both methods (paper's fits: 1.1 to 2.5)
C_MID_SPAN = 100.0  # lsq searches C_mid in [min fitted C / 100, max fitted C * 100] GPU-h (unit-free)
PAPER_A_GRID = np.round(np.arange(0.450, 0.800 + 1e-9, 0.005), 3)
PAPER_C_MID_GRID = np.linspace(100.0, 40000.0, 100)  # GPU-h; the paper gives the range and the count, not the spacing


def reward_at(compute, A, B, C_mid, R0) -> np.ndarray:
    """R(C) for compute in GPU-hours (C = 0 gives R0). Parameters may be arrays that broadcast against `compute`."""
    compute = np.asarray(compute, dtype=float)
    with np.errstate(divide="ignore"):
        z = B * (np.log(compute) - np.log(C_mid))
    return R0 + (A - R0) * expit(z)


def compute_to_reach(reward, A, B, C_mid, R0) -> np.ndarray:
    """GPU-hours at which R(C) = reward; inf where the reward is at or above the ceiling A (never reached)."""
    reward, A, B, C_mid, R0 = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (reward, A, B, C_mid, R0)))
    out = np.full(reward.shape, np.inf)
    gain = (reward - R0) / np.where(A - R0 > 0, A - R0, np.nan)
    ok = (gain < 1) & (A > R0)
    out[ok & (gain <= 0)] = 0.0
    inner = ok & (gain > 0)
    out[inner] = C_mid[inner] * (gain[inner] / (1 - gain[inner])) ** (1 / B[inner])
    return out if out.ndim else float(out)


def reward_gradient(compute, A, B, C_mid, R0) -> np.ndarray:
    """Derivatives of R(C) with respect to (A, B, ln C_mid) at each `compute` (> 0 GPU-h): shape (n, 3)."""
    ln_c = np.log(np.asarray(compute, dtype=float))
    u = np.log(C_mid)
    s = expit(B * (ln_c - u))
    ds = (A - R0) * s * (1 - s)
    return np.column_stack([s, ds * (ln_c - u), -ds * B])


def slope_at(compute, A, B, C_mid, R0) -> np.ndarray:
    """dR/dC in reward per GPU-hour at `compute` (> 0)."""
    s = expit(B * (np.log(np.asarray(compute, dtype=float)) - np.log(C_mid)))
    return (A - R0) * B * s * (1 - s) / np.asarray(compute, dtype=float)


@dataclass(frozen=True)
class SigmoidFit:
    """A fitted curve. `at_bounds` names the parameters that ended on a search bound (a sign of a weak fit)."""

    A: float
    B: float
    C_mid: float  # GPU-hours
    R0: float
    rmse: float  # root-mean-square reward residual over the fitted points
    method: str
    at_bounds: tuple[str, ...] = ()

    def predict(self, compute) -> np.ndarray:
        return reward_at(compute, self.A, self.B, self.C_mid, self.R0)

    def compute_for(self, reward: float) -> float:
        return float(compute_to_reach(reward, self.A, self.B, self.C_mid, self.R0))

    def slope(self, compute: float) -> float:
        return float(slope_at(compute, self.A, self.B, self.C_mid, self.R0))


def fit_sigmoid(compute, reward, r0: float, method: str = "lsq", fixed_A: float | None = None) -> SigmoidFit:
    """Fit A, B, C_mid (or B, C_mid with `fixed_A`) to points with compute > 0 GPU-h, all in the fit window."""
    C = np.asarray(compute, dtype=float)
    y = np.asarray(reward, dtype=float)
    if method == "lsq":
        return _fit_lsq(C, y, float(r0), fixed_A)
    if method == "paper-grid":
        if fixed_A is not None:
            raise ValueError("paper-grid fits A from its grid; use method='lsq' with fixed_A")
        return _fit_paper_grid(C, y, float(r0))
    raise ValueError(f"unknown fit method {method!r}; choose one of {', '.join(METHODS)}")


def _rmse(C, y, A, B, C_mid, R0) -> float:
    return float(np.sqrt(np.mean((reward_at(C, A, B, C_mid, R0) - y) ** 2)))


# ---------------------------------------------------------------- lsq: scan with A in closed form, then polish


def _scan_starts(lnC, y, r0, u_bounds, fixed_A, max_starts=3, sse_ratio=2.0) -> list[np.ndarray]:
    """Coarse scan over (B, u = ln C_mid): the local minima (up to `max_starts`, best first, as (A, B, u) arrays)
    whose squared error is within `sse_ratio` of the best cell's."""
    b_grid = np.geomspace(*B_BOUNDS, 16)
    u_grid = np.linspace(*u_bounds, 24)
    s = expit(b_grid[:, None, None] * (lnC[None, None, :] - u_grid[None, :, None]))  # (nB, nU, n)
    if fixed_A is None:  # best gain a = A - R0 for each cell, by linear least squares, kept inside [0, 1 - R0]
        a = np.einsum("bun,n->bu", s, y - r0) / np.maximum(np.einsum("bun,bun->bu", s, s), 1e-300)
        a = np.clip(a, 0.0, 1.0 - r0)
    else:
        a = np.full(s.shape[:2], fixed_A - r0)
    sse = np.sum((r0 + a[..., None] * s - y) ** 2, axis=-1)
    padded = np.pad(sse, 1, constant_values=np.inf)
    neighbours = np.stack([padded[1 + di:1 + di + sse.shape[0], 1 + dj:1 + dj + sse.shape[1]]
                           for di in (-1, 0, 1) for dj in (-1, 0, 1) if di or dj])
    minima = np.argwhere(sse <= neighbours.min(axis=0))
    minima = minima[np.argsort(sse[minima[:, 0], minima[:, 1]])][:max_starts]
    minima = minima[sse[minima[:, 0], minima[:, 1]] <= sse_ratio * sse[minima[0, 0], minima[0, 1]]]
    return [np.array([r0 + a[i, j], b_grid[i], u_grid[j]]) for i, j in minima]


def _fit_lsq(C, y, r0, fixed_A) -> SigmoidFit:
    """Levenberg-Marquardt (MINPACK) on box-bounded parameters p = lo + (hi - lo) * expit(q), q unbounded."""
    lnC = np.log(C)
    u_bounds = (lnC.min() - np.log(C_MID_SPAN), lnC.max() + np.log(C_MID_SPAN))
    lower = np.array([r0, B_BOUNDS[0], u_bounds[0]])
    upper = np.array([1.0, B_BOUNDS[1], u_bounds[1]])
    free = slice(1, 3) if fixed_A is not None else slice(0, 3)  # which of (A, B, u) are fitted
    lo, span = lower[free], (upper - lower)[free]

    def params(q):  # (A, B, u) from the unbounded variables
        p = np.array([fixed_A, 0.0, 0.0]) if fixed_A is not None else np.empty(3)
        p[free] = lo + span * expit(q)
        return p

    def residuals(q):
        A, B, u = params(q)
        return r0 + (A - r0) * expit(B * (lnC - u)) - y

    def jacobian(q):
        A, B, u = params(q)
        d_params = reward_gradient(C, A, B, np.exp(u), r0)[:, free]
        e = expit(q)
        return d_params * (span * e * (1 - e))

    best = None
    for start in _scan_starts(lnC, y, r0, u_bounds, fixed_A):
        inside = np.clip((start[free] - lo) / span, 1e-3, 1 - 1e-3)  # a start on a bound would never move
        result = least_squares(residuals, np.log(inside / (1 - inside)), jac=jacobian, method="lm")
        if best is None or result.cost < best.cost:
            best = result
    A, B, u = params(best.x)
    fitted = lo + span * expit(best.x)
    names = ("A", "B", "C_mid")[free]
    at_bounds = tuple(name for name, f in zip(names, (fitted - lo) / span, strict=True) if min(f, 1 - f) <= 1e-3)
    return SigmoidFit(float(A), float(B), float(np.exp(u)), r0, _rmse(C, y, A, B, np.exp(u), r0), "lsq", at_bounds)


# ---------------------------------------------------------------- paper-grid baseline


def _golden_section_min(objective, lo: np.ndarray, hi: np.ndarray, tol: float) -> np.ndarray:
    """Elementwise minimiser of `objective` over [lo, hi] (arrays of one shape), golden-section search."""
    ratio = (np.sqrt(5.0) - 1.0) / 2.0
    a, b = lo.copy(), hi.copy()
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = objective(c), objective(d)
    for _ in range(int(np.ceil(np.log(tol / np.max(hi - lo)) / np.log(ratio)))):
        left = fc < fd  # the minimum lies in [a, d]
        a, b = np.where(left, a, c), np.where(left, d, b)
        new_x = np.where(left, b - ratio * (b - a), a + ratio * (b - a))
        f_new = objective(new_x)
        c, d, fc, fd = (np.where(left, new_x, d), np.where(left, c, new_x),
                        np.where(left, f_new, fd), np.where(left, fc, f_new))
    return (a + b) / 2.0


def _fit_paper_grid(C, y, r0) -> SigmoidFit:
    A = PAPER_A_GRID[:, None, None]
    ln_c_mid = np.log(PAPER_C_MID_GRID)[None, :, None]
    lnC = np.log(C)[None, None, :]

    def sse(ln_b):  # ln_b: (nA, nC) -> sum of squared residuals at each grid point
        return np.sum((r0 + (A - r0) * expit(np.exp(ln_b)[..., None] * (lnC - ln_c_mid)) - y) ** 2, axis=-1)

    shape = (PAPER_A_GRID.size, PAPER_C_MID_GRID.size)
    ln_b = _golden_section_min(sse, np.full(shape, np.log(B_BOUNDS[0])), np.full(shape, np.log(B_BOUNDS[1])), 1e-4)
    i, j = np.unravel_index(np.argmin(sse(ln_b)), shape)
    A_best, B_best, c_mid = float(PAPER_A_GRID[i]), float(np.exp(ln_b[i, j])), float(PAPER_C_MID_GRID[j])
    at_bounds = tuple(name for name, k, last in (("A", i, shape[0] - 1), ("C_mid", j, shape[1] - 1)) if k in (0, last))
    return SigmoidFit(A_best, B_best, c_mid, r0, _rmse(C, y, A_best, B_best, c_mid, r0), "paper-grid", at_bounds)
