"""The SLURM job: what `slurm/scalerl_moe.sbatch` and `slurm/scalerl_dense.sbatch` run in their batch step, on the
first trainer node of a het-job (group 0: trainer nodes, group 1: generator nodes).

    python -m megatron_scalerl.launch.slurm job          # preflight (unless SCALERL_PREFLIGHT=0), then the run
    python -m megatron_scalerl.launch.slurm preflight    # the checks alone (slurm/preflight.sbatch)

The roles are the local launcher's (`launch/roles.py` command lines, `launch/supervise.py` watching them), each
started through `srun` on its nodes:

    generator i   srun --het-group=1 -w NODE --ntasks=1 ... scalerl serve --host NODE_IP --port BASE+2+i ...
    trainer       srun --het-group=0 --ntasks-per-node=1 ... torchrun --nnodes=N --master-addr=TRAINER0 ...
    orchestrator  a plain child of this process (the batch step runs on the first trainer node)

Addresses come from the allocation (`scontrol show node`'s NodeAddr), ports from the job id (BASE = 20000 + 100 x
(job id mod 127), below the ephemeral ports), so two jobs on shared nodes do not meet. A generator listens on its
node's address as this node resolves it (`generator_address`; the trainer and the orchestrator, both on this node,
reach it there), not on every interface, and asks for the run's API key on every route but /health
(`run_dir.run_api_key`: `$SCALERL_API_KEY`, else `RUN/api_key`), which every role gets in its environment through
srun, never on a command line. With `cluster.generator_tls` on (`auto`'s choice here) it serves HTTPS with the run's
certificate (`run.tls.run_tls`: `RUN/tls/`, naming every generator node's address and name, `generator_hosts`),
which every client verifies (`$SCALERL_TLS_CA`, in every role's environment).

Settings (the sbatch file's defaults, or `sbatch --export=ALL,NAME=VALUE`):

    SCALERL_RUN_DIR     the run directory (required); one that holds recipe.yaml is continued, never restarted
    SCALERL_RECIPE      preset or recipe YAML of a new run;  SCALERL_MODEL: model preset or hf:DIR
    SCALERL_SET         space-separated KEY=VALUE overrides of a new run;  SCALERL_TOKENIZER: tokenizer directory
    SCALERL_PREFLIGHT   1 (default) or 0;  SCALERL_MIN_BUSBW_GBPS: preflight's all-reduce floor (see preflight.py)

SLURM's time-limit warning (`#SBATCH --signal=B:USR1@SECONDS`) stops the roles in order (the trainer checkpoints)
and requeues the job (`scontrol requeue`); the requeued job continues the run from its checkpoints, once the stream
is rewound to the checkpoint the trainer resumes from (`orchestrator.state.rewind_to_checkpoint`); a warning that
comes after the run has ended (the trainer finishing) stops the roles and requeues nothing. SIGTERM (scancel) stops
them the same way without a requeue. A role that fails on an allocation that lost a node (one SLURM
reports not answering) ends the roles; the job waits for SLURM to declare the node DOWN and is requeued then
(`requeue_after_node_loss`). A generator that keeps failing on a node that answers is given up and the run goes on
with the others.

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
import socket
import sys
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.launch.allocation import (
    GENERATOR_GROUP,
    TRAINER_GROUP,
    Allocation,
    Node,
    allocation_lost,
    lost_nodes_settled,
    scontrol,
    srun,
    step_terminator,
)
from megatron_scalerl.launch.preflight import run_preflight
from megatron_scalerl.launch.roles import (
    generator_command,
    generator_tls,
    generator_url,
    orchestrator_command,
    prepare_run_dir,
    restart_budget,
    run_watch,
    say_launch_notes,
    tokenizer_source,
    trainer_command,
)
from megatron_scalerl.launch.supervise import ALLOCATION_LOST, Role, run_roles
from megatron_scalerl.orchestrator.state import rewind_to_checkpoint
from megatron_scalerl.platform.precision import serving_dtype
from megatron_scalerl.process_exit import exit_with
from megatron_scalerl.recipe import ClusterConfig, Recipe, load_recipe, load_run_recipe, slurm_minutes
from megatron_scalerl.run.directory import (
    FINISHED_FILE,
    RECIPE_FILE,
    clear_stop_request,
    read_finished,
    request_stop,
    run_api_key,
    write_generators,
)
from megatron_scalerl.run.gpu_hours import record_job
from megatron_scalerl.run.tls import RunTLS, run_tls

# The recipe's fields that are sbatch options: (the option's long and short spelling, its SBATCH_* input variable,
# the field of `scontrol show job`)
CLUSTER_OPTIONS = {"partition": ("--partition", "-p", "SBATCH_PARTITION", "Partition"),
                   "account": ("--account", "-A", "SBATCH_ACCOUNT", "Account"),
                   "time_limit": ("--time", "-t", "SBATCH_TIMELIMIT", "TimeLimit")}
UNLIMITED = ("UNLIMITED", "INFINITE", "0")  # SLURM's ways of saying "no time limit"
NODE_LOSS_POLL_S = 5.0  # how often a job that lost a node asks SLURM for the node's state
NODE_LOSS_MARGIN_S = 60.0  # how long past SlurmdTimeout it waits for SLURM's requeue before it requeues itself


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


def cluster_options(cluster: ClusterConfig, script: Path | list[str], env: Mapping[str, str]) -> list[str]:
    """sbatch options for the recipe's partition, account (when it names them) and time limit, each unless an
    SBATCH_* variable in `env` or an `#SBATCH` line of `script` chooses it already. `script`: the sbatch file, or
    its options as `sbatch_lines` read them (a sweep reads each file once, not once per run)."""
    chosen = sbatch_lines(script) if isinstance(script, Path) else script
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


def generator_address(node_addr: str, node_name: str) -> str:
    """The IPv4 address generator node `node_name` (NodeAddr `node_addr`) serves on: `node_addr` as this node (where
    the trainer's rank 0 and the orchestrator run) resolves it, so the server binds the one interface its clients
    reach it on. A generator whose node does not hold that address fails to bind and says so in its log."""
    try:
        return socket.gethostbyname(node_addr)
    except OSError as exc:
        raise UserError(f"generator node {node_name}: its address {node_addr!r} (scontrol's NodeAddr) does not "
                        f"resolve here: {exc}") from None


def generator_hosts(alloc: Allocation) -> list[str]:
    """Every name a client may reach a generator node by, for the run's certificate: each generator node's address
    as this node resolves it (what the URLs hold: `generator_address`), its NodeAddr and its name."""
    hosts = []
    for node in alloc.generator.nodes:
        hosts += [generator_address(node.addr, node.name), node.addr, node.name]
    return list(dict.fromkeys(hosts))


def _share(total: int | None, parts: int) -> int | None:
    return None if total is None else max(1, total // parts)


def per_node_settings(nodes: list[Node]) -> list[str]:
    """A command prefix that runs the command, on each of `nodes` (a server spanning them, first to last), with
    $SCALERL_NODE_RANK set to that node's place in the list (`scalerl serve --node-rank`'s default) and $VLLM_HOST_IP
    to its address (where vLLM's workers there are reached), found by the node's name ($SLURMD_NODENAME): SLURM's own
    task order over a step's nodes is its node table's, not necessarily this list's."""
    cases = " ".join(f"{shlex.quote(n.name)}) export SCALERL_NODE_RANK={r} "
                     f"VLLM_HOST_IP={shlex.quote(generator_address(n.addr, n.name))};;" for r, n in enumerate(nodes))
    script = (f'case "$SLURMD_NODENAME" in {cases} *) echo "node $SLURMD_NODENAME is not a node of this server" >&2; '
              'exit 1;; esac; exec "$@"')
    return ["bash", "-c", script, "generator"]


def job_roles(run_dir: Path, recipe: Recipe, alloc: Allocation, *, resume: bool, cuda: bool,
              tls: RunTLS | None = None) -> tuple[list[Role], list[str], Role, Role]:
    """The run's roles on the allocation: (generators, their URLs, trainer, orchestrator). Servers share a node
    (`gpus_per_node / generator_tp` each) or span `Recipe.generator_server_nodes` whole nodes, one srun step over
    them that runs `scalerl serve` on each (`per_node_settings`); they serve HTTPS with `tls`."""
    say_launch_notes(recipe, cuda=cuda, resume=resume)
    logs, tp = run_dir / "logs", recipe.parallelism.generator_tp
    span = recipe.generator_server_nodes
    per_node = max(1, recipe.cluster.gpus_per_node // tp)
    servers = recipe.generator_servers
    dtype = serving_dtype(recipe, cuda)
    env = {} if cuda else {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    master_ports = alloc.generator_master_ports(servers) if span > 1 else [None] * servers
    generators, urls = [], []
    for i, (port, master_port) in enumerate(zip(alloc.generator_ports(servers), master_ports, strict=True)):
        nodes = alloc.generator.nodes[i * span:(i + 1) * span] if span > 1 else [alloc.generator.nodes[i // per_node]]
        host = generator_address(nodes[0].addr, nodes[0].name)
        urls.append(generator_url(host, port, tls))
        step = srun(GENERATOR_GROUP, nodes=span, nodelist=",".join(n.name for n in nodes), name=f"generator_{i}",
                    gpus_per_task=min(tp, recipe.cluster.gpus_per_node) if alloc.generator.gpus_per_node else None,
                    cpus_per_task=_share(alloc.generator.cpus_per_node, per_node))
        command = generator_command(run_dir, recipe, port=port, host=host, dtype=dtype, log=logs / f"vllm_{i}.log",
                                    master_port=master_port, tls=tls)
        generators.append(Role(f"generator {i} ({','.join(n.name for n in nodes)})",
                               step + (["--label", *per_node_settings(nodes)] if span > 1 else []) + command,
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


def job_recipe(run_dir: Path, env: dict[str, str]) -> tuple[Recipe, bool]:
    """(recipe, exists): what the job runs: the run's own recipe.yaml when the directory has one (a requeued or
    follow-up job), else the new run's from SCALERL_RECIPE / SCALERL_MODEL / SCALERL_SET."""
    existing = load_run_recipe(run_dir, RECIPE_FILE, missing_ok=True)
    if existing is not None:
        return existing, True
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


def slurmd_timeout_s() -> int:
    """SLURM's SlurmdTimeout (seconds a node may not answer before slurmctld declares it DOWN; 0: never), from
    `scontrol show config`; 300, SLURM's default, when it cannot be read."""
    try:
        match = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", scontrol("show", "config"), re.MULTILINE)
    except UserError:
        match = None
    return int(match.group(1)) if match else 300


def requeue_after_node_loss(alloc: Allocation) -> int:
    """After a lost node ended the roles: hold the allocation until SLURM declares the node DOWN (SlurmdTimeout after
    it stopped answering) and requeues the whole job itself (its node-failure requeue of a `--requeue` job, which
    ends this process with SIGTERM). The job requeues itself instead where the node answers again, at the time-limit
    warning (USR1), when SLURM has not acted within SlurmdTimeout + NODE_LOSS_MARGIN_S, or at once with SlurmdTimeout
    0. The batch step's exit code.

    Why wait rather than `scontrol requeue` at once: the job's part on the lost node cannot end before the node is
    DOWN, and when slurmctld then takes the node out of a job that is requeued already, it leaves that het group's GPU
    GRES record empty (Slurm 22.05): the job starts again on a spare node and cannot create a step there ("Invalid
    generic resource (gres) specification"; slurmctld: "_step_get_gres_cnt ... node offset invalid (0 >= 0)"). For
    the same reason the sbatch files leave out `--no-kill` (with it, slurmctld takes a DOWN node out of the running
    job and requeues only the het group that held it)."""
    received: list[int] = []  # first thing: SIGUSR1's default action would end the process
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        timeout_s = slurmd_timeout_s()
        wait_s = timeout_s + NODE_LOSS_MARGIN_S if timeout_s else 0.0  # 0: SLURM never declares a silent node DOWN
        if wait_s:
            print(f"job {alloc.job_id}: waiting up to {wait_s:g} s for SLURM to declare the lost node(s) DOWN "
                  f"(SlurmdTimeout {timeout_s} s) and requeue the job", flush=True)
        deadline, settled_polls = time.monotonic() + wait_s, 0
        while not received and time.monotonic() < deadline and settled_polls < 2:
            time.sleep(NODE_LOSS_POLL_S)  # a signal's handler runs within it; the sleep then goes on (PEP 475)
            # settled in two polls in a row: SLURM's own requeue, made as it declares the node DOWN, has had a poll's
            # time to end this process
            settled_polls = settled_polls + 1 if lost_nodes_settled(alloc) else 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stops = [sig for sig in received if sig != signal.SIGUSR1]
    if stops:
        print(f"job {alloc.job_id}: stopped by {signal.Signals(stops[0]).name} (SLURM's requeue as it declares the "
              "node DOWN, or a cancel)", flush=True)
        return 128 + stops[0]
    if received:
        why = "its time is up first"
    elif settled_polls >= 2:
        why = "the lost node(s) are DOWN, or answer again"
    elif not wait_s:
        why = "SlurmdTimeout 0: SLURM does not declare a node DOWN when it stops answering"
    else:
        why = f"SLURM did not declare the lost node(s) DOWN within {wait_s:g} s"
    print(f"job {alloc.job_id}: {why}", flush=True)
    try:
        requeue(alloc.job_id)
    except UserError as exc:
        if not requeued_since_start(alloc):
            raise
        print(f"job {alloc.job_id}: SLURM has requeued it already ({exc})", flush=True)
    return 0


def requeued_since_start(alloc: Allocation) -> bool:
    """Whether SLURM has requeued the job since this start (its `Restarts=` count above SLURM_RESTART_COUNT)."""
    try:
        counts = re.findall(r"\bRestarts=(\d+)", scontrol("-o", "show", "job", str(alloc.job_id)))
    except UserError:
        return False
    return any(int(count) > alloc.restarts for count in counts)


def run_job(env: dict[str, str]) -> int:
    """The batch step of a run: preflight, the roles until the run ends, a requeue on the time-limit warning or after
    a lost node."""
    import torch  # deferred: heavy (sweep/slurm.py imports this module for `cluster_options`)

    run_dir = _run_dir(env)
    alloc = Allocation.from_env(env)
    recipe, resume = job_recipe(run_dir, env)
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
    api_key, key_source = run_api_key(run_dir, env)
    print(f"the generators' API key: {key_source}", flush=True)
    tls = run_tls(run_dir, generator_hosts(alloc)) if generator_tls(recipe, slurm=True) else None
    print(f"the generators' TLS: {f'HTTPS, certificate {tls.cert}' if tls else 'off: plain HTTP'}", flush=True)
    generators, urls, trainer, orchestrator = job_roles(run_dir, recipe, alloc, resume=resume, cuda=cuda, tls=tls)
    code = run_roles(f"job {alloc.job_id} ({run_dir})", generators, urls, trainer, orchestrator, api_key=api_key,
                     tls_ca=tls.cert if tls else None, restarts=restart_budget(run_dir, recipe, partial(allocation_lost, alloc), slurmd_timeout_s()),
                     stop_signals=(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1), watch=run_watch(run_dir, recipe))
    return end_of_roles(code, run_dir, alloc)


def end_of_roles(code: int, run_dir: Path, alloc: Allocation) -> int:
    """The job's exit code once its roles have stopped with `code` (`run_roles`'), requeueing the job where the run
    goes on: after a lost node, or on the time-limit warning unless the run had ended as it came (RUN/finished.json,
    the orchestrator's record: the trainer was finishing, or the orchestrator exiting; a requeued job would only
    start every role to end the run again)."""
    if code == ALLOCATION_LOST:  # a node is lost: go on in a new allocation
        return requeue_after_node_loss(alloc)
    if code == 128 + signal.SIGUSR1:  # time is up: the same
        if read_finished(run_dir) is None:
            requeue(alloc.job_id)
        else:
            print(f"job {alloc.job_id}: the run has ended ({run_dir / FINISHED_FILE}): nothing to requeue", flush=True)
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
        recipe, _ = job_recipe(run_dir, env)
        alloc.check(recipe)
        run_preflight(run_dir, recipe, alloc, env, cuda=torch.cuda.is_available())
        print("preflight passed", flush=True)
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":
    exit_with(main)
