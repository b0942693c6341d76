"""A sweep's runs on this machine: each a `scalerl train` process, one after another or `--parallel N` at once.

Each run's launcher runs in a session of its own, its console output appended to `SWEEP/VARIANT/seedI.console.log`
and echoed here line by line with the run's key in front (read back from that file, so a sweep that dies never
breaks a run's output). A new run starts with `--recipe SWEEP/VARIANT/seedI.recipe.yaml`, a started one continues
with `--resume` (sweep/runs.py). The launcher and every role it starts carry the run's marker in their environment
(`runs.SWEEP_RUN_ENV`); once a launcher has ended, whatever of its run still carries it is killed.

`--parallel N` (N > 1) holds N runs at once when the machine has room: on CPU each run's processes (trainer ranks +
generator servers) need a core each, so N x processes must not exceed the cores this process may use
(`os.sched_getaffinity`), and each run's processes get an even share of them as OMP_NUM_THREADS (unless set; as
`launch.local.cpu_threads_per_process` shares them for one run); on GPUs each run gets its own CUDA_VISIBLE_DEVICES
slice of consecutive visible GPUs (`launch.local.cuda_devices`).

Ctrl-C or SIGTERM: every running run is sent SIGTERM (its launcher stops its roles in order, the trainer
checkpointing its step), the sweep waits for their ordered stops (`stop_wait_s`: each role's STOP_TIMEOUT_S plus a
minute), SIGKILLs what is left of each run (its launcher's process group and every process carrying its marker:
the roles run in sessions of their own), then exits 128 + the signal; `scalerl sweep` again continues. A run that
fails is recorded (`failed`, its exit code) and the others go on; the next sweep resumes it. Each run's start and
end get a line with the sweep's progress (sweep/progress.py).
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
from megatron_scalerl.launch.local import cpu_threads_per_process, cuda_devices
from megatron_scalerl.launch.supervise import kill_carrying
from megatron_scalerl.run.directory import STOP_TIMEOUT_S
from megatron_scalerl.sweep.progress import SweepProgress
from megatron_scalerl.sweep.runs import SWEEP_RUN_ENV, Sweep, SweepRun, outcome

POLL_S = 1.0


def stop_wait_s(run: SweepRun) -> float:
    """Seconds a run's launcher may take to stop in order: the orchestrator, the trainer and each generator server
    get STOP_TIMEOUT_S each at most, plus a minute for the launcher itself."""
    return (2 + run.servers) * STOP_TIMEOUT_S + 60.0


@dataclass
class _Active:
    """A running run: its launcher process, the GPUs it holds, and how far its console log was echoed."""

    run: SweepRun
    process: subprocess.Popen
    devices: range
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

    def reap(self) -> None:
        """SIGKILL every process still carrying the run's marker once its launcher has ended: its roles run in
        sessions of their own, and outlive a launcher that ended (or was killed) before stopping them."""
        for killed in kill_carrying(f"{SWEEP_RUN_ENV}={self.run.marker}"):
            print(f"sweep: {self.run.key}: killed {killed}, left behind by its launcher", flush=True)


def visible_gpu_count() -> int:
    """GPUs this process may use: torch counts those of an inherited CUDA_VISIBLE_DEVICES, else every device."""
    import torch

    return torch.cuda.device_count()


def check_room(runs: list[SweepRun], parallel: int, *, cuda: bool) -> None:
    """Refuse `--parallel` beyond what this machine holds (module docstring)."""
    if parallel == 1 or not runs:
        return
    need = (lambda r: r.gpus) if cuda else (lambda r: r.processes)
    widest = max(runs, key=need)
    have = visible_gpu_count() if cuda else len(os.sched_getaffinity(0))
    what = ("GPUs (trainer + generator GPUs, its cluster section)", "visible GPUs (CUDA_VISIBLE_DEVICES or all)") \
        if cuda else ("processes (trainer ranks + generator servers)", "CPU cores (os.sched_getaffinity)")
    if parallel * need(widest) > have:
        raise UserError(f"--parallel {parallel}: {parallel} runs x {need(widest)} {what[0]} ({widest.key}) need "
                        f"{parallel * need(widest)} {what[1]}; this machine gives {have}")


def _free_block(free: set[int], width: int, total: int) -> range | None:
    """The first `width` consecutive free GPUs among `total` visible ones (0-based), or None."""
    for start in range(total - width + 1):
        block = range(start, start + width)
        if free.issuperset(block):
            return block
    return None


def _command(run: SweepRun, resume: bool, tokenizer: str | None) -> list[str]:
    train = [sys.executable, "-m", "megatron_scalerl.commands", "train", "--run-dir", str(run.run_dir)]
    if resume:
        return [*train, "--resume"]
    return [*train, "--recipe", str(run.recipe_file), *(["--tokenizer", tokenizer] if tokenizer else [])]


def run_local(sweep: Sweep, keys: list[str], parallel: int, *, cuda: bool) -> int:
    """Run the sweep's runs `keys` (in order; done ones skipped) on this machine; 0 when every one is done, 1 when
    some failed, 128 + a stop signal when stopped."""
    todo = [key for key in keys if not sweep.done(key)]
    check_room([sweep.runs[k] for k in todo], parallel, cuda=cuda)
    gpus = visible_gpu_count() if cuda and parallel > 1 else 0  # one run at a time takes every visible GPU
    free = set(range(gpus))
    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    active: dict[str, _Active] = {}
    failed: list[str] = []
    progress = SweepProgress(keys, sweep.manifest["runs"], parallel)
    try:
        while (todo or active) and not stop:
            while todo and len(active) < parallel and not stop:
                run = sweep.runs[todo[0]]
                devices = _free_block(free, run.gpus, gpus) if gpus else range(0)
                if devices is None:
                    break
                todo.pop(0)
                env = {"CUDA_VISIBLE_DEVICES": cuda_devices(devices)} if gpus else {}
                if parallel > 1 and not cuda and "OMP_NUM_THREADS" not in os.environ:
                    env["OMP_NUM_THREADS"] = str(cpu_threads_per_process(parallel * run.processes))
                entry = _start(sweep, run, devices, env)
                if entry is not None:
                    print(progress.start(run.key), flush=True)
                    active[run.key] = entry
                    free.difference_update(devices)
            time.sleep(POLL_S)
            for key, entry in list(active.items()):
                entry.echo()
                code = entry.process.poll()
                if code is None:
                    continue
                del active[key]
                entry.log.close()
                entry.reap()
                free.update(entry.devices)
                if not _finish(sweep, key, code):
                    failed.append(key)
                print(progress.end(key, f"exit {code}"), flush=True)
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the runs' ordered stops short
            signal.signal(sig, signal.SIG_IGN)
        if active:
            _stop_all(sweep, active)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return outcome(stop, failed, stopped="stopped", to_continue="continue", failed_as="failed",
                   detail=lambda k: f"exit {sweep.manifest['runs'][k]['exit_code']}, {sweep.runs[k].console}")


def _start(sweep: Sweep, run: SweepRun, devices: range, env: dict[str, str]) -> _Active | None:
    """Start run `run`'s launcher with `env` added to ours (and the run's marker); None when the run turned out to
    be done (`Sweep.prepare`)."""
    mode = sweep.prepare(run.key)
    if mode is None:
        print(f"sweep: {run.key}: done ({sweep.manifest['runs'][run.key]['finished']}); not started", flush=True)
        return None
    run.console.parent.mkdir(parents=True, exist_ok=True)
    log = open(run.console, "ab")  # the child keeps its own descriptor
    echoed = log.tell()
    process = subprocess.Popen(_command(run, mode == "resume", sweep.manifest.get("tokenizer")), stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                               env={**os.environ, **env, SWEEP_RUN_ENV: run.marker})
    sweep.update(run.key, state="running", pid=process.pid, exit_code=None)
    print(f"sweep: {run.key}: {'resuming' if mode == 'resume' else 'starting'} in {run.run_dir} (pid {process.pid}"
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
    """SIGTERM every running launcher, wait for their ordered stops (the longest `stop_wait_s` of them at most),
    SIGKILL what is left of each run."""
    wait_s = max(stop_wait_s(entry.run) for entry in active.values())
    print(f"sweep: stopping {len(active)} run(s) (each checkpoints its trainer first; up to {wait_s:.0f} s)",
          flush=True)
    for entry in active.values():
        try:
            os.kill(entry.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    for key, entry in active.items():
        try:
            code = entry.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            print(f"sweep: {key}: its launcher did not stop within {wait_s:.0f} s; killing the run", flush=True)
            try:
                os.killpg(entry.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = entry.process.wait()
        entry.reap()  # its roles, whatever became of the launcher
        entry.echo()
        entry.log.close()
        sweep.update(key, state="stopped", pid=None, exit_code=code)
        sweep.done(key)  # it may have ended on its own meanwhile (exit 0)
