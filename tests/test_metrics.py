"""metrics.jsonl records: one line per call, several writers, wandb offline mirror."""

import json
import os
from multiprocessing import Process

from megatron_scalerl.metrics import MetricsLog, read_metrics


def _writer(run_dir, role, n):
    log = MetricsLog(run_dir, role)
    for i in range(n):
        log.log(i, {"x": float(i), "pad": "y" * 500})


def test_concurrent_writers_never_interleave(tmp_path):
    procs = [Process(target=_writer, args=(tmp_path, f"r{k}", 200)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    records = read_metrics(tmp_path)
    assert len(records) == 600
    assert sorted(r["step"] for r in read_metrics(tmp_path, role="r1")) == list(range(200))


def test_non_finite_values_stay_valid_json(tmp_path):
    import torch

    log = MetricsLog(tmp_path, "trainer")
    rec = log.log(3, {"a": float("nan"), "b": float("inf"), "c": torch.tensor(2.5)})
    assert rec["a"] is None and rec["b"] is None and rec["c"] == 2.5
    json.loads((tmp_path / "metrics.jsonl").read_text())


def test_wandb_offline_mirror(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    log = MetricsLog(tmp_path, "trainer", wandb_mode="offline", wandb_project="t", config={"k": 1})
    log.log(1, {"train/loss": 0.5})
    log.close()
    runs = list((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    assert runs and any(f.suffix == ".wandb" for f in runs[0].iterdir())
    assert os.path.getsize(tmp_path / "metrics.jsonl") > 0
