"""A SLURM allocation as the launch sees it: the het-job's two groups (trainer nodes, generator nodes), their
addresses and the ports a job uses, and `srun` prefixes for the steps on them (`launch/slurm.py` starts the run's
roles with them, `launch/preflight.py` its checks)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_scalerl.errors import UserError
from megatron_scalerl.ports import EPHEMERAL_PORTS_START, JOB_PORTS_START

if TYPE_CHECKING:
    from megatron_scalerl.recipe import Recipe

SCONTROL_TIMEOUT_S = 60.0
JOB_PORT_SLOTS = (EPHEMERAL_PORTS_START - JOB_PORTS_START) // 100  # 127 jobs whose ports differ (Allocation.base_port)
TRAINER_GROUP, GENERATOR_GROUP = 0, 1


def slurm_client(*command: str, timeout_s: float, cwd: str | Path | None = None) -> str:
    """The output of a SLURM client command (`scontrol`, `squeue`, `sbatch`), run in a session of its own (a Ctrl-C
    meant for us does not reach it) and bounded by `timeout_s` seconds; a UserError naming the command otherwise."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=cwd,
                              start_new_session=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"{' '.join(command[:2])}: {exc}") from None
    if done.returncode != 0:
        raise UserError(f"{' '.join(command[:2])}{' ...' if len(command) > 2 else ''} failed (exit "
                        f"{done.returncode}): {done.stderr.strip()}")
    return done.stdout


def scontrol(*args: str) -> str:
    return slurm_client("scontrol", *args, timeout_s=SCONTROL_TIMEOUT_S)


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
        names = [scontrol("show", "hostnames", env[f"SLURM_JOB_NODELIST_HET_GROUP_{g}"]).split() for g in (0, 1)]
        addrs = {fields["NodeName"]: fields.get("NodeAddr") or fields["NodeName"]
                 for fields in _node_fields(_show_nodes([n for group in names for n in group]))}
        groups = [Group([Node(n, addrs.get(n, n)) for n in names[g]],
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
    def node_names(self) -> list[str]:
        """Every node of the job: the trainer group's, then the generator group's."""
        return [n.name for group in (self.trainer, self.generator) for n in group.nodes]

    @property
    def base_port(self) -> int:
        """The first of the job's 100 ports: 20000 + 100 x (job id mod JOB_PORT_SLOTS), so every port of every job lies
        in 20000-32699, below Linux's ephemeral range (32768-60999 by default), where any outgoing connection or
        bind(0) listener of the node (gloo's, vLLM's) may hold it."""
        return JOB_PORTS_START + 100 * (self.job_id % JOB_PORT_SLOTS)

    def rendezvous(self) -> str:
        return f"{self.trainer.nodes[0].addr}:{self.base_port}"

    def generator_ports(self, servers: int) -> list[int]:
        """Each server's HTTP port: base + 2, + 3, ... (base, base + 1: the trainer's rendezvous)."""
        if servers > 98:
            raise UserError(f"{servers} generator servers: at most 98 per job (raise parallelism.generator_tp)")
        return [self.base_port + 2 + i for i in range(servers)]

    def generator_master_ports(self, servers: int) -> list[int]:
        """Each server's port where the nodes of a server spanning nodes meet (on its first node): base + 99, + 98,
        ... down, apart from the HTTP ports (spanning servers are at most half as many as the generator nodes)."""
        if 2 + 2 * servers > 100:
            raise UserError(f"{servers} generator servers spanning nodes: at most 49 per job (raise "
                            "parallelism.generator_tp)")
        return [self.base_port + 99 - i for i in range(servers)]


LOST_NODE_STATES = ("DOWN", "FAIL", "NOT_RESPONDING", "POWERED_DOWN", "POWER_DOWN", "REBOOT")  # in SLURM's State=
GONE_NODE_STATES = ("DOWN", "POWERED_DOWN")  # SLURM has taken the node out of its jobs


def _show_nodes(names: list[str]) -> str:
    return scontrol("-o", "show", "node", ",".join(names))


def _node_fields(show_node: str) -> list[dict[str, str]]:
    """The KEY=VALUE fields of each node of `scontrol -o show node` output (one line per node); `Reason` the rest of
    the line after it (a reason may hold spaces)."""
    nodes = []
    for line in show_node.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "Reason" in fields:
            fields["Reason"] = line.split("Reason=", 1)[1].strip()
        if "NodeName" in fields:
            nodes.append(fields)
    return nodes


def _lost(show_node: str) -> list[tuple[str, str, set[str]]]:
    """(name, "STATE: REASON", state flags) of each node of `scontrol -o show node` output that SLURM reports lost (a
    state flag of LOST_NODE_STATES, e.g. DOWN+NOT_RESPONDING)."""
    lost = []
    for fields in _node_fields(show_node):
        state = fields.get("State", "")
        parts = state.split("+")  # "DOWN+NOT_RESPONDING"; sinfo-style suffixes too: "IDLE*" = not responding
        flags = {part.rstrip("*~#%$@^-!") for part in parts} | {"NOT_RESPONDING" for p in parts if p.endswith("*")}
        if flags & set(LOST_NODE_STATES):
            lost.append((fields["NodeName"], f"{state}: {fields.get('Reason') or 'no reason given'}", flags))
    return lost


def lost_nodes(show_node: str) -> list[str]:
    """"NAME (STATE: REASON)" for each node of `scontrol -o show node` output that SLURM reports lost."""
    return [f"{name} ({state_reason})" for name, state_reason, _ in _lost(show_node)]


def nodes_not_yet_gone(show_node: str) -> list[str]:
    """The nodes of `scontrol -o show node` output that do not answer and that SLURM has not declared DOWN yet (its
    SlurmdTimeout has not run out)."""
    return [name for name, _, flags in _lost(show_node)
            if "NOT_RESPONDING" in flags and not flags & set(GONE_NODE_STATES)]


def allocation_lost(alloc: Allocation) -> str | None:
    """Why the job's own nodes can no longer run its roles (a node SLURM reports lost), or None; None as well when
    scontrol does not answer (the restart inside the allocation is tried then)."""
    try:
        lost = lost_nodes(_show_nodes(alloc.node_names))
    except UserError:
        return None
    return f"lost node(s): {', '.join(lost)}" if lost else None


def lost_nodes_settled(alloc: Allocation) -> bool:
    """Whether no node of the job is left that does not answer and is not DOWN yet (`nodes_not_yet_gone`); False as
    well when scontrol does not answer."""
    try:
        return not nodes_not_yet_gone(_show_nodes(alloc.node_names))
    except UserError:
        return False


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
