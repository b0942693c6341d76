"""Load a compute-vs-reward curve from a run directory, a metrics JSON Lines file or a wandb CSV export, and check it.

Input shapes:
- a run directory: its `metrics.jsonl`;
- JSON Lines (`.jsonl`, `.json`, anything not `.csv`): one object per line. Rows without the metric (training-step
  rows between evaluations) are skipped; every row that has the metric must have a compute value;
- CSV (`.csv`, e.g. exported from wandb): a header row, then one row per logged step; an empty metric cell means
  "not evaluated at this step" and the row is skipped.

Compute is GPU-hours. It is read from the compute column (default `gpu_hours`). When a log has no such column but has
a wall clock, GPU-hours are derived with the paper's rule, wall-clock hours x every GPU the run holds (trainers and
generators alike, idle or not):

    gpu_hours = wall_seconds / 3600 * gpus

- wall_seconds: `wall_time_s` (seconds since the run started, cumulative over restarts) or wandb's `_runtime`;
- gpus: a `num_gpus` column on the row, else `--gpus N`, else the run directory's `recipe.yaml`
  ((trainer_nodes + generator_nodes) * gpus_per_node).

Checks (each a one-line `UserError` naming the file, line and column): missing columns, non-numeric or NaN/inf
values, a metric outside [0, 1], negative compute, compute that repeats or goes backwards.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import load_run_recipe
from megatron_scalerl.run.directory import RECIPE_FILE

DEFAULT_METRIC = "val/pass_rate"
DEFAULT_COMPUTE = "gpu_hours"
WALL_COLUMNS = ("wall_time_s", "_runtime")  # seconds since the run started
GPU_COUNT_COLUMN = "num_gpus"


@dataclass(frozen=True)
class Curve:
    """One run's evaluations: `compute` (GPU-hours, strictly increasing, shape (n,)) and `reward` (in [0, 1])."""

    name: str  # short label: the run directory or file stem
    source: str  # where it was loaded from, used in messages
    metric: str
    compute: np.ndarray
    reward: np.ndarray
    compute_rule: str  # how GPU-hours were obtained: the column read, or the derivation used

    @classmethod
    def from_arrays(cls, compute, reward, name: str = "curve", metric: str = DEFAULT_METRIC,
                    source: str | None = None, compute_rule: str = "given") -> Curve:
        """Build and check a curve from arrays; errors name points by index."""
        compute = np.asarray(compute, dtype=float)
        reward = np.asarray(reward, dtype=float)
        if compute.shape != reward.shape or compute.ndim != 1:
            raise UserError(f"{source or name}: compute and reward must be 1-D of one length, "
                            f"got shapes {compute.shape} and {reward.shape}")
        _check_points(compute, reward, [f"{source or name}: point {i}" for i in range(compute.size)], metric,
                      "compute")
        return cls(name, source or name, metric, compute, reward, compute_rule)

    def to_jsonl(self) -> str:
        """The curve as metrics JSON Lines (`gpu_hours` and the metric per line), loadable by `load_curve`."""
        return "".join(json.dumps({DEFAULT_COMPUTE: float(c), self.metric: float(r)}) + "\n"
                       for c, r in zip(self.compute, self.reward, strict=True))


