"""Shared pieces of the tests that run `scalerl train` on real processes and fault them (tests/test_pipeline_run.py,
tests/test_fault_matrix.py): start a launch, wait for a moment in it, find its processes, and what it left behind;
and `scalerl sweep` as a process (tests/test_sweep.py, tests/test_slurm.py)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_scalerl.launch.supervise import LAUNCH_ENV, processes_with_environment
from megatron_scalerl.run.metrics_log import read_metrics

SCALERL = Path(sys.executable).with_name("scalerl")


def train(*args: str) -> subprocess.Popen:
    """`scalerl train ARGS` in a session of its own, its output (stdout and stderr) on a pipe."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.Popen([str(SCALERL), "train", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)


def wait_until(ready, proc: subprocess.Popen, what: str, timeout_s: float = 400) -> None:
    """Return once `ready()`; fail naming `what` when the launch exits first or `timeout_s` seconds pass."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"scalerl train exited {proc.returncode}:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        time.sleep(0.2)


def launch(args: list[str], faults: list[tuple[str, object, object]]) -> tuple[int, str]:
    """`scalerl train ARGS`; for each (what, ready, fault) in turn, once `ready()`: `fault()`. Returns the launch's
    exit code and output (it ends on its own, or because of a fault)."""
    proc = train(*args)
    try:
        for what, ready, fault in faults:
            wait_until(ready, proc, what)
            fault()
        out, _ = proc.communicate(timeout=900)
        return proc.returncode, out
    finally:
        if proc.poll() is None:
            proc.terminate()  # the launcher stops its roles (each in a session of its own)
            proc.wait(timeout=200)


def pids(pattern: str) -> list[int]:
    """The processes whose command line matches `pattern` (pgrep -f)."""
    out = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def trainer_worker(run_dir: Path, rank: int, timeout_s: float = 120) -> int:
    """The pid of trainer rank `rank` of the run (a torchrun worker: RANK in its environment), once there is one."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        for pid in pids(f"-u -m megatron_scalerl.trainer --run-dir {run_dir}"):
            try:
                if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.append(pid)
            except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
                continue
        if len(found) == 1:
            return found[0]
        assert time.monotonic() < deadline, f"trainer rank {rank} of {run_dir}: {found} after {timeout_s} s"
        time.sleep(0.2)


def generator_url(run_dir: Path, index: int = 0) -> str:
    return json.loads((run_dir / "generators.json").read_text())["urls"][index]


def run_key(run_dir: Path) -> str:
    """The run's own API key (`RUN/api_key`: these launches have no $SCALERL_API_KEY), which its generators ask for."""
    return (run_dir / "api_key").read_text().strip()


def leftovers(test_file: str) -> list[tuple[int, str]]:
    """Processes of `test_file`'s launches still alive (their environment carries a launch id and that file)."""
    return processes_with_environment(f"{LAUNCH_ENV}=", f"PYTEST_CURRENT_TEST={test_file}")


def stepped_after_restarts(run_dir: Path, restarts: int):
    """A `ready` for `launch`: once the launch has restarted `restarts` times (0: from its start) and the trainer
    logged a step since the last of them."""
    def ready() -> bool:
        rows = read_metrics(run_dir)
        times = [r["time"] for r in rows if "launch/restarts" in r]
        if len(times) < restarts:
            return False
        since = times[restarts - 1] if restarts else 0.0
        return any(r["role"] == "trainer" and "train/loss" in r and r["time"] > since for r in rows)
    return ready


class SweepProcess:
    """`scalerl sweep ARGS` as a process of its own, its output in a file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen([str(SCALERL), "sweep", *args], stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                         "WANDB_MODE": "disabled", **(env or {})})

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, ready, what: str, timeout_s: float = 400) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert self.process.poll() is None, f"the sweep exited {self.process.returncode}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"not {what} after {timeout_s} s:\n{self.text()[-4000:]}"
            time.sleep(0.5)

    def end(self, timeout_s: float = 600) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.terminate()  # the sweep stops its runs in order
                self.process.wait(timeout=500)
