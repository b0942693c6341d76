"""`scalerl eval report RUN_DIR`: the run's downstream curves beside its validation curve.

A table per dataset (markdown, `RUN/eval/report.md`, also printed) with one row per evaluated checkpoint: step,
GPU-hours, the dataset's mean@k, pass@K and cons@K, and the validation pass rate at that step (the orchestrator's
`val/pass_rate` at the same policy version); and a plot (`RUN/eval/report.png`) of each dataset's mean@k and the
validation pass rate against GPU-hours. The datasets: those asked for, else every one evaluated (AIME and local
benchmarks alike, in the order they were first logged). Both read only RUN/metrics.jsonl (the `eval` rows the
watcher wrote).
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_bytes, atomic_write_text
from megatron_scalerl.run.metrics_log import read_metrics

_MEAN = re.compile(r"^eval/([^/]+)/mean_at_k$")


def evaluated_datasets(run_dir: Path) -> list[str]:
    """The datasets with an `eval` row in RUN/metrics.jsonl, in the order they were first logged."""
    names: dict[str, None] = {}
    for row in read_metrics(run_dir, role="eval"):
        names.update((m.group(1), None) for m in map(_MEAN.match, row) if m)
    return list(names)


def report_rows(run_dir: Path, dataset: str) -> list[dict]:
    """One dict per evaluated step: step, gpu_hours, mean_at_k, pass_at_k (at K), cons_at_k, val_pass_rate."""
    prefix = f"eval/{dataset}/"
    evals = [r for r in read_metrics(run_dir, role="eval") if f"{prefix}mean_at_k" in r]
    if not evals:
        raise UserError(f"{run_dir}: no evaluation of {dataset!r} in metrics.jsonl yet (scalerl eval watch)")
    validation = {r["step"]: r["val/pass_rate"] for r in read_metrics(run_dir, role="orchestrator")
                  if "val/pass_rate" in r}
    rows = []
    for r in sorted(evals, key=lambda r: r["step"]):
        k = int(r[f"{prefix}samples_per_problem"])
        rows.append({"step": r["step"], "gpu_hours": r.get("gpu_hours"), "k": k,
                     "mean_at_k": r[f"{prefix}mean_at_k"], "pass_at_k": r.get(f"{prefix}pass_at_k/{k}"),
                     "cons_at_k": r[f"{prefix}cons_at_k"], "val_pass_rate": validation.get(r["step"])})
    return rows


def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(rows: list[dict], dataset: str) -> str:
    k = rows[-1]["k"]
    lines = [f"| step | GPU-hours | {dataset} mean@{k} | pass@{k} | cons@{k} | val pass rate |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['step']} | {_cell(r['gpu_hours'], 2)} | {_cell(r['mean_at_k'])} | {_cell(r['pass_at_k'])} | "
              f"{_cell(r['cons_at_k'])} | {_cell(r['val_pass_rate'])} |" for r in rows]
    return "\n".join(lines) + "\n"


def report_png(curves: dict[str, list[dict]], run_name: str) -> bytes:
    """The plot: each dataset's mean@k (`curves`: dataset -> its `report_rows`) and the validation pass rate."""
    from matplotlib.figure import Figure  # deferred: matplotlib loads in ~1 s; only the report draws

    fig = Figure(figsize=(6.5, 3.8))
    ax = fig.add_subplot()
    every = [r for rows in curves.values() for r in rows]
    x_key = "gpu_hours" if all(r["gpu_hours"] is not None for r in every) else "step"
    for dataset, rows in curves.items():
        ax.plot([r[x_key] for r in rows], [r["mean_at_k"] for r in rows], marker="o",
                label=f"{dataset} mean@{rows[-1]['k']}")
    validated = sorted({r["step"]: r for r in every if r["val_pass_rate"] is not None}.values(),
                       key=lambda r: r["step"])
    if validated:
        ax.plot([r[x_key] for r in validated], [r["val_pass_rate"] for r in validated], marker="s",
                label="validation pass rate")
    ax.set_xlabel("GPU-hours" if x_key == "gpu_hours" else "step (no GPU-hours recorded)")
    ax.set_ylabel("pass rate")
    ax.set_title(f"{run_name}: downstream vs validation")
    ax.grid(True, alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def write_report(run_dir: Path, datasets: Sequence[str] | None = None) -> str:
    """Write RUN/eval/report.md and report.png for `datasets` (None: every one evaluated); return the tables."""
    names = list(datasets) if datasets else evaluated_datasets(run_dir)
    if not names:
        raise UserError(f"{run_dir}: no evaluation in metrics.jsonl yet (scalerl eval watch)")
    curves = {name: report_rows(run_dir, name) for name in names}
    tables = "\n".join(markdown_table(rows, name) for name, rows in curves.items())
    out = run_dir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.md", tables)
    atomic_write_bytes(out / "report.png", report_png(curves, run_dir.name))
    return tables
