"""Forecaster inputs: run directories, JSON Lines, wandb CSV, GPU-hours from the wall clock, and every bad input
giving a one-line error with exit code 2 through the CLI."""

import json

import numpy as np
import pytest

from megatron_scalerl.commands import main
from megatron_scalerl.errors import UserError
from megatron_scalerl.forecast.data import load_curve, parse_gpu_hours
from megatron_scalerl.recipe import load_recipe


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def rising(n=12, step=1000.0):
    """n evaluations from 0 to (n-1)*step GPU-h of a rising pass rate."""
    return [{"gpu_hours": i * step, "val/pass_rate": 0.3 + 0.3 * i / (i + 4)} for i in range(n)]


def test_run_directory_skips_training_rows(tmp_path):
    rows = []
    for row in rising(6):
        rows += [{"step": 1, "loss": 0.1, "gpu_hours": row["gpu_hours"] - 0.5}, row]
    write_jsonl(tmp_path / "metrics.jsonl", rows[1:])
    curve = load_curve(tmp_path)
    assert curve.name == tmp_path.name and curve.compute.tolist() == [0, 1000, 2000, 3000, 4000, 5000]
    assert curve.compute_rule == "gpu_hours"


def test_other_metric_and_compute_columns(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"c": i * 10.0, "acc": 0.1 * i} for i in range(5)])
    curve = load_curve(path, metric="acc", compute_col="c")
    assert curve.reward.tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4]) and curve.name == "m"


def test_gpu_hours_from_wall_clock_and_num_gpus(tmp_path):
    rows = [{"wall_time_s": 3600.0 * i, "num_gpus": 80, "val/pass_rate": 0.3 + 0.01 * i} for i in range(4)]
    curve = load_curve(write_jsonl(tmp_path / "m.jsonl", rows))
    assert curve.compute.tolist() == [0, 80, 160, 240] and "wall_time_s" in curve.compute_rule


def test_gpu_hours_from_wall_clock_and_the_run_recipe(tmp_path):
    recipe = load_recipe("scalerl")
    (tmp_path / "recipe.yaml").write_text(recipe.to_yaml())
    write_jsonl(tmp_path / "metrics.jsonl", [{"wall_time_s": 1800.0 * i, "val/pass_rate": 0.3} for i in range(3)])
    curve = load_curve(tmp_path)
    gpus = recipe.cluster.total_gpus  # trainers + generators
    assert curve.compute.tolist() == [0, 0.5 * gpus, 1.0 * gpus] and "recipe.yaml" in curve.compute_rule


def test_wandb_csv_with_runtime_and_gpus(tmp_path):
    lines = ["_step,_runtime,val/pass_rate,train/loss"]
    lines += [f"{i},{i * 7200},{'' if i % 2 else 0.3 + 0.02 * i},0.5" for i in range(8)]
    (tmp_path / "export.csv").write_text("\n".join(lines) + "\n")
    curve = load_curve(tmp_path / "export.csv", gpus=16)
    assert curve.compute.tolist() == [0, 64, 128, 192]  # evaluated every other step, 2 h x 16 GPUs per step
    assert curve.reward.tolist() == pytest.approx([0.3, 0.34, 0.38, 0.42])


def test_wandb_csv_with_named_columns(tmp_path):
    (tmp_path / "w.csv").write_text("gpu_h,score\n100,0.2\n200,0.25\n")
    curve = load_curve(tmp_path / "w.csv", metric="score", compute_col="gpu_h")
    assert curve.compute.tolist() == [100, 200]


def test_parse_gpu_hours():
    assert [parse_gpu_hours(t, "--x") for t in ("16k", "1.5K", "2M", "2500")] == [16000, 1500, 2e6, 2500]
    with pytest.raises(UserError, match="--budgets: 'lots'"):
        parse_gpu_hours("lots", "--budgets")


# ---------------------------------------------------------------- bad input: one line on stderr, exit code 2


def bad(tmp_path, rows, name="m.jsonl"):
    path = tmp_path / name
    if name.endswith(".csv"):
        path.write_text(rows)
    else:
        write_jsonl(path, rows)
    return str(path)