@dataclass(frozen=True)
class MetricsTable:
    """The rows of one metrics file, read once: a caller that needs several curves of a run reads the file once."""

    path: Path  # the file read
    run_dir: Path | None  # the run directory it was found in, when one was given
    rows: list[tuple[int, dict]]  # (line number, row), in file order

    @classmethod
    def read(cls, path: str | Path) -> MetricsTable:
        """A run directory's metrics.jsonl, a JSON Lines file or a CSV export (module docstring)."""
        path = Path(path)
        run_dir = None
        if path.is_dir():
            run_dir, path = path, path / "metrics.jsonl"
            if not path.is_file():
                raise UserError(f"{run_dir}: no metrics.jsonl (expected a run directory or a metrics file)")
        elif not path.is_file():
            raise UserError(f"{path}: no such file or run directory")
        rows = _read_csv(path) if path.suffix.lower() == ".csv" else _read_jsonl(path)
        if not rows:
            raise UserError(f"{path}: no rows")
        return cls(path, run_dir, rows)

    def columns(self) -> set[str]:
        return {key for _, row in self.rows for key in row}

    def curve(self, metric: str = DEFAULT_METRIC, compute_col: str = DEFAULT_COMPUTE, gpus: int | None = None
              ) -> Curve:
        """The curve of `metric` against compute (module docstring: the GPU-hours rule and the checks)."""
        path, rows, run_dir = self.path, self.rows, self.run_dir
        evaluated = [(line, row) for line, row in rows if row.get(metric) not in (None, "")]
        if not evaluated:
            seen = sorted(self.columns())
            shown = ", ".join(seen[:15]) + (", ..." if len(seen) > 15 else "")
            raise UserError(f"{path}: no row has the metric column '{metric}' (columns: {shown}); choose one with "
                            "--metric")
        where = [f"{path}:{line}" for line, _ in evaluated]
        reward = np.array([_number(row[metric], path, line, metric) for line, row in evaluated])
        compute, rule = _gpu_hours(path, rows, evaluated, compute_col, gpus, run_dir)
        _check_points(compute, reward, where, metric, compute_col)
        if run_dir is not None:
            name = run_dir.name
        else:
            name = path.parent.name if path.name == "metrics.jsonl" else path.stem
        return Curve(name, str(run_dir or path), metric, compute, reward, rule)


def load_curve(path: str | Path, metric: str = DEFAULT_METRIC, compute_col: str = DEFAULT_COMPUTE,
               gpus: int | None = None) -> Curve:
    """Read one run's curve; see the module docstring for the accepted files and the GPU-hours rule."""
    return MetricsTable.read(path).curve(metric, compute_col, gpus)


def parse_gpu_hours(text: str, option: str) -> float:
    """'16k' -> 16000.0, '1.5M' -> 1.5e6, '2500' -> 2500.0; `option` (e.g. --budgets) is named in the error."""
    scale = {"k": 1e3, "m": 1e6}.get(text.strip()[-1:].lower(), 1.0)
    digits = text.strip()[:-1] if scale != 1.0 else text.strip()
    try:
        value = float(digits) * scale
    except ValueError:
        raise UserError(f"{option}: '{text}' is not a number of GPU-hours (e.g. 16k, 50000)") from None
    if not math.isfinite(value) or value < 0:
        raise UserError(f"{option}: '{text}' must be a finite number of GPU-hours >= 0")
    return value


