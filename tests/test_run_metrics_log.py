"""metrics.jsonl records: one line per call, several writers, wandb offline mirror."""

import json
import os
import struct
import time
from multiprocessing import Process

from megatron_scalerl.run.metrics_log import REWOUND_FILE, MetricsLog, read_metrics, set_aside


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
    log = MetricsLog(tmp_path, "orchestrator", wandb_mode="offline", wandb_project="t", config={"k": 1})
    log.log(8, {"rollout/reward_mean": 0.5})
    log.log(0, {"val/pass_rate": 0.25})  # a validation of policy version 0, logged after batch 8
    log.log(9, {"rollout/reward_mean": 0.75})
    log.close()
    runs = list((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    [data] = [f for f in runs[0].iterdir() if f.suffix == ".wandb"]
    assert os.path.getsize(tmp_path / "metrics.jsonl") > 0
    deadline = time.monotonic() + 30  # wandb's service may still be writing the file when finish() returns
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(data)):
        assert time.monotonic() < deadline, f"{data} never got its exit record"
        time.sleep(0.2)
    rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in _wandb_records(data) if record.WhichOneof("record_type") == "history"]
    assert [(row["step"], row.get("val/pass_rate"), row.get("rollout/reward_mean")) for row in rows] == [
        (8, None, 0.5), (0, 0.25, None), (9, None, 0.75)]  # nothing dropped, each at its own step


def test_a_resumed_role_continues_its_wandb_run_and_marks_the_resume(tmp_path, monkeypatch):
    """Two launches of one role: one wandb run id (RUN/logs/wandb_trainer.id), and the second, resumed from step 4,
    logs `run/resumed_from_step` at step 4."""
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    first = MetricsLog(tmp_path, "trainer", wandb_mode="offline", wandb_project="t")
    first.log(5, {"train/loss": 1.0})
    first.close()
    second = MetricsLog(tmp_path, "trainer", wandb_mode="offline", wandb_project="t", resumed_from=4)
    second.log(5, {"train/loss": 0.5})
    second.close()
    run_id = (tmp_path / "logs" / "wandb_trainer.id").read_text()
    runs = sorted((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs)  # the same id ("-1": the same second)
    histories = []
    for run in runs:
        [data] = [f for f in run.iterdir() if f.suffix == ".wandb"]
        deadline = time.monotonic() + 30
        while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(data)):
            assert time.monotonic() < deadline, f"{data} never got its exit record"
            time.sleep(0.2)
        rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                for record in _wandb_records(data) if record.WhichOneof("record_type") == "history"]
        histories.append([(row["step"], row.get("run/resumed_from_step")) for row in rows])
    assert sorted(histories) == [[(4, 4.0), (5, None)], [(5, None)]]


def _wandb_records(path):
    """The records of an offline run's .wandb file: wandb's LevelDB-style log (a 7-byte ":W&B" header, then 32 KiB
    blocks of chunks, each behind a 7-byte header: CRC, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4), each
    record a protobuf `Record` (wandb 0.31 no longer ships a Python reader)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_records_set_aside_while_others_write_lose_nothing(tmp_path):
    """`set_aside` rewrites metrics.jsonl while three processes append: every record ends in exactly one of the two
    files, the moved ones noted."""
    procs = [Process(target=_writer, args=(tmp_path, f"r{k}", 300)) for k in range(3)]
    for p in procs:
        p.start()
    moved = 0
    while any(p.is_alive() for p in procs):
        moved += set_aside(tmp_path, lambda r: r["role"] == "r0" and r["step"] % 2 == 1, "test")
    for p in procs:
        p.join()
    moved += set_aside(tmp_path, lambda r: r["role"] == "r0" and r["step"] % 2 == 1, "test")
    kept, aside = read_metrics(tmp_path), read_metrics(tmp_path, rewound=True)[len(read_metrics(tmp_path)):]
    assert moved == 150 and len(kept) == 750 and len(aside) == 150
    assert sorted(r["step"] for r in aside) == list(range(1, 300, 2)) and {r["rewound"] for r in aside} == {"test"}
    assert sorted(r["step"] for r in kept if r["role"] == "r0") == list(range(0, 300, 2))
    assert (tmp_path / REWOUND_FILE).is_file() and set_aside(tmp_path, lambda r: False, "none") == 0