def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("case,expected", [
    ("unsorted", "m.jsonl:4: gpu_hours goes backwards (2000 after 3000)"),
    ("duplicate", "m.jsonl:3: gpu_hours repeats (1000 after 1000)"),
    ("nan", "m.jsonl:2: val/pass_rate is nan"),
    ("outside", "m.jsonl:3: val/pass_rate = 1.2 is outside [0, 1]"),
    ("negative", "m.jsonl:1: gpu_hours = -5 is negative"),
    ("text", "m.jsonl:2: column 'val/pass_rate' is not a number ('high')"),
    ("no_metric", "no row has the metric column 'val/pass_rate' (columns: gpu_hours, reward)"),
    ("no_compute", "no compute column 'gpu_hours' and no wall clock"),
    ("metric_row_without_compute", "m.jsonl:2: row has the metric but no 'gpu_hours'"),
    ("wall_without_gpus", "wall clock but no GPU count: pass --gpus N"),
    ("bad_json", "m.jsonl:2: not valid JSON"),
    ("too_few", "only 3 of 6 evaluations fall in the fit window (--min-compute 1500 GPU-h); the fit needs at least 5"),
    ("small_run", "only 0 of 6 evaluations fall in the fit window (--min-compute 1500 GPU-h); the fit needs at least 5; "
                  "the run's evaluations reach only 0.1 GPU-h: lower --min-compute"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case, expected):
    rows = {
        "unsorted": [{"gpu_hours": c, "val/pass_rate": 0.3} for c in (0, 1000, 3000, 2000)],
        "duplicate": [{"gpu_hours": c, "val/pass_rate": 0.3} for c in (0, 1000, 1000)],
        "nan": [{"gpu_hours": 0, "val/pass_rate": 0.3}, '{"gpu_hours": 1, "val/pass_rate": NaN}'],
        "outside": [{"gpu_hours": c, "val/pass_rate": r} for c, r in ((0, 0.3), (1, 0.5), (2, 1.2))],
        "negative": [{"gpu_hours": -5, "val/pass_rate": 0.3}],
        "text": [{"gpu_hours": 0, "val/pass_rate": 0.3}, {"gpu_hours": 1, "val/pass_rate": "high"}],
        "no_metric": [{"gpu_hours": 0, "reward": 0.3}],
        "no_compute": [{"step": 0, "val/pass_rate": 0.3}],
        "metric_row_without_compute": [{"gpu_hours": 0, "val/pass_rate": 0.3}, {"val/pass_rate": 0.4}],
        "wall_without_gpus": [{"wall_time_s": 0, "val/pass_rate": 0.3}],
        "bad_json": [{"gpu_hours": 0, "val/pass_rate": 0.3}, "{not json"],
        "too_few": [{"gpu_hours": c, "val/pass_rate": 0.3 + c / 1e5} for c in (0, 500, 1000, 2000, 3000, 4000)],
        "small_run": [{"gpu_hours": c / 50, "val/pass_rate": 0.3 + c / 100} for c in range(6)],  # the demo's size
    }[case]
    code, err = run_cli(["forecast", "fit", bad(tmp_path, rows), "--bootstrap", "0"], capsys)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err


def test_bad_csv_inputs(tmp_path, capsys):
    code, err = run_cli(["forecast", "fit", bad(tmp_path, "gpu_hours,val/pass_rate\n0,0.3\n1,nan\n", "a.csv")],
                        capsys)
    assert code == 2 and "a.csv:3: val/pass_rate is nan" in err
    code, err = run_cli(["forecast", "fit", bad(tmp_path, "gpu_hours,val/pass_rate\n0,0.3,9\n", "b.csv")], capsys)
    assert code == 2 and "b.csv:2: 3 cells, the header has 2" in err
    code, err = run_cli(["forecast", "fit", bad(tmp_path, "x,y\n0,0.3\n", "c.csv"), "--metric-col", "y",
                         "--compute-col", "gpu"], capsys)
    assert code == 2 and "no compute column 'gpu'; choose the column with --compute-col" in err


@pytest.mark.parametrize("args,expected", [
    (["--budgets", "16k,lots"], "--budgets: 'lots' is not a number of GPU-hours"),
    (["--target", "0.6,much"], "--target: 'much' is not a reward"),
    (["--target", "1.5"], "--target: rewards must be in [0, 1]"),
    (["--r0", "1.0"], "--r0 must be in [0, 1)"),
    (["--fit-until", "1k"], "--fit-until 1000 must be above --min-compute 1500"),
    (["--method", "grid"], "argument --method: invalid choice: 'grid'"),
])
def test_bad_options_are_one_line_exit_2(tmp_path, capsys, args, expected):
    path = tmp_path / "ok.jsonl"
    write_jsonl(path, rising())
    code, err = run_cli(["forecast", "fit", str(path), *args], capsys)
    assert code == 2 and err.count("\n") == 1 and expected in err, err


def test_missing_inputs(tmp_path, capsys):
    code, err = run_cli(["forecast", "fit", str(tmp_path / "nope")], capsys)
    assert code == 2 and "no such file or run directory" in err
    code, err = run_cli(["forecast", "fit", str(tmp_path)], capsys)
    assert code == 2 and "no metrics.jsonl" in err
    write_jsonl(tmp_path / "ok.jsonl", rising())
    code, err = run_cli(["forecast", "backtest", str(tmp_path / "ok.jsonl"), "--fit-until", "20k"], capsys)
    assert code == 2 and "no evaluation after --fit-until 20000 GPU-h" in err
    code, err = run_cli(["forecast", "compare", str(tmp_path / "ok.jsonl")], capsys)
    assert code == 2 and "compare needs at least two runs" in err


def test_loaded_arrays_are_float(tmp_path):
    curve = load_curve(write_jsonl(tmp_path / "m.jsonl", rising(3)))
    assert curve.compute.dtype == np.float64 and curve.reward.dtype == np.float64
