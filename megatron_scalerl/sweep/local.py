"""A sweep's runs on this machine: each a `scalerl train` process, one after another or `--parallel N` at once.

Each run's launcher runs in a session of its own, its console output appended to `SWEEP/VARIANT/seedI.console.log`
and echoed here line by line with the run's key in front (read back from that file, so a sweep that dies never
breaks a run's output). A new run starts with `--recipe SWEEP/VARIANT/seedI.recipe.yaml`, a started one continues
with `--resume` (sweep/runs.py).

`--parallel N` (N > 1) holds N runs at once when the machine has room: on CPU each run's processes (trainer ranks +
generators) need a core each, so N x processes must not exceed the cores this process may use
(`os.sched_getaffinity`), and each run's processes get an even share of them as OMP_NUM_THREADS (unless set); on GPUs
each run gets its own CUDA_VISIBLE_DEVICES slice of the visible GPUs.

Ctrl-C or SIGTERM: every running run is sent SIGTERM (its launcher stops its roles in order, the trainer
checkpointing its step; up to `STOP_WAIT_S` seconds), then the sweep exits 128 + the signal; `scalerl sweep` again
continues. A run that fails is recorded (`failed`, its exit code) and the others go on; the next sweep resumes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import BinaryIO

from megatron_scalerl.errors import UserError
from megatron_scalerl.run_dir import STOP_TIMEOUT_S
from megatron_scalerl.sweep.runs import Sweep, SweepRun

POLL_S = 1.0
# A launcher's ordered stop gives the orchestrator, the trainer and the generators STOP_TIMEOUT_S each at most.
STOP_WAIT_S = 3 * STOP_TIMEOUT_S + 60.0


@dataclass
class _Active:
    """A running run: its launcher process, the devices it holds, and how far its console log was echoed."""

    run: SweepRun
    process: subprocess.Popen
    devices: list[int]
    log: BinaryIO
    echoed: int = 0
    partial: bytes = field(default=b"")

    def echo(self) -> None:
        """Print the console log's new complete lines, each after the run's key."""
        with open(self.run.console, "rb") as log:
            log.seek(self.echoed)
            data = self.partial + log.read()
            self.echoed = log.tell()
        *lines, self.partial = data.split(b"\n")
        for line in lines:
            sys.stdout.write(f"[{self.run.key}] {line.decode(errors='replace')}\n")
        sys.stdout.flush()


def visible_gpus() -> list[str]:
    """The GPU ids this process may use: an inherited CUDA_VISIBLE_DEVICES, else every device torch sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def check_room(runs: list[SweepRun], parallel: int, *, cuda: bool) -> None:
    """Refuse `--parallel` beyond what this machine holds (module docstring)."""
    if parallel == 1 or not runs:
        return
    widest = max(runs, key=lambda r: r.processes)
    have = len(visible_gpus()) if cuda else len(os.sched_getaffinity(0))
    what = "visible GPUs (CUDA_VISIBLE_DEVICES or all)" if cuda else "CPU cores (os.sched_getaffinity)"
    if parallel * widest.processes > have:
        raise UserError(f"--parallel {parallel}: {parallel} runs x {widest.processes} processes ({widest.key}: "
                        f"trainer ranks + generators, its cluster section) need {parallel * widest.processes} "
                        f"{what}; this machine gives {have}")


def _command(run: SweepRun, resume: bool, tokenizer: str | None) -> list[str]:
    train = [sys.executable, "-m", "megatron_scalerl.cli", "train", "--run-dir", str(run.run_dir)]
    if resume:
        return [*train, "--resume"]
    return [*train, "--recipe", str(run.recipe_file), *(["--tokenizer", tokenizer] if tokenizer else [])]


