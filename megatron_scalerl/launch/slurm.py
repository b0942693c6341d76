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
and requeues the job (`scontrol requeue`); the requeued job continues the run from its checkpoints, once the stream
is rewound to the checkpoint the trainer resumes from (`rollout.orchestrator_state.rewind_to_checkpoint`). SIGTERM
(scancel) stops them the same way without a requeue. A generator that keeps failing (its node is gone; the sbatch
files ask for `--no-kill`) is given up and the run goes on with the others.

The recipe's `cluster.partition`, `cluster.account` and `cluster.time_limit` are the job's sbatch options
(`cluster_options`, which `scalerl sweep --slurm` passes) wherever the submission does not choose them itself: an
SBATCH_* variable or an `#SBATCH` line of the sbatch file wins (a command-line option too, being sbatch's own). The
sbatch files hold none of the three, so a plain `sbatch` gets the cluster's defaults for what it does not give; the
job's first lines then say where its partition, account or time limit differ from the recipe's (`cluster_notes`).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import sys
from collections.abc import Mapping
from functools import partial
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.gpu_hours import record_job
from megatron_scalerl.launch.allocation import (
    GENERATOR_GROUP,
    TRAINER_GROUP,
    Allocation,
    allocation_lost,
    scontrol,
    srun,
    step_terminator,
)
from megatron_scalerl.launch.preflight import run_preflight
from megatron_scalerl.launch.roles import (
    generator_command,
    orchestrator_command,
    prepare_run_dir,
    restart_budget,
    say_launch_notes,
    serving_dtype,
    tokenizer_source,
    trainer_command,
)
from megatron_scalerl.launch.supervise import ALLOCATION_LOST, Role, run_roles
from megatron_scalerl.recipe import ClusterConfig, Recipe, load_recipe, slurm_minutes
from megatron_scalerl.rollout.orchestrator_state import rewind_to_checkpoint
from megatron_scalerl.run_dir import RECIPE_FILE, clear_stop_request, request_stop, write_generators

# The recipe's fields that are sbatch options: (the option's long and short spelling, its SBATCH_* input variable,
# the field of `scontrol show job`)
CLUSTER_OPTIONS = {"partition": ("--partition", "-p", "SBATCH_PARTITION", "Partition"),
                   "account": ("--account", "-A", "SBATCH_ACCOUNT", "Account"),
                   "time_limit": ("--time", "-t", "SBATCH_TIMELIMIT", "TimeLimit")}
UNLIMITED = ("UNLIMITED", "INFINITE", "0")  # SLURM's ways of saying "no time limit"


def sbatch_lines(script: Path) -> list[str]:
    """The options of `script`'s `#SBATCH` lines (sbatch reads them up to the first command), one token each."""
    tokens = []
    for line in script.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            tokens += shlex.split(line.removeprefix("#SBATCH"))
        elif line.strip() and not line.startswith("#"):
            break
    return tokens


def _chooses(tokens: list[str], long: str, short: str) -> bool:
    return any(t == long or t.startswith(long + "=") or t.startswith(short) for t in tokens)


def cluster_options(cluster: ClusterConfig, script: Path, env: Mapping[str, str]) -> list[str]:
    """sbatch options for the recipe's partition, account (when it names them) and time limit, each unless an
    SBATCH_* variable in `env` or an `#SBATCH` line of `script` chooses it already."""
    chosen = sbatch_lines(script)
    options = []
    for field, (long, short, variable, _) in CLUSTER_OPTIONS.items():
        value = getattr(cluster, field)
        if value is not None and not env.get(variable) and not _chooses(chosen, long, short):
            options.append(f"{long}={value}")
    return options


def cluster_notes(cluster: ClusterConfig, job: str) -> list[str]:
    """Where the job (`job`: `scontrol show job -o` of it, one line per het component) runs with another partition,
    account or time limit than the recipe's cluster section names: one line each."""
    notes = []
    for field, (long, _, variable, key) in CLUSTER_OPTIONS.items():
        wanted = getattr(cluster, field)
        got = sorted(set(re.findall(rf"(?:^|\s){key}=(\S+)", job)))
        if wanted is None or not got:
            continue
        if field == "time_limit":
            minutes = slurm_minutes(wanted) or None
            differ = [v for v in got if (None if v in UNLIMITED else slurm_minutes(v)) != minutes]
        else:
            differ = [v for v in got if v != wanted]
        if differ:
            notes.append(f"note: this job has {key}={','.join(differ)}, not the recipe's cluster.{field} {wanted}: "
                         f"the submission's own (sbatch {long}, {variable} or an #SBATCH line) or the cluster's "
                         "default applies (`scalerl sweep --slurm` submits with the recipe's)")
    return notes


def _share(total: int | None, parts: int) -> int | None:
    return None if total is None else max(1, total // parts)


def job_roles(run_dir: Path, recipe: Recipe, alloc: Allocation, *, resume: bool, cuda: bool
              ) -> tuple[list[Role], list[str], Role, Role]:
    """The run's roles on the allocation: (generators, their URLs, trainer, orchestrator)."""
    say_launch_notes(recipe, cuda=cuda, resume=resume)
    logs, tp = run_dir / "logs", recipe.parallelism.generator_tp
    per_node = recipe.cluster.gpus_per_node // tp
    servers = recipe.generator_servers
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
    if (run_dir / RECIPE_FILE).is_file():
        return load_recipe(run_dir / RECIPE_FILE), True
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
    scontrol("requeue", str(job_id))


def run_job(env: dict[str, str]) -> int:
    """The batch step of a run: preflight, the roles until the run ends, a requeue on the time-limit warning."""
    import torch  # deferred: heavy (sweep/slurm.py imports this module for `cluster_options`)

    run_dir = _run_dir(env)
    alloc = Allocation.from_env(env)
    recipe, resume = run_recipe(run_dir, env)
    alloc.check(recipe)
    for note in cluster_notes(recipe.cluster, scontrol("show", "job", "-o", str(alloc.job_id))):
        print(note, flush=True)
    cuda = torch.cuda.is_available()
    if resume:
        print(f"continuing the run in {run_dir} with its own recipe.yaml", flush=True)
        # before any role: the trainer reads the stream, and the roles append to metrics.jsonl
        rewind_to_checkpoint(run_dir, partial(print, flush=True), metrics=True)
    else:
        tokenizer = env.get("SCALERL_TOKENIZER")
        recipe = prepare_run_dir(run_dir, recipe, tokenizer_source(recipe, Path(tokenizer) if tokenizer else None),
                                 cuda=cuda)
    record_job(run_dir, alloc.job_id)
    if env.get("SCALERL_PREFLIGHT", "1") != "0":
        run_preflight(run_dir, recipe, alloc, env, cuda=cuda)
    generators, urls, trainer, orchestrator = job_roles(run_dir, recipe, alloc, resume=resume, cuda=cuda)
    code = run_roles(f"job {alloc.job_id} ({run_dir})", generators, urls, trainer, orchestrator,
                     restarts=restart_budget(run_dir, recipe, partial(allocation_lost, alloc)),
                     stop_signals=(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1))
    if code in (128 + signal.SIGUSR1, ALLOCATION_LOST):  # time is up, or a node is lost: go on in a new allocation
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
        import torch  # deferred: as in run_job

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
