"""`scalerl train`: a whole run on one machine, its roles as plain processes (no Ray, no SLURM).

    scalerl train --recipe scalerl --model tiny_moe --tokenizer DIR [--run-dir runs/NAME] [--set k=v ...]
    scalerl train --run-dir runs/NAME --resume

Starts the generators (`scalerl serve`, one per `parallelism.generator_tp` generator GPUs), writes
`RUN/generators.json`, then the trainer (torchrun) and the orchestrator, each with its log under `RUN/logs/`; the
orchestrator's progress lines are echoed here. While the run goes on, a generator that dies is started again (the
trainer re-syncs it and the orchestrator's fleet takes it back). The run ends when the trainer and the orchestrator
have both finished; a role that fails ends it with exit 1 and its log's tail.

Ctrl-C or SIGTERM: the orchestrator stops first (its state is that of its last batch), then the trainer, which
checkpoints its current step, then the generators; exit 130. `--resume` continues from the checkpoints, the rollout
stream and the orchestrator's state. Roles run in sessions of their own, so a terminal's Ctrl-C reaches only this
process, which stops them in that order.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.launch.roles import (
    generator_command,
    orchestrator_command,
    prepare_run_dir,
    serving_dtype,
    tokenizer_source,
    trainer_command,
)
from megatron_scalerl.platform.local_workers import free_port
from megatron_scalerl.recipe import Recipe, load_recipe

POLL_S = 1.0
STOP_TIMEOUT_S = 120.0  # seconds a role gets to stop cleanly (the trainer's last checkpoint) before SIGKILL


@dataclass
class Role:
    """One role's process; `command` is started again by `start` (a generator after it died)."""

    name: str
    command: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    echo: bool = False  # copy its stdout lines to ours (the orchestrator's progress)
    process: subprocess.Popen | None = None
    restarts: int = 0

    def start(self) -> Role:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:  # the child keeps its own descriptor
            self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE if self.echo else out,
                                            stderr=out, stdin=subprocess.DEVNULL, start_new_session=True,
                                            env={**os.environ, **self.env})
        if self.echo:
            threading.Thread(target=self._tee, args=(self.process, self.log), daemon=True).start()
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

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the role's main process (it stops its own children: torchrun its workers, which must still have
        their checkpoint writers), wait up to `timeout_s` seconds, then SIGKILL whatever is left of its group."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # stragglers of the group (a server's engine core, a worker that did not stop)
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


class _Interrupted(Exception):
    pass


def _interrupt(*_: object) -> None:
    raise _Interrupted


def _wait_ready(generators: list[Role], urls: list[str], timeout_s: float) -> None:
    from megatron_scalerl.rollout.vllm_server import ServerError, wait_healthy

    deadline = time.monotonic() + timeout_s
    for role, url in zip(generators, urls, strict=True):
        try:
            wait_healthy(url, role.process, max(deadline - time.monotonic(), 0.0), what=f"{role.name} ({url})",
                         log_path=role.log, log_tail=role.tail)
        except ServerError as exc:
            raise UserError(str(exc)) from None


def start_run(run_dir: Path, recipe: Recipe, tokenizer_dir: Path) -> int:
    """A new run of `recipe` in `run_dir` (absent or empty) with the tokenizer in `tokenizer_dir`: prepare the run
    directory, then `run_local`; the exit code."""
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir} is not empty: continue it with --resume, or choose another --run-dir")
    prepare_run_dir(run_dir, recipe, tokenizer_dir)
    return run_local(run_dir, recipe, resume=False)


def run_local(run_dir: Path, recipe: Recipe, *, resume: bool, ready_timeout_s: float = 900.0) -> int:
    """Run every role of `recipe` on this machine until the run ends (see the module docstring); the exit code."""
    import torch

    from megatron_scalerl.run_dir import write_generators

    cuda = torch.cuda.is_available()
    logs = run_dir / "logs"
    servers = recipe.cluster.generator_gpus // recipe.parallelism.generator_tp
    urls, generators = [], []
    dtype = serving_dtype(recipe, cuda)
    for i in range(servers):
        port = free_port()
        urls.append(f"http://127.0.0.1:{port}")
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"} if not cuda else {"CUDA_VISIBLE_DEVICES": ",".join(
            str(recipe.cluster.trainer_gpus + i * recipe.parallelism.generator_tp + j)
            for j in range(recipe.parallelism.generator_tp))}
        generators.append(Role(f"generator {i}", generator_command(run_dir, recipe, port=port, host="127.0.0.1",
                                                                    dtype=dtype, log=logs / f"vllm_{i}.log"),
                               logs / f"generator_{i}.log", env))
    write_generators(run_dir, urls, dtype)
    trainer_env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(recipe.cluster.trainer_gpus)))} if cuda else {}
    trainer = Role("trainer", trainer_command(run_dir, recipe), logs / "trainer.log", trainer_env)
    orchestrator = Role("orchestrator", orchestrator_command(run_dir, resume=resume), logs / "orchestrator.log",
                        echo=True)
    roles = [orchestrator, trainer, *generators]  # the order they stop in
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for role in generators:
            role.start()
        print(f"run {run_dir}: starting {servers} generator(s); logs in {logs}", flush=True)
        _wait_ready(generators, urls, ready_timeout_s)
        trainer.start()
        orchestrator.start()
        print(f"run {run_dir}: trainer and orchestrator started", flush=True)
        return _supervise(trainer, orchestrator, generators)
    except _Interrupted:
        print(f"run {run_dir}: stopping (the trainer checkpoints first); resume with --resume", flush=True)
        return 130
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the ordered stop short (each role is bounded in time)
            signal.signal(sig, signal.SIG_IGN)
        for role in roles:
            role.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(trainer: Role, orchestrator: Role, generators: list[Role]) -> int:
    finished: set[str] = set()
    while True:
        for role in (trainer, orchestrator):
            code = role.process.poll()
            if code is None or role.name in finished:
                continue
            if code != 0:
                print(f"{role.name} failed (exit {code}); {role.log}:\n{role.tail()}", file=sys.stderr, flush=True)
                return 1
            finished.add(role.name)
        if finished == {trainer.name, orchestrator.name}:
            return 0
        for role in generators:
            if role.process.poll() is not None:
                role.restarts += 1
                print(f"{role.name} exited (code {role.process.returncode}); starting it again "
                      f"(restart {role.restarts}); the trainer re-syncs its weights", flush=True)
                role.start()
        time.sleep(POLL_S)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="run a whole RL run on this machine (generators, trainer, orchestrator)")
    parser.add_argument("--recipe", help="preset name or recipe YAML (not with --resume: the run's own is used)")
    parser.add_argument("--model", dest="model_preset", help="model preset, or hf:DIR")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: runs/<recipe name>)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: trainer.init_from's)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    parser.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    if args.resume:
        if args.run_dir is None or not (args.run_dir / "recipe.yaml").is_file():
            raise UserError("--resume needs --run-dir of an existing run (with its recipe.yaml)")
        if args.recipe or args.model_preset or args.overrides:
            raise UserError("--resume continues the run's own recipe.yaml: drop --recipe, --model and --set")
        return run_local(args.run_dir, load_recipe(args.run_dir / "recipe.yaml"), resume=True)
    if not args.recipe:
        raise UserError("give --recipe (a preset name or YAML file), or --resume with --run-dir")
    recipe = load_recipe(args.recipe, args.overrides, args.model_preset)
    return start_run(args.run_dir or Path("runs") / recipe.name, recipe, tokenizer_source(recipe, args.tokenizer))