def run_local(sweep: Sweep, keys: list[str], parallel: int, *, cuda: bool) -> int:
    """Run the sweep's runs `keys` (in order; done ones skipped) on this machine; 0 when every one is done, 1 when
    some failed, 128 + a stop signal when stopped."""
    todo = [key for key in keys if not sweep.done(key)]
    check_room([sweep.runs[k] for k in todo], parallel, cuda=cuda)
    gpus = visible_gpus() if cuda and parallel > 1 else []
    free = list(range(len(gpus)))
    cores = len(os.sched_getaffinity(0))
    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    active: dict[str, _Active] = {}
    failed: list[str] = []
    try:
        while (todo or active) and not stop:
            while todo and len(active) < parallel and not stop:
                run = sweep.runs[todo[0]]
                if gpus and len(free) < run.processes:
                    break
                todo.pop(0)
                devices = [free.pop(0) for _ in range(run.processes)] if gpus else []
                env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus[d] for d in devices)} if gpus else {}
                if parallel > 1 and not cuda and "OMP_NUM_THREADS" not in os.environ:
                    env["OMP_NUM_THREADS"] = str(max(1, cores // (parallel * run.processes)))
                active[run.key] = _start(sweep, run, devices, env)
            time.sleep(POLL_S)
            for key, entry in list(active.items()):
                entry.echo()
                code = entry.process.poll()
                if code is None:
                    continue
                del active[key]
                entry.log.close()
                free.extend(entry.devices)
                if not _finish(sweep, key, code):
                    failed.append(key)
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the runs' ordered stops short
            signal.signal(sig, signal.SIG_IGN)
        if active:
            _stop_all(sweep, active)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop:
        print(f"sweep: stopped ({signal.Signals(stop[0]).name}); run the same `scalerl sweep` again to continue",
              flush=True)
        return 128 + stop[0]
    if failed:
        print(f"sweep: {len(failed)} run(s) failed: " + "; ".join(
            f"{k} (exit {sweep.manifest['runs'][k]['exit_code']}, {sweep.runs[k].console})" for k in failed)
            + "; run the same `scalerl sweep` again to resume them", file=sys.stderr, flush=True)
        return 1
    return 0


def _start(sweep: Sweep, run: SweepRun, devices: list[int], env: dict[str, str]) -> _Active:
    resume = sweep.prepare(run.key)
    run.console.parent.mkdir(parents=True, exist_ok=True)
    log = open(run.console, "ab")  # the child keeps its own descriptor
    echoed = log.tell()
    process = subprocess.Popen(_command(run, resume, sweep.manifest.get("tokenizer")), stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                               env={**os.environ, **env})
    sweep.update(run.key, state="running", pid=process.pid, exit_code=None)
    print(f"sweep: {run.key}: {'resuming' if resume else 'starting'} in {run.run_dir} (pid {process.pid}"
          f"{', ' + ' '.join(f'{k}={v}' for k, v in env.items()) if env else ''}; output in {run.console})",
          flush=True)
    return _Active(run, process, devices, log, echoed)


def _finish(sweep: Sweep, key: str, code: int) -> bool:
    """Record how run `key`'s launcher ended; True when the run is done."""
    if code == 0 and sweep.done(key):
        sweep.update(key, pid=None, exit_code=0)
        print(f"sweep: {key}: done ({sweep.manifest['runs'][key]['finished']})", flush=True)
        return True
    state = "stopped" if code in (128 + signal.SIGINT, 128 + signal.SIGTERM) else "failed"
    sweep.update(key, state=state, pid=None, exit_code=code)
    print(f"sweep: {key}: {state} (exit {code}"
          f"{'' if code else ', but the run did not record its end in finished.json'}); its output: "
          f"{sweep.runs[key].console}", file=sys.stderr, flush=True)
    return False


def _stop_all(sweep: Sweep, active: dict[str, _Active]) -> None:
    """SIGTERM every running launcher, wait for their ordered stops (STOP_WAIT_S at most), SIGKILL what is left."""
    print(f"sweep: stopping {len(active)} run(s) (each checkpoints its trainer first)", flush=True)
    for entry in active.values():
        try:
            os.kill(entry.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_WAIT_S
    for key, entry in active.items():
        try:
            code = entry.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(entry.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = entry.process.wait()
        entry.echo()
        entry.log.close()
        sweep.update(key, state="stopped", pid=None, exit_code=code)
        sweep.done(key)  # it may have ended on its own meanwhile

