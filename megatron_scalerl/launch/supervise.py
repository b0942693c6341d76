"""Run a run's roles as processes and watch them: the part that `scalerl train` (one machine) and the SLURM job
(`launch/slurm.py`, each role behind an `srun`) share.

    generators + trainer -> wait until the generators are healthy -> orchestrator -> watch -> ordered stop

The trainer starts beside the generators: its start (imports, model build, checkpoint load) overlaps theirs, and it
sends its weights once a generator answers (`GeneratorLink.first_push`; later ones get them from `catch_up`). The
orchestrator starts once every generator answers; a generator that exits before then, or a trainer that fails,
ends the launch with its log's tail.

The run ends when the trainer and the orchestrator have both finished (exit 0). When one of them fails (any trainer
rank: torchrun ends them all), the launch heals itself within its restart budget (`Restarts`, the recipe's
`launch.max_restarts`): it prints the cause and the failed role's log tail, stops both (the orchestrator first; a
trainer still alive checkpoints its current step), waits its backoff (doubling per restart), rewinds the stream and
the metrics to the checkpoint the trainer will resume from (`Restarts.prepare`), tags each live generator's weights
as lost (`algo.versions.LOST_TAG`: a generator still holding a lost policy must not sample for the new
orchestrator, which takes no work to a server without a version; an update the failed trainer left open is closed
first; one that does not answer, e.g. stuck in a receive of the failed trainer's weights, is started again at
once), starts the trainer again, waits until every
live generator serves a version of the restarted trainer (it re-sends its weights, and may be steps further by
then; one that does not get them within STUCK_GENERATOR_S is started again), then starts the orchestrator with
`--resume`. Each
restart is a `launcher` record in metrics.jsonl (`launch/restarts`, `launch/restart_cause`). Once the budget is
spent, the next failure ends the launch (exit 1) with its cause: a failure that repeats at the same step never loops.
Under SLURM any role's exit (a generator's too) on an allocation that lost a node (`Restarts.allocation_lost`)
ends the launch with ALLOCATION_LOST instead, and the job goes on in a new allocation (`launch/slurm.py`); a failure
that would end the launch for good first waits up to `Restarts.settle_s` (SlurmdTimeout) for SLURM to report such a
node, since a step on a node whose slurmd died fails at once and SLURM reports the node only later.
A generator that exits is started again (the trainer re-syncs it, the orchestrator's fleet takes
it back); one that keeps dying within `QUICK_EXIT_S` seconds of its start (on a node that answers) is given up after
`QUICK_EXITS` tries and the fleet goes on without it; with no generator left the run fails.

What the supervisor watches in the run directory (`RunWatch`, given the run's): a generator that cannot take the
trainer's weights, which the trainer asks to be started again (`run_dir.request_generator_restart`), is started
again (the trainer re-syncs it); asked for `again` (it failed once more after such a restart), the run stops (exit 1)
with one line naming it and the cause. And the watchdog: metrics.jsonl not moved for longer than the run's deadline
(`run.deadlines`, over the intervals between the trainer's logged steps of this launch) is said on the console and
in `RUN/logs/launcher.log`, naming the role waited on and its log's last line, once per deadline that passes (the
roles' own deadlines end or heal the run: the watchdog only says).

A stop signal (`stop_signals`: Ctrl-C, SIGTERM, SLURM's time-limit warning) stops the roles in order: the
orchestrator (its state on disk is that of its last batch), the trainer (it checkpoints its current step; the
launchers ask it through `RUN/stop_requested`, see `run_dir`), the generators; the exit code is then 128 + the
signal's number. Every role runs in a session of its own, so a terminal's Ctrl-C reaches only the supervisor, which
stops them in that order.

Every role's processes carry this launch's id in their environment (`LAUNCH_ENV`); once the roles are stopped, any
process of this machine still carrying it is killed. Process groups alone miss some: torchrun starts each worker in a
session of its own and, when a worker was SIGKILLed, signals only the live ones, so what the dead worker had started
(megatron-core's checkpoint-writer Manager) would live on, re-parented to init.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_scalerl.algo.versions import LOST_TAG, parse_version
from megatron_scalerl.errors import UserError
from megatron_scalerl.http_json import TLS_CA_ENV, ServerError, request_json
from megatron_scalerl.run.deadlines import Deadline, minutes
from megatron_scalerl.run.directory import (
    API_KEY_ENV,
    STOP_TIMEOUT_S,
    generator_restart_requests,
    take_generator_restart,
)
from megatron_scalerl.run.metrics_log import METRICS_FILE

POLL_S = 1.0
QUICK_EXIT_S = 60.0  # a generator that exits this soon after its start counts as a quick exit
QUICK_EXITS = 3  # quick exits in a row after which a generator is given up
LAUNCH_ENV = "SCALERL_LAUNCH_ID"  # in every role's environment: what a launch started, its children included
KILL_WAIT_S = 10.0  # how long kill_carrying waits for what it killed to be gone
TEE_DRAIN_S = 10.0  # how long a stopped role's echo may take to copy what its process wrote before it ended
MAX_BACKOFF_S = 300.0  # the longest wait before a restart of the trainer and the orchestrator
ALLOCATION_LOST = 75  # run_roles' exit code when a role failed and its allocation cannot run it again (EX_TEMPFAIL)
STUCK_GENERATOR_S = 300.0  # a live generator without the restarted trainer's weights after this long is restarted
CONTROL_TIMEOUT_S = 10.0  # a generator's answer to the supervisor's calls (/weight_info, /update_weight_version)
WATCH_S = 10.0  # how often the watchdog reads metrics.jsonl
LAUNCHER_LOG = "launcher.log"  # RUN/logs/: what the watchdog said


@dataclass
class Restarts:
    """The launch's budget for restarting a failed trainer or orchestrator. `prepare(restart, cause)`, called with
    both stopped (`restart`: 1 for the first): rewinds the run to the checkpoint the trainer resumes from, records
    the restart, and returns that checkpoint's step (the policy version the trainer re-sends); `resumed_orchestrator`:
    the orchestrator's command continuing the run. Waits `backoff_s` x 2^(restart - 1) seconds (at most
    MAX_BACKOFF_S) before each restart."""

    max_restarts: int
    backoff_s: float
    prepare: Callable[[int, str], int]
    resumed_orchestrator: list[str]
    # why this allocation cannot run the roles again (SLURM: a lost node), asked before each restart; a reason ends
    # the launch with ALLOCATION_LOST instead (the SLURM job then goes on in a new allocation: launch/slurm.py)
    allocation_lost: Callable[[], str | None] = lambda: None
    # how long a node that stopped answering may take to show in allocation_lost (SLURM: SlurmdTimeout, after which
    # it declares the node DOWN), waited before a failure ends the launch for good: a step on a lost node fails at
    # once, before SLURM reports the node
    settle_s: float = 0.0
    done: int = 0

    @classmethod
    def none(cls) -> Restarts:
        """No restart: a failure ends the launch."""
        return cls(0, 0.0, lambda restart, cause: 0, [])

    def lost(self, what: str, *, final: bool = False) -> bool:
        """Whether the allocation cannot run the roles again (`allocation_lost`); says so, naming `what` happened.
        `final`: the launch ends for good otherwise, so it asks again every POLL_S until `settle_s` have passed."""
        reason = self.allocation_lost()
        if not reason and final and self.settle_s:
            print(f"{what}: waiting up to {self.settle_s:g} s for SLURM to report whether a node of this allocation is "
                  "lost", file=sys.stderr, flush=True)
            deadline = time.monotonic() + self.settle_s
            while not reason and time.monotonic() < deadline:
                time.sleep(POLL_S)
                reason = self.allocation_lost()
        if reason:
            print(f"{what} and this allocation cannot run it again: {reason}", file=sys.stderr, flush=True)
        return bool(reason)


@dataclass
class Role:
    """One role's process; `command` is started again by `start` (a generator after it died)."""

    name: str
    command: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    echo: bool = False  # copy its stdout lines to ours (the orchestrator's progress)
    terminate: Callable[[], bool] | None = None  # asks the role to stop; False: do it with SIGTERM (srun's tasks
    # must get the signal from SLURM: a SIGTERM to srun itself kills them at once)
    process: subprocess.Popen | None = None
    tee: threading.Thread | None = None  # with `echo`: copies the process's stdout to its log and ours until EOF
    started: float = 0.0  # time.monotonic() of the last start
    log_start: int = 0  # the log's size (bytes) at the last start: what this run of the role wrote follows it
    restarts: int = 0
    quick_exits: int = 0  # in a row

    def start(self) -> Role:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log_start = self.log.stat().st_size if self.log.is_file() else 0
        with open(self.log, "ab") as out:  # the child keeps its own descriptor
            self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE if self.echo else out,
                                            stderr=out, stdin=subprocess.DEVNULL, start_new_session=True,
                                            env={**os.environ, **self.env})
        self.started = time.monotonic()
        if self.echo:
            self.tee = threading.Thread(target=self._tee, args=(self.process, self.log), daemon=True)
            self.tee.start()
        return self

    @staticmethod
    def _tee(process: subprocess.Popen, log: Path) -> None:
        with open(log, "ab") as out:
            for line in process.stdout:
                out.write(line)
                out.flush()
                sys.stdout.write(line.decode(errors="replace"))
                sys.stdout.flush()

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    def last_error(self, limit: int = 400) -> str | None:
        """The message of the last ERROR record this run of the role logged (our roles log
        "<time> <role> ERROR <message>" before they exit on an error: the cause, where a torchrun summary or a
        traceback ends the log), at most `limit` characters; None without one."""
        if not self.log.is_file():
            return None
        with open(self.log, "rb") as handle:  # its last MiB: a log of days is large, its end is what counts
            handle.seek(max(self.log_start, self.log.stat().st_size - 2**20))
            text = handle.read().decode(errors="replace")
        errors = [line.split(" ERROR ", 1)[1] for line in text.splitlines() if " ERROR " in line]
        return errors[-1][:limit] if errors else None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the role to stop (`terminate`, else SIGTERM to its main process, which stops its own children: torchrun
        its workers, which must still have their checkpoint writers), wait up to `timeout_s` seconds, then SIGKILL
        what is left of its process group."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                if self.terminate is None or not self.terminate():
                    self.process.send_signal(signal.SIGTERM)
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # stragglers of the group (a server's engine core, a worker that did not stop)
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        if self.tee is not None:  # its last lines (a run's summary) reach the log and our stdout before we exit
            self.tee.join(timeout=TEE_DRAIN_S)


