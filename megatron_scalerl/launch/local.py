"""One whole run on this machine, its roles as plain processes (no Ray, no SLURM): what `scalerl train` runs
(its command line: `commands/train.py`).

Starts the generators (`scalerl serve`, one per `parallelism.generator_tp` generator GPUs), writes
`RUN/generators.json`, then the trainer (torchrun) and the orchestrator, each with its log under `RUN/logs/`; the
orchestrator's progress lines are echoed here. While the run goes on, a generator that dies is started again (the
trainer re-syncs it and the orchestrator's fleet takes it back). The run ends when the trainer and the orchestrator
have both finished; a role that fails ends it with exit 1 and its log's tail.

Ctrl-C or SIGTERM: the orchestrator stops first (its state is that of its last batch), then the trainer, which
checkpoints its current step, then the generators (launch/supervise.py); exit 130 or 143. `--resume` continues from
the checkpoints, the rollout stream and the orchestrator's state.

The generators listen on 127.0.0.1 only, behind the run's API key (`$SCALERL_API_KEY`, else `RUN/api_key`:
`run_dir.run_api_key`), which every role gets in its environment, never on its command line; plain HTTP unless
`cluster.generator_tls` is `on` (HTTPS with the run's certificate, `run.tls.run_tls`, as under SLURM).
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.launch.roles import (
    generator_command,
    generator_tls,
    generator_url,
    orchestrator_command,
    prepare_run_dir,
    restart_budget,
    run_watch,
    say_launch_notes,
    trainer_command,
)
from megatron_scalerl.launch.supervise import Role, run_roles
from megatron_scalerl.orchestrator.state import rewind_to_checkpoint
from megatron_scalerl.platform.local_workers import free_port
from megatron_scalerl.platform.precision import serving_dtype
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.run.directory import clear_stop_request, request_stop, run_api_key, write_generators
from megatron_scalerl.run.tls import RunTLS, run_tls
from megatron_scalerl.weight_sync.launch_checks import check_weight_sync, generator_free_bytes

# On CPU every role shares the machine's cores. The trainer's ranks run in lock-step (one that loses its core stalls
# the others at the next collective) and the trainer is the slower side there, so the generators yield to it
# (bench/pipeline.py, demo workload: PipelineRL-8 trained 90 -> 103 samples/s, 1.42x -> 1.65x the synchronous run's).
CPU_GENERATOR_PRIORITY = ["nice", "-n", "10"]


def start_run(run_dir: Path, recipe: Recipe, tokenizer_dir: Path) -> int:
    """A new run of `recipe` in `run_dir` (absent, or with no file in it: empty folders, such as a file system
    mounted at RUN/checkpoints beforehand, are fine) with the tokenizer in `tokenizer_dir`: prepare the run
    directory, then `run_local`; the exit code. A recipe this machine cannot run (`check_weight_sync_here`) is
    refused before anything is written."""
    import torch

    if run_dir.exists() and any(path.is_file() for path in run_dir.rglob("*")):
        raise UserError(f"{run_dir} is not empty: continue it with --resume, or choose another --run-dir")
    check_weight_sync_here(recipe, cuda=torch.cuda.is_available())
    recipe = prepare_run_dir(run_dir, recipe, tokenizer_dir, cuda=torch.cuda.is_available())
    return run_local(run_dir, recipe, resume=False)


def check_weight_sync_here(recipe: Recipe, *, cuda: bool) -> None:
    """The `weight_sync` section's refusals (`check_weight_sync`) for a run whose generators all run on this
    machine (`cuda`: on its GPUs), their free memory measured here (`generator_free_bytes`)."""
    free = generator_free_bytes(recipe, cuda=cuda, generators_here=recipe.generator_servers)
    check_weight_sync(recipe, cuda=cuda, free_bytes_per_worker=free)


def cpu_threads_per_process(processes: int) -> int:
    """On CPU: the threads each of the run's `processes` (trainer ranks and generators) gets when the user set no
    OMP_NUM_THREADS, the machine's cores shared evenly (2 cores, 2 ranks, 1 generator: 1 each). Left to themselves,
    torch and vLLM would each start a thread per core, and their spinning threads take the cores from one another:
    the demo's generator made 75-80 samples/s so, 121-126 at one thread."""
    return max(1, len(os.sched_getaffinity(0)) // processes)


def cuda_devices(indices: range) -> str:
    """CUDA_VISIBLE_DEVICES for a role on the run's GPUs at `indices` (0-based among the GPUs this process may use:
    an inherited CUDA_VISIBLE_DEVICES, e.g. SLURM's or the user's, is honoured, never widened)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    if ids is not None and indices[-1] >= len(ids):
        raise UserError(f"the recipe needs {indices[-1] + 1} GPUs (cluster section) but CUDA_VISIBLE_DEVICES="
                        f"{visible} gives this launch {len(ids)}")
    return ",".join(ids[i] if ids is not None else str(i) for i in indices)


def local_roles(run_dir: Path, recipe: Recipe, *, resume: bool, cuda: bool, tls: RunTLS | None = None
                ) -> tuple[list[Role], list[str], Role, Role]:
    """The run's roles on this machine: (generators, their URLs, trainer, orchestrator), the generators serving
    HTTPS with `tls`; writes generators.json."""
    say_launch_notes(recipe, cuda=cuda, resume=resume)
    logs = run_dir / "logs"
    servers = recipe.generator_servers
    threads = {} if cuda or "OMP_NUM_THREADS" in os.environ else {
        "OMP_NUM_THREADS": str(cpu_threads_per_process(recipe.cluster.trainer_gpus + servers))}
    urls, generators = [], []
    dtype = serving_dtype(recipe, cuda)
    for i in range(servers):
        port = free_port()
        urls.append(generator_url("127.0.0.1", port, tls))
        first = recipe.cluster.trainer_gpus + i * recipe.parallelism.generator_tp
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", **threads} if not cuda else {
            "CUDA_VISIBLE_DEVICES": cuda_devices(range(first, first + recipe.parallelism.generator_tp))}
        command = generator_command(run_dir, recipe, port=port, host="127.0.0.1", dtype=dtype,
                                    log=logs / f"vllm_{i}.log", tls=tls)
        generators.append(Role(f"generator {i}", command if cuda else [*CPU_GENERATOR_PRIORITY, *command],
                               logs / f"generator_{i}.log", env))
    write_generators(run_dir, urls, dtype)
    trainer_env = {"CUDA_VISIBLE_DEVICES": cuda_devices(range(recipe.cluster.trainer_gpus))} if cuda else threads
    clear_stop_request(run_dir)
    trainer = Role("trainer", trainer_command(run_dir, recipe), logs / "trainer.log", trainer_env,
                   terminate=partial(request_stop, run_dir))
    orchestrator = Role("orchestrator", orchestrator_command(run_dir, resume=resume), logs / "orchestrator.log",
                        echo=True)
    return generators, urls, trainer, orchestrator


def run_local(run_dir: Path, recipe: Recipe, *, resume: bool, ready_timeout_s: float = 900.0) -> int:
    """Run every role of `recipe` on this machine until the run ends (see the module docstring); the exit code."""
    import torch

    check_weight_sync_here(recipe, cuda=torch.cuda.is_available())
    if resume:  # before any role starts: the trainer must not read a batch of a timeline it left
        rewind_to_checkpoint(run_dir, partial(print, flush=True), metrics=True)
    api_key, key_source = run_api_key(run_dir)
    print(f"the generators' API key: {key_source}", flush=True)
    tls = run_tls(run_dir, ["127.0.0.1"]) if generator_tls(recipe, slurm=False) else None
    print(f"the generators' TLS: {f'HTTPS, certificate {tls.cert}' if tls else 'off (HTTP on 127.0.0.1)'}", flush=True)
    generators, urls, trainer, orchestrator = local_roles(run_dir, recipe, resume=resume,
                                                          cuda=torch.cuda.is_available(), tls=tls)
    return run_roles(f"run {run_dir}", generators, urls, trainer, orchestrator, api_key=api_key,
                     tls_ca=tls.cert if tls else None, restarts=restart_budget(run_dir, recipe),
                     ready_timeout_s=ready_timeout_s, watch=run_watch(run_dir, recipe))
