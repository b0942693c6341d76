"""`scalerl forecast fit | compare | backtest`: printed reports, --json, and the files --out writes."""

import json
import os
import subprocess
import sys

import pytest

from megatron_scalerl.commands import main
from megatron_scalerl.forecast.synthetic import paper_run, synthetic_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run_dir(tmp_path):
    """A run directory whose metrics.jsonl follows the paper's 100k GPU-h run."""
    path = tmp_path / "run100k"
    path.mkdir()
    (path / "metrics.jsonl").write_text(synthetic_curve(paper_run("batch-2048-100k"), seed=0).to_jsonl())
    return path


def synthetic_file(tmp_path, name, run, seed=0):
    path = tmp_path / f"{name}.jsonl"
    path.write_text(synthetic_curve(paper_run(run), seed).to_jsonl())
    return str(path)


def test_fit_writes_the_full_report(run_dir, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(["forecast", "fit", str(run_dir), "--fit-until", "50k", "--target", "0.6", "--bootstrap", "60",
                 "--eval-draws", "1000x16", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# Forecast: run100k\n\nRecommendation: ") and "forecast.json" in printed
    data = json.loads((out / "forecast.json").read_text())
    for name in ("A", "B", "C_mid", "R0"):
        value, (lo, hi) = data["fit"][name]["value"], data["fit"][name]["interval"]
        assert lo <= value <= hi
    assert abs(data["fit"]["A"]["value"] - 0.645) < 0.02
    assert [p["gpu_hours"] for p in data["predictions"]] == [16000, 50000, 100000]
    assert all(set(p) == {"gpu_hours", "reward", "lo", "hi"} and p["lo"] < p["reward"] < p["hi"]
               for p in data["predictions"])
    assert data["targets"][0]["reachable"] and data["window"]["last"] == 50000
    assert data["options"]["eval_draws"] == 16000 and data["fit"]["bootstrap"]["noise"]["eval_sd_source"] == "eval_draws"
    assert data["power_law"]["A"] > data["fit"]["A"]["value"]
    assert data["recommendation"]
    assert (out / "forecast.png").read_bytes().startswith(PNG_MAGIC)
    markdown = (out / "report.md").read_text()
    assert markdown.startswith("# Forecast: run100k\n\nRecommendation: ")
    assert "![forecast.png](forecast.png)" in markdown
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "<table>" in html and "src=\"forecast.png\"" not in html


def test_fit_json_is_one_object(run_dir, capsys):
    assert main(["forecast", "fit", str(run_dir), "--json", "--bootstrap", "0", "--budgets", "200k"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    data = json.loads(out)
    assert data["predictions"] == [{"gpu_hours": 200000.0, "reward": data["predictions"][0]["reward"],
                                    "lo": None, "hi": None}]
    assert data["fit"]["A"]["interval"] is None and data["fit"]["method"] == "lsq"


def test_fit_paper_grid_method(run_dir, capsys):
    assert main(["forecast", "fit", str(run_dir), "--json", "--bootstrap", "0", "--method", "paper-grid"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fit"]["method"] == "paper-grid" and abs(data["fit"]["A"]["value"] - 0.645) < 0.02


def test_compare_writes_tables_and_both_plots(tmp_path, capsys):
    moe = synthetic_file(tmp_path, "moe", "moe-17bx16-scout")
    dense = synthetic_file(tmp_path, "dense", "batch-2048-100k")
    out = tmp_path / "cmp"
    assert main(["forecast", "compare", dense, moe, "--bootstrap", "30", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# Forecast comparison: dense vs moe\n\nRecommendation: Give the compute to moe")
    data = json.loads((out / "compare.json").read_text())
    assert set(data["runs"]) == {"dense", "moe"} and [row["leader"] for row in data["budgets"]] == ["moe"] * 3
    assert data["pairs"][0]["shared_A"] is None
    for name in ("compare.png", "linearised.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC)


def test_backtest_reports_errors_and_coverage(tmp_path, capsys):
    path = synthetic_file(tmp_path, "r", "scalerl-8b-14k-gen", seed=2)
    out = tmp_path / "bt"
    assert main(["forecast", "backtest", path, "--fit-until", "8k", "--bootstrap", "60", "--out", str(out),
                 "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert "wrote" in captured.err  # with --json, stdout holds only the JSON object
    summary = data["summary"]
    assert summary["fit_until"] == 8000 and summary["held_out_points"] == 40
    assert summary["mean_abs_error"] < 0.02 and 0 <= summary["coverage"] <= 1
    assert all(p["lo"] <= p["predicted"] <= p["hi"] for p in data["points"])
    assert json.loads((out / "backtest.json").read_text())["summary"] == summary
    assert (out / "backtest.png").read_bytes().startswith(PNG_MAGIC)


def test_eval_draws_must_be_a_count(run_dir, capsys):
    assert main(["forecast", "fit", str(run_dir), "--eval-draws", "1000xmany"]) == 2
    assert "--eval-draws: '1000xmany' is not a count" in capsys.readouterr().err
    assert main(["forecast", "fit", str(run_dir), "--eval-draws", "0"]) == 2
    assert "--eval-draws must be >= 1" in capsys.readouterr().err


def test_backtest_requires_fit_until(run_dir, capsys):
    assert main(["forecast", "backtest", str(run_dir)]) == 2
    assert "--fit-until" in capsys.readouterr().err


def test_scalerl_entry_point(run_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    scalerl = os.path.join(os.path.dirname(sys.executable), "scalerl")
    done = subprocess.run([scalerl, "forecast", "fit", str(run_dir), "--json", "--bootstrap", "0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["run"] == "run100k"
    bad = subprocess.run([scalerl, "forecast", "fit", str(run_dir), "--min-compute", "97k"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1


def test_a_small_runs_gpu_hours_keep_their_digits(tmp_path, capsys):
    """A CPU run spends hundredths of a GPU-hour: the report must not print its C_mid (or any GPU-h) as 0."""
    path = tmp_path / "small"
    path.mkdir()
    rows = [json.loads(line) for line in synthetic_curve(paper_run("batch-2048-100k"), seed=0).to_jsonl().splitlines()]
    (path / "metrics.jsonl").write_text("".join(json.dumps({**r, "gpu_hours": r["gpu_hours"] * 1e-6}) + "\n"
                                                for r in rows))
    out = tmp_path / "report"
    assert main(["forecast", "fit", str(path), "--min-compute", "0.0015", "--bootstrap", "20", "--out", str(out)]) == 0
    c_mid = json.loads((out / "forecast.json").read_text())["fit"]["C_mid"]["value"]
    assert 0.001 < c_mid < 0.1
    [row] = [line for line in (out / "report.md").read_text().splitlines() if line.startswith("| C_mid (GPU-h)")]
    assert f"| {c_mid:.3g} |" in row and "[0, 0]" not in row, row
