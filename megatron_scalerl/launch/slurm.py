"""The SLURM job: what `slurm/scalerl_moe.sbatch` and `slurm/scalerl_dense.sbatch` run in their batch step, on the
first trainer node of a het-job (group 0: trainer nodes, group 1: generator nodes).

    python -m megatron_scalerl.launch.slurm job          # preflight (unless SCALERL_PREFLIGHT=0), then the run
    python -m megatron_scalerl.launch.slurm preflight    # the checks alone (slurm/preflight.sbatch)

The roles are the local launcher's (`launch/roles.py` command lines, `launch/supervise.py` watching them), each
started through `srun` on its nodes:

    generator i   srun --het-group=1 -w NODE --ntasks=1 ... scalerl serve --host 0.0.0.0 --port BASE+2+i ...
    trainer       srun --het-group=0 --ntasks-per-node=1 ... torchrun --nnodes=N --master-addr=TRAINER0 ...
    orchestrator  a plain child of this process (the batch step runs on the first trainer node)

Addresses come from the allocation (`scontrol show node`'s NodeAddr), ports from the job id (BASE = 20000 + 100 x
(job id mod 400)), so two jobs on shared nodes do not meet. Settings (the sbatch file's defaults, or
`sbatch --export=ALL,NAME=VALUE`):

    SCALERL_RUN_DIR     the run directory (required); one that holds recipe.yaml is continued, never restarted
    SCALERL_RECIPE      preset or recipe YAML of a new run;  SCALERL_MODEL: model preset or hf:DIR
    SCALERL_SET         space-separated KEY=VALUE overrides of a new run;  SCALERL_TOKENIZER: tokenizer directory
    SCALERL_PREFLIGHT   1 (default) or 0;  SCALERL_MIN_BUSBW_GBPS: preflight's all-reduce floor (see preflight.py)

SLURM's time-limit warning (`#SBATCH --signal=B:USR1@SECONDS`) stops the roles in order (the trainer checkpoints)
and requeues the job (`scontrol requeue`); the requeued job continues the run from its checkpoints. SIGTERM
(scancel) stops them the same way without a requeue. A generator that keeps failing (its node is gone; the sbatch
files ask for `--no-kill`) is given up and the run goes on with the others.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.launch.roles import (
    generator_command,
    orchestrator_command,
    prepare_run_dir,
    say_launch_notes,
    serving_dtype,
    tokenizer_source,
    trainer_command,
)
from megatron_scalerl.launch.supervise import Role, run_roles
from megatron_scalerl.recipe import Recipe, load_recipe

SCONTROL_TIMEOUT_S = 60.0
TRAINER_GROUP, GENERATOR_GROUP = 0, 1


def _scontrol(*args: str) -> str:
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"scontrol {' '.join(args)}: {exc}") from None
    if done.returncode != 0:
        raise UserError(f"scontrol {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def _per_node_count(value: str | None) -> int | None:
    """The count in SLURM's per-node figures: "8", "gpu:8", "h100:8", "64(x4)" -> 8, 8, 8, 64."""
    if not value:
        return None
    match = re.search(r"(\d+)(?:\(x\d+\))?$", value.split(",")[0])
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Node:
    name: str
    addr: str  # where other nodes reach it (NodeAddr; the name itself on most clusters)


@dataclass(frozen=True)
class Group:
    """One het-job component: its nodes, and the GPUs (None: no GRES) and CPUs it holds on each."""

    nodes: list[Node]
    gpus_per_node: int | None
    cpus_per_node: int | None


