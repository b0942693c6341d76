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
import shlex
import signal
import sys
from functools import partial
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.launch.allocation import (
    GENERATOR_GROUP,
    TRAINER_GROUP,
    Allocation,
    scontrol,
    srun,
    step_terminator,
)
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
    scontrol("requeue", str(job_id))


def run_job(env: dict[str, str]) -> int:
    """The batch step of a run: preflight, the roles until the run ends, a requeue on the time-limit warning."""
    import torch

    from megatron_scalerl.gpu_hours import record_job
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
