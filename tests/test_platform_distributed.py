"""Process groups: backend switch, layout checks, rendezvous timeouts naming the address, local worker failures.

(Results in rank order from `run_local_workers` are checked in test_platform_cpu_compat.py, which spawns anyway.)
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from megatron_scalerl.errors import UserError
from megatron_scalerl.platform import (
    WorkerError,
    check_layout,
    free_port,
    resolve_backend,
    run_local_workers,
)
from megatron_scalerl.platform.layer_backend import use_transformer_engine


def test_backend_switch_on_cpu():
    assert resolve_backend("auto") == "gloo"
    assert resolve_backend("gloo") == "gloo"
    with pytest.raises(UserError, match="nccl needs CUDA"):
        resolve_backend("nccl")
    with pytest.raises(UserError, match="unknown backend 'mpi'"):
        resolve_backend("mpi")


def test_local_layer_spec_on_cpu():
    assert use_transformer_engine() is False


def test_layout_checks():
    assert check_layout(8, tp=2, pp=2, ep=1, etp=2) == 2
    assert check_layout(4, tp=2, pp=1, ep=2, etp=1) == 2
    with pytest.raises(UserError, match="world size 6 is not a multiple of tp\\*pp = 4\\*1"):
        check_layout(6, tp=4, pp=1, ep=1, etp=4)
    with pytest.raises(UserError, match="ep\\*expert_tp = 4\\*2"):
        check_layout(4, tp=2, pp=1, ep=4, etp=2)


def test_rendezvous_timeout_names_the_address():
    port = free_port()
    code = (
        "from megatron_scalerl.platform import init_distributed\n"
        f"init_distributed('gloo', 2, rank=0, world_size=2, master_port={port})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"rank 0 of 2: could not join the gloo process group at 127.0.0.1:{port} within 2 s" in proc.stderr


def _fail_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()


def _sleep(rank: int) -> None:
    time.sleep(120)


@pytest.mark.multiprocess
def test_run_local_workers_reports_the_failing_rank():
    with pytest.raises(WorkerError, match="(?s)worker rank 1 of 2 failed.*ValueError: rank one refuses"):
        run_local_workers(_fail_on_rank_one, 2, timeout_s=120)


@pytest.mark.multiprocess
def test_run_local_workers_times_out():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="did not finish within 3 s"):
        run_local_workers(_sleep, 1, timeout_s=3)
    assert time.monotonic() - start < 60


def _environment(rank: int) -> tuple[str | None, str, bool]:
    import os
    import sys

    return os.environ.get("SCALERL_TEST_PROBE"), os.getcwd(), "megatron.core" in sys.modules


@pytest.mark.multiprocess
def test_workers_take_the_callers_environment_and_directory(tmp_path, monkeypatch):
    """Workers fork from a forkserver started once per process: each must still see the environment and working
    directory of the call that started it, not of the forkserver's start, and start with megatron-core loaded. `fn`
    here needs no collective: a rank done with it once closed its connections while the other was still making
    them (gloo: "Connection closed by peer"), 1 run in 3 beside a loaded machine before the workers' barrier."""
    for value in ("first", "second"):
        (tmp_path / value).mkdir()
        monkeypatch.chdir(tmp_path / value)
        monkeypatch.setenv("SCALERL_TEST_PROBE", value)
        assert run_local_workers(_environment, 2, timeout_s=120) == [(value, str(tmp_path / value), True)] * 2
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # a caller's own rendezvous (a SLURM job's): not the workers'
    assert run_local_workers(_environment, 2, timeout_s=120) == [("second", str(tmp_path / "second"), True)] * 2