@dataclass(frozen=True)
class Allocation:
    job_id: int
    restarts: int  # SLURM_RESTART_COUNT: how often this job was requeued
    trainer: Group
    generator: Group
    component_ids: tuple[str, ...] = ()  # the het components' own job ids (their steps are listed under them)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Allocation:
        env = dict(os.environ if env is None else env)
        if "SLURM_JOB_ID" not in env:
            raise UserError("not inside a SLURM job: submit slurm/scalerl_moe.sbatch (or scalerl_dense.sbatch) with "
                            "sbatch")
        if env.get("SLURM_HET_SIZE") != "2":
            raise UserError(f"job {env['SLURM_JOB_ID']} is not a two-component het-job (SLURM_HET_SIZE="
                            f"{env.get('SLURM_HET_SIZE')}): group 0 must be the trainer nodes, group 1 the "
                            "generator nodes, as in slurm/scalerl_moe.sbatch")
        names = [_scontrol("show", "hostnames", env[f"SLURM_JOB_NODELIST_HET_GROUP_{g}"]).split() for g in (0, 1)]
        addrs = _node_addresses([n for group in names for n in group])
        groups = [Group([Node(n, addrs[n]) for n in names[g]],
                        _per_node_count(env.get(f"SLURM_GPUS_PER_NODE_HET_GROUP_{g}")),
                        _per_node_count(env.get(f"SLURM_JOB_CPUS_PER_NODE_HET_GROUP_{g}"))) for g in (0, 1)]
        components = tuple(env.get(f"SLURM_JOB_ID_HET_GROUP_{g}", env["SLURM_JOB_ID"]) for g in (0, 1))
        return cls(int(env["SLURM_JOB_ID"]), int(env.get("SLURM_RESTART_COUNT", "0")), *groups, components)

    def check(self, recipe: Recipe) -> None:
        """Refuse an allocation smaller than the recipe's cluster section, naming both."""
        cluster, problems = recipe.cluster, []
        for what, group, nodes in (("trainer", self.trainer, cluster.trainer_nodes),
                                   ("generator", self.generator, cluster.generator_nodes)):
            if len(group.nodes) < nodes:
                problems.append(f"{what} group has {len(group.nodes)} node(s), the recipe needs cluster.{what}_nodes"
                                f"={nodes}")
            if group.gpus_per_node is not None and group.gpus_per_node < cluster.gpus_per_node:
                problems.append(f"{what} group holds {group.gpus_per_node} GPU(s) per node, the recipe needs "
                                f"cluster.gpus_per_node={cluster.gpus_per_node}")
        if problems:
            raise UserError(f"job {self.job_id}: the allocation does not fit the recipe: {'; '.join(problems)} "
                            "(set the sbatch file's --nodes/--gpus-per-node per het group, or the recipe's cluster "
                            "section)")

    @property
    def base_port(self) -> int:
        return 20000 + 100 * (self.job_id % 400)

    def rendezvous(self) -> str:
        return f"{self.trainer.nodes[0].addr}:{self.base_port}"

    def generator_ports(self, servers: int) -> list[int]:
        if servers > 98:
            raise UserError(f"{servers} generator servers: at most 98 per job (raise parallelism.generator_tp)")
        return [self.base_port + 2 + i for i in range(servers)]