class RunWatch:
    """What the supervisor watches in run directory `run_dir` (the module docstring): the trainer's requests to
    start a generator again, and the watchdog over `metrics.jsonl` with the run's `deadline` (`logged_every`: the
    trainer's `logging.log_interval`: a batch that many steps ahead of its last row is not yet the trainer's to
    log)."""

    def __init__(self, run_dir: Path, deadline: Deadline, *, logged_every: int = 1):
        self.run_dir, self.deadline, self.logged_every = Path(run_dir), deadline, logged_every
        self.log = self.run_dir / "logs" / LAUNCHER_LOG
        self.offset, self.inode = 0, None
        self.steps: dict[str, int] = {}  # role -> the last step it logged (the orchestrator's: batches written)
        self.trainer_time: float | None = None  # `time` of the trainer's last row with a step
        self.moved = time.monotonic()
        self.said = 0  # deadlines said since the metrics last moved
        self.read_at = 0.0

    def start(self) -> None:
        """At the launch's start: stale restart requests (of an earlier launch) go; the metrics so far are read."""
        for index in generator_restart_requests(self.run_dir):
            take_generator_restart(self.run_dir, index)
        self._read(timed=False)
        self.trainer_time, self.moved, self.said = None, time.monotonic(), 0

    def requests(self) -> dict[int, dict]:
        return generator_restart_requests(self.run_dir)

    def take(self, index: int) -> None:
        take_generator_restart(self.run_dir, index)

    def _read(self, *, timed: bool = True) -> None:
        """The rows appended since the last read (all of them after a rewind replaced the file)."""
        path = self.run_dir / METRICS_FILE
        try:
            stat = path.stat()
        except FileNotFoundError:
            return
        if self.inode is not None and (stat.st_ino != self.inode or stat.st_size < self.offset):
            self.offset, timed = 0, False  # a rewind moved rows aside: read it again
            self.steps, self.trainer_time = {}, None
            self.moved = time.monotonic()
        self.inode = stat.st_ino
        if stat.st_size == self.offset:
            return
        with open(path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1  # a row being written is read next time
        self.offset += end
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            role = row.get("role")
            if role not in ("trainer", "orchestrator"):
                continue  # the launcher's restarts, an evaluation: not the run's steps
            self.moved, self.said = time.monotonic(), 0
            self.steps[role] = max(self.steps.get(role, 0), int(row.get("step", 0)))
            if role == "trainer" and "train/loss" in row:
                if timed and self.trainer_time is not None:
                    self.deadline.record(float(row["time"]) - self.trainer_time)
                self.trainer_time = float(row["time"])

    def check(self, trainer: Role, orchestrator: Role) -> str | None:
        """Every WATCH_S: what the watchdog says now (printed and logged), or None."""
        now = time.monotonic()
        if now - self.read_at < WATCH_S:
            return None
        self.read_at = now
        self._read()
        quiet = now - self.moved
        if quiet <= self.deadline.seconds() * (self.said + 1):
            return None
        self.said += 1
        waited = self.waited_on(trainer, orchestrator)
        last = (waited.tail(1).strip() or "nothing yet")[-300:]
        words = (f"no step for {minutes(quiet)} ({self.deadline.why()}): waiting on the {waited.name} (its last "
                 f"line: {last})")
        print(f"watchdog: {words}", flush=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as handle:
            handle.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} watchdog: {words}\n")
        return words

    def waited_on(self, trainer: Role, orchestrator: Role) -> Role:
        """The role the run waits on: the trainer when a batch it has not logged is written (or the orchestrator has
        ended), else the orchestrator (the trainer waits for a batch, or has ended)."""
        if orchestrator.process is not None and orchestrator.process.poll() is not None:
            return trainer
        if trainer.process is not None and trainer.process.poll() is not None:
            return orchestrator
        ahead = self.steps.get("orchestrator", 0) >= self.steps.get("trainer", 0) + self.logged_every
        return trainer if ahead else orchestrator


class _Stop(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signum)


def _wait_ready(generators: list[Role], urls: list[str], trainer: Role, timeout_s: float) -> None:
    """Return once every generator answers /health; UserError naming the role, with its log's tail, when a generator
    exits first or the trainer (starting meanwhile) fails, or when `timeout_s` seconds pass. (A trainer that exits 0
    had nothing left to train: the orchestrator still runs.)"""
    from megatron_scalerl.inference.vllm_server import (
        wait_healthy,  # deferred: torch; the supervisor process stays light
    )

    def trainer_alive() -> None:
        code = trainer.process.poll()
        if code not in (None, 0):
            raise UserError(f"{trainer.name} exited with code {code} while the generators started; "
                            f"{trainer.log}:\n{trainer.tail()}")

    deadline = time.monotonic() + timeout_s
    for role, url in zip(generators, urls, strict=True):
        try:
            wait_healthy(url, role.process, max(deadline - time.monotonic(), 0.0), what=f"{role.name} ({url})",
                         log_path=role.log, log_tail=role.tail, check=trainer_alive)
        except ServerError as exc:
            raise UserError(str(exc)) from None


def run_roles(label: str, generators: list[Role], urls: list[str], trainer: Role, orchestrator: Role, *,
              api_key: str, tls_ca: Path | None = None, restarts: Restarts | None = None,
              ready_timeout_s: float = 900.0, stop_signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
              watch: RunWatch | None = None) -> int:
    """Start and watch the roles (generator i serves `urls[i]`) until the run ends or a stop signal comes; the exit
    code (0, 1, or 128 + the stop signal's number). `label` names the run in progress lines; `api_key`: the run's
    key (`run_dir.run_api_key`), which every role gets in `$SCALERL_API_KEY` (the generators ask for it, the others
    present it) and the supervisor's own calls present; `tls_ca`: the run's certificate (`run.tls.run_tls`) when
    the generators serve HTTPS, in `$SCALERL_TLS_CA` for every role and for this process while the roles run (every
    client of ours verifies their https URLs against it: `http_json`); `restarts`: the budget for restarting a
    failed trainer or orchestrator (default: none); `watch`: the run directory's requests and the watchdog
    (`RunWatch`; default: none)."""
    if not api_key:
        raise UserError(f"{label}: no API key: a launch never starts its generators open")
    previous = {sig: signal.signal(sig, _raise_stop) for sig in stop_signals}
    launch_id = uuid.uuid4().hex
    for role in (*generators, trainer, orchestrator):
        role.env[LAUNCH_ENV] = launch_id
        role.env[API_KEY_ENV] = api_key
        if tls_ca is not None:
            role.env[TLS_CA_ENV] = str(tls_ca)
    trusted = os.environ.get(TLS_CA_ENV)
    if tls_ca is not None:
        os.environ[TLS_CA_ENV] = str(tls_ca)  # the supervisor's own calls (/health, the restarts' control)
    try:
        if watch is not None:
            watch.start()
        for role in generators:
            role.start()
        trainer.start()
        print(f"{label}: starting {len(generators)} generator(s) and the trainer; logs in {trainer.log.parent}",
              flush=True)
        _wait_ready(generators, urls, trainer, ready_timeout_s)
        orchestrator.start()
        print(f"{label}: generators ready, orchestrator started", flush=True)
        return _supervise(trainer, orchestrator, generators, urls, restarts, ready_timeout_s, api_key, watch)
    except _Stop as stop:
        print(f"{label}: {stop} received: stopping (the trainer checkpoints first)", flush=True)
        return 128 + stop.signum
    finally:
        for sig in previous:  # a second signal must not cut the ordered stop short (each role is bounded in time)
            signal.signal(sig, signal.SIG_IGN)
        for role in (orchestrator, trainer, *generators):
            role.stop()
        for straggler in kill_carrying(f"{LAUNCH_ENV}={launch_id}"):
            print(f"{label}: killed {straggler}, left behind by a stopped role", flush=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if tls_ca is not None and trusted is None:
            os.environ.pop(TLS_CA_ENV, None)
        elif tls_ca is not None:
            os.environ[TLS_CA_ENV] = trusted


def processes_with_environment(*entries: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process of this machine but this one whose environment has, for each of
    `entries` ("KEY=VALUE", or "KEY=" for any value), a variable starting with it (those /proc lets us read)."""
    wanted = [entry.encode() for entry in entries]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environment = (proc / "environ").read_bytes().split(b"\0")
            if all(any(variable.startswith(w) for variable in environment) for w in wanted):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                found.append((int(proc.name), command))
        except (FileNotFoundError, ProcessLookupError, PermissionError):  # gone meanwhile, or not ours
            continue
    return found


def kill_carrying(entry: str) -> list[str]:
    """SIGKILL every process of this machine whose environment holds `entry` ("NAME=value", matched as in
    `processes_with_environment`); one "pid (command line)" for each killed. Returns once none of them runs any
    more (a SIGKILL takes effect when the kernel next schedules the process), or after KILL_WAIT_S."""
    killed = {}
    for pid, command in processes_with_environment(entry):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed[pid] = f"{pid} ({command[:120]})"
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline and any(pid in killed for pid, _ in processes_with_environment(entry)):
        time.sleep(0.05)  # a dead process that is not reaped yet has no environment left to match
    return list(killed.values())


def _supervise(trainer: Role, orchestrator: Role, generators: list[Role], urls: list[str] = (),
               restarts: Restarts | None = None, ready_timeout_s: float = 900.0, api_key: str | None = None,
               watch: RunWatch | None = None) -> int:
    restarts = restarts or Restarts.none()
    finished: set[str] = set()
    live = list(generators)
    while True:
        for role in (trainer, orchestrator):
            code = role.process.poll()
            if code is None or role.name in finished:
                continue
            if code != 0:
                error = role.last_error()
                cause = f"{role.name} failed (exit {code})" + (f": {error}" if error else "")
                print(f"{cause}; {role.log}:\n{role.tail()}", file=sys.stderr, flush=True)
                if restarts.lost(cause, final=restarts.done >= restarts.max_restarts):
                    return ALLOCATION_LOST
                if restarts.done >= restarts.max_restarts:
                    if restarts.max_restarts:
                        print(f"no restart left (launch.max_restarts {restarts.max_restarts} spent): the run stops; "
                              f"last cause: {cause}", file=sys.stderr, flush=True)
                    return 1
                _restart(trainer, orchestrator, generators, urls, restarts, cause, ready_timeout_s, api_key)
                finished.clear()
                break
            finished.add(role.name)
        if finished == {trainer.name, orchestrator.name}:
            return 0
        for role in list(live):
            if role.process.poll() is None:
                continue
            if restarts.lost(f"{role.name} exited (code {role.process.returncode})"):
                return ALLOCATION_LOST
            quick = time.monotonic() - role.started < QUICK_EXIT_S
            role.quick_exits = role.quick_exits + 1 if quick else 0
            if role.quick_exits >= QUICK_EXITS:
                live.remove(role)
                print(f"{role.name} exited {QUICK_EXITS} times within {QUICK_EXIT_S:.0f} s of its start (code "
                      f"{role.process.returncode}): given up, the fleet goes on without it; {role.log}:\n"
                      f"{role.tail(5)}", file=sys.stderr, flush=True)
                if not live:
                    if restarts.lost("no generator left", final=True):
                        return ALLOCATION_LOST
                    print("no generator left: the run cannot go on", file=sys.stderr, flush=True)
                    return 1
                continue
            role.restarts += 1
            print(f"{role.name} exited (code {role.process.returncode}); starting it again (restart "
                  f"{role.restarts}); the trainer re-syncs its weights", flush=True)
            role.start()
        if watch is not None:
            if _restart_refusing(watch, generators, urls, live):
                return 1
            watch.check(trainer, orchestrator)
        time.sleep(POLL_S)


def _restart_refusing(watch: RunWatch, generators: list[Role], urls: list[str], live: list[Role]) -> bool:
    """Act on the trainer's requests to start a generator that cannot take its weights again (the module
    docstring); True: one asked for `again`, the run stops (said in one line)."""
    for index, request in watch.requests().items():
        role = generators[index] if index < len(generators) else None
        url = urls[index] if index < len(urls) else request.get("url")
        cause = " ".join(str(request.get("cause", "")).split())
        if role is not None and request.get("again"):
            print(f"the run stops: {role.name} ({url}) cannot take the trainer's weights, even after a restart: "
                  f"{cause}", file=sys.stderr, flush=True)
            return True
        if role is not None and role in live:
            role.restarts += 1
            print(f"{role.name} ({url}) cannot take the trainer's weights ({cause}): starting it again (restart "
                  f"{role.restarts}); the trainer re-syncs it", flush=True)
            role.stop(timeout_s=10.0)  # gone before the request is: the trainer then sends only to the new one
            role.start()
        watch.take(index)
    return False


def _restart(trainer: Role, orchestrator: Role, generators: list[Role], urls: list[str], restarts: Restarts,
             cause: str, ready_timeout_s: float, api_key: str | None) -> None:
    """One restart of the trainer and the orchestrator (the module docstring). Each live generator's weights are
    tagged lost first (`_tag_lost`); one that cannot be (stuck in a receive of the failed trainer's weights) is started
    again at once. A generator that then does not serve a policy of the restarted trainer within STUCK_GENERATOR_S
    (ready_timeout_s for one started again) is started (again), and gets the weights as any restarted generator
    does. UserError when the trainer fails again before the generators have its weights, or a generator started
    again does not get them within `ready_timeout_s` seconds."""
    restarts.done += 1
    backoff = min(restarts.backoff_s * 2 ** (restarts.done - 1), MAX_BACKOFF_S)
    print(f"{cause}: restarting the trainer and the orchestrator from the last checkpoint in {backoff:.0f} s "
          f"(restart {restarts.done} of {restarts.max_restarts})", flush=True)
    orchestrator.stop()
    trainer.stop()
    time.sleep(backoff)
    step = restarts.prepare(restarts.done, cause)
    orchestrator.command = restarts.resumed_orchestrator
    started_again = set()
    for role, url in zip(generators, urls, strict=True):
        if role.process.poll() is None and not _tag_lost(url, api_key):
            print(f"{role.name} ({url}) cannot be readied for the restarted trainer (stuck in a receive of the failed "
                  "trainer's weights?): starting it again", flush=True)
            role.stop(timeout_s=10.0)
            role.start()
            started_again.add(role.name)
    trainer.start()
    for role, url in zip(generators, urls, strict=True):
        if role.process.poll() is not None:
            continue  # dead: the watch loop starts it again, and the trainer re-syncs it before it gets work
        if role.name not in started_again and not _wait_version(url, step, trainer, STUCK_GENERATOR_S, api_key):
            print(f"{role.name} ({url}) did not get the restarted trainer's weights (policy {step} or later) within "
                  f"{STUCK_GENERATOR_S:.0f} s: starting it again", flush=True)
            role.stop(timeout_s=10.0)
            role.start()
            started_again.add(role.name)
        if role.name in started_again and not _wait_version(url, step, trainer, ready_timeout_s, api_key):
            raise UserError(f"{role.name} ({url}) did not get the restarted trainer's weights (policy {step} or "
                            f"later) within {ready_timeout_s:g} s of its own restart; {role.log}:\n{role.tail()}")
    orchestrator.start()
    print(f"restart {restarts.done}: the trainer resumed from step {step} and the generators serve its weights; the "
          "orchestrator continues", flush=True)


def _control(url: str, path: str, api_key: str | None, body: object = None, method: str = "POST") -> object:
    """One supervisor call to the generator at `url` with the run's `api_key`, bounded by CONTROL_TIMEOUT_S;
    ServerError when it fails."""
    return request_json(url, path, body, method=method, timeout_s=CONTROL_TIMEOUT_S, api_key=api_key)


def _tag_lost(url: str, api_key: str | None) -> bool:
    """Tag the weights of the generator at `url` as a lost policy's (`algo.versions.LOST_TAG`); when the failed
    trainer died inside a push (the server is paused: only a push pauses it), first close the update it may have left
    open (/finish_weight_update, tagged lost: the restarted trainer's push replaces every weight). Whether the tag
    was taken within CONTROL_TIMEOUT_S (False: stuck, e.g. in a receive; it is started again)."""

    try:
        if (_control(url, "/is_paused", api_key, method="GET") or {}).get("is_paused"):
            try:
                _control(url, "/finish_weight_update", api_key, {"weight_version": LOST_TAG})
            except ServerError:
                pass  # paused outside an update (before its start, after its finish): nothing open to close
        _control(url, "/update_weight_version", api_key, {"new_version": LOST_TAG})
        return True
    except ServerError:
        return False


def _wait_version(url: str, version: int, trainer: Role, timeout_s: float, api_key: str | None) -> bool:
    """Whether the generator at `url`, its weights tagged lost (`_tag_lost`) or fresh, serves policy `version` or a
    later one (its /weight_info: the restarted trainer may have trained on by then) within `timeout_s` seconds;
    UserError with the trainer's log tail when the trainer exits first without it there."""

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = _control(url, "/weight_info", api_key, method="GET")
            if parse_version((answer or {}).get("weight_version")) >= version:
                return True
        except ServerError:
            pass  # starting, or busy: asked again
        if trainer.process.poll() is not None:
            raise UserError(f"{trainer.name} exited with code {trainer.process.returncode} before the generators "
                            f"had its weights; {trainer.log}:\n{trainer.tail()}")
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