# ---------------------------------------------------------------- reading


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    rows = []
    for line_no, text in enumerate(_read_text(path).splitlines(), start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
        rows.append((line_no, row))
    return rows


def _read_csv(path: Path) -> list[tuple[int, dict]]:
    reader = csv.reader(_read_text(path).splitlines())
    header = next(reader, None)
    if not header:
        raise UserError(f"{path}: empty CSV (expected a header row)")
    rows = []
    for line_no, cells in enumerate(reader, start=2):
        if len(cells) != len(header):
            raise UserError(f"{path}:{line_no}: {len(cells)} cells, the header has {len(header)}")
        rows.append((line_no, dict(zip(header, cells, strict=True))))
    return rows


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None


def _number(value, path: Path, line: int, column: str) -> float:
    """A numeric cell as float; NaN/inf are returned (and rejected by the checks with the right message)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise UserError(f"{path}:{line}: column '{column}' is not a number ({value!r})")
    try:
        return float(value)
    except ValueError:
        raise UserError(f"{path}:{line}: column '{column}' is not a number ({value!r})") from None


def _gpu_hours(path, rows, evaluated, compute_col, gpus, run_dir) -> tuple[np.ndarray, str]:
    """GPU-hours for each evaluated row, from the compute column or derived from the wall clock."""
    if any(compute_col in row for _, row in evaluated):
        for line, row in evaluated:
            if row.get(compute_col) in (None, ""):
                raise UserError(f"{path}:{line}: row has the metric but no '{compute_col}'")
        return np.array([_number(row[compute_col], path, line, compute_col) for line, row in evaluated]), compute_col
    wall = next((col for col in WALL_COLUMNS if any(col in row for _, row in evaluated)), None)
    if compute_col != DEFAULT_COMPUTE or wall is None:  # only the default column is ever derived
        derive = (f" and no wall clock ({' or '.join(WALL_COLUMNS)}) to derive GPU-hours from"
                  if compute_col == DEFAULT_COMPUTE else "")
        raise UserError(f"{path}: no compute column '{compute_col}'{derive}; choose the column with --compute-col")
    fallback_gpus, gpus_from = _gpu_count(path, evaluated, gpus, run_dir)
    hours = []
    for line, row in evaluated:
        if row.get(wall) in (None, ""):
            raise UserError(f"{path}:{line}: row has the metric but no '{wall}'")
        if GPU_COUNT_COLUMN in row:
            count = _number(row[GPU_COUNT_COLUMN], path, line, GPU_COUNT_COLUMN)
        else:
            count = fallback_gpus
        if not count or count <= 0:
            raise UserError(f"{path}:{line}: '{GPU_COUNT_COLUMN}' must be > 0, got {count}")
        hours.append(_number(row[wall], path, line, wall) / 3600.0 * count)
    return np.array(hours), f"{wall} / 3600 x GPUs ({gpus_from})"


def _gpu_count(path, evaluated, gpus, run_dir) -> tuple[float | None, str]:
    """GPU count for rows without a `num_gpus` column, and a word on where it came from."""
    if all(GPU_COUNT_COLUMN in row for _, row in evaluated):
        return None, f"column {GPU_COUNT_COLUMN}"
    if gpus is not None:
        if gpus <= 0:
            raise UserError(f"--gpus must be > 0, got {gpus}")
        return float(gpus), f"--gpus {gpus}"
    recipe = load_run_recipe(run_dir or path.parent, RECIPE_FILE, missing_ok=True)
    if recipe is not None:
        total = recipe.cluster.total_gpus
        return float(total), f"{total} from {RECIPE_FILE}"
    raise UserError(f"{path}: wall clock but no GPU count: pass --gpus N (every GPU the run holds, trainers and "
                    f"generators), log '{GPU_COUNT_COLUMN}', or keep recipe.yaml beside the metrics")


# ---------------------------------------------------------------- checks


def _check_points(compute: np.ndarray, reward: np.ndarray, where: list[str], metric: str, compute_name: str) -> None:
    """Reject NaN/inf, metrics outside [0, 1], negative compute, repeated or decreasing compute; `where[i]` names
    point i in messages (e.g. 'metrics.jsonl:12')."""
    for values, column in ((compute, compute_name), (reward, metric)):
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise UserError(f"{where[bad[0]]}: {column} is {values[bad[0]]} (must be a finite number)")
    outside = np.flatnonzero((reward < 0) | (reward > 1))
    if outside.size:
        i = outside[0]
        raise UserError(f"{where[i]}: {metric} = {reward[i]:g} is outside [0, 1] "
                        "(the forecaster fits pass rates; rescale the metric)")
    negative = np.flatnonzero(compute < 0)
    if negative.size:
        raise UserError(f"{where[negative[0]]}: {compute_name} = {compute[negative[0]]:g} is negative")
    steps = np.diff(compute)
    not_increasing = np.flatnonzero(steps <= 0)
    if not_increasing.size:
        i = not_increasing[0]
        kind = "repeats" if steps[i] == 0 else "goes backwards"
        raise UserError(f"{where[i + 1]}: {compute_name} {kind} ({compute[i + 1]:g} after {compute[i]:g}); each "
                        "evaluation needs more compute than the one before")