def _node_addresses(names: list[str]) -> dict[str, str]:
    addrs = {}
    for line in _scontrol("-o", "show", "node", ",".join(names)).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            addrs[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return {n: addrs.get(n, n) for n in names}


def srun(group: int, *, nodes: int, ntasks_per_node: int = 1, nodelist: str | None = None,
         gpus_per_task: int | None = None, cpus_per_task: int | None = None, name: str) -> list[str]:
    """An `srun` prefix for one step in het group `group` (exclusive of the other steps' GPUs and CPUs)."""
    return ["srun", f"--het-group={group}", f"--nodes={nodes}", f"--ntasks-per-node={ntasks_per_node}", "--exact",
            "--kill-on-bad-exit=1", f"--job-name={name}", *([f"--nodelist={nodelist}"] if nodelist else []),
            *([f"--gpus-per-task={gpus_per_task}"] if gpus_per_task else []),
            *([f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else [])]


def step_terminator(alloc: Allocation, step_name: str) -> Callable[[], bool]:
    """A Role.terminate that sends SIGTERM to the tasks of this job's step named `step_name` (`scancel --signal`),
    so they stop cleanly (a SIGTERM to srun would kill them at once); False when no such step is running."""

    def terminate() -> bool:
        try:
            listed = subprocess.run(["squeue", "-h", "-s", "-o", "%i|%j", "-j", ",".join(alloc.component_ids)],
                                    capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S).stdout
            steps = [line.split("|")[0] for line in listed.splitlines() if line.split("|")[-1] == step_name]
            for step in steps:
                subprocess.run(["scancel", "--signal=TERM", step], capture_output=True, timeout=SCONTROL_TIMEOUT_S)
            return bool(steps)
        except (OSError, subprocess.TimeoutExpired):
            return False

    return terminate


def _share(total: int | None, parts: int) -> int | None:
    return None if total is None else max(1, total // parts)


def job_roles(run_dir: Path, recipe: Recipe, alloc: Allocation, *, resume: bool, cuda: bool
              ) -> tuple[list[Role], list[str], Role, Role]:
    """The run's roles on the allocation: (generators, their URLs, trainer, orchestrator)."""
    from megatron_scalerl.run_dir import clear_stop_request, request_stop, write_generators

    say_launch_notes(recipe, cuda=cuda, resume=resume)
    logs, tp = run_dir / "logs", recipe.parallelism.generator_tp
    per_node = recipe.cluster.gpus_per_node // tp
    servers = recipe.cluster.generator_gpus // tp
    dtype = serving_dtype(recipe, cuda)
    env = {} if cuda else {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    generators, urls = [], []
    for i, port in enumerate(alloc.generator_ports(servers)):
        node = alloc.generator.nodes[i // per_node]
        urls.append(f"http://{node.addr}:{port}")
        step = srun(GENERATOR_GROUP, nodes=1, nodelist=node.name, name=f"generator_{i}",
                    gpus_per_task=tp if alloc.generator.gpus_per_node else None,
                    cpus_per_task=_share(alloc.generator.cpus_per_node, per_node))
        generators.append(Role(f"generator {i} ({node.name})", step + generator_command(
            run_dir, recipe, port=port, host="0.0.0.0", dtype=dtype, log=logs / f"vllm_{i}.log"),
            logs / f"generator_{i}.log", env, terminate=step_terminator(alloc, f"generator_{i}")))
    write_generators(run_dir, urls, dtype)
    step = srun(TRAINER_GROUP, nodes=recipe.cluster.trainer_nodes, name="trainer",
                gpus_per_task=recipe.cluster.gpus_per_node if alloc.trainer.gpus_per_node else None,
                cpus_per_task=alloc.trainer.cpus_per_node)
    per_node_rank = ["bash", "-c", 'PET_NODE_RANK=$SLURM_NODEID exec "$@"', "trainer"]
    clear_stop_request(run_dir)
    trainer = Role("trainer", step + ["--label"] + per_node_rank + trainer_command(
        run_dir, recipe, rendezvous=alloc.rendezvous()), logs / "trainer.log", terminate=partial(request_stop, run_dir))
    orchestrator = Role("orchestrator", orchestrator_command(run_dir, resume=resume), logs / "orchestrator.log",
                        echo=True)
    return generators, urls, trainer, orchestrator


def run_recipe(run_dir: Path, env: dict[str, str]) -> tuple[Recipe, bool]:
    """(recipe, exists): the run's own recipe.yaml when the directory has one (a requeued or follow-up job), else
    the new run's from SCALERL_RECIPE / SCALERL_MODEL / SCALERL_SET."""
    if (run_dir / "recipe.yaml").is_file():
        return load_recipe(run_dir / "recipe.yaml"), True
    if not env.get("SCALERL_RECIPE"):
        raise UserError(f"{run_dir} holds no run yet and SCALERL_RECIPE is not set: submit with "
                        "--export=ALL,SCALERL_RECIPE=<preset or YAML>")
    return load_recipe(env["SCALERL_RECIPE"], shlex.split(env.get("SCALERL_SET", "")),
                       env.get("SCALERL_MODEL") or None), False


def _run_dir(env: dict[str, str]) -> Path:
    if not env.get("SCALERL_RUN_DIR"):
        raise UserError("SCALERL_RUN_DIR is not set: the sbatch files set it (submit with "
                        "--export=ALL,SCALERL_RUN_DIR=DIR to choose)")
    return Path(env["SCALERL_RUN_DIR"]).resolve()


def requeue(job_id: int) -> None:
    print(f"job {job_id}: requeueing; the next start continues the run", flush=True)
    _scontrol("requeue", str(job_id))


def run_job(env: dict[str, str]) -> int:
    """The batch step of a run: preflight, the roles until the run ends, a requeue on the time-limit warning."""
    import torch

    from megatron_scalerl.launch.gpu_hours import record_job
    from megatron_scalerl.launch.preflight import run_preflight

    run_dir = _run_dir(env)
    alloc = Allocation.from_env(env)
    recipe, resume = run_recipe(run_dir, env)
    alloc.check(recipe)
    cuda = torch.cuda.is_available()
    if resume:
        print(f"continuing the run in {run_dir} with its own recipe.yaml", flush=True)
    else:
        tokenizer = env.get("SCALERL_TOKENIZER")
        recipe = prepare_run_dir(run_dir, recipe, tokenizer_source(recipe, Path(tokenizer) if tokenizer else None),
                                 cuda=cuda)
    record_job(run_dir, alloc.job_id)
    if env.get("SCALERL_PREFLIGHT", "1") != "0":
        run_preflight(run_dir, recipe, alloc, env, cuda=cuda)
    generators, urls, trainer, orchestrator = job_roles(run_dir, recipe, alloc, resume=resume, cuda=cuda)
    code = run_roles(f"job {alloc.job_id} ({run_dir})", generators, urls, trainer, orchestrator,
                     stop_signals=(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1))
    if code == 128 + signal.SIGUSR1:
        requeue(alloc.job_id)
        return 0
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_scalerl.launch.slurm")
    parser.add_argument("what", choices=["job", "preflight"])
    args = parser.parse_args(argv)
    env = dict(os.environ)
    try:
        if args.what == "job":
            return run_job(env)
        import torch

        from megatron_scalerl.launch.preflight import run_preflight

        run_dir = _run_dir(env)
        alloc = Allocation.from_env(env)
        recipe, _ = run_recipe(run_dir, env)
        alloc.check(recipe)
        run_preflight(run_dir, recipe, alloc, env, cuda=torch.cuda.is_available())
        print("preflight passed", flush=True)
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
