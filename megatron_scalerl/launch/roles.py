"""The run's roles as command lines: what the local launcher starts, and what SLURM's srun starts on each node.
Each process a launch starts runs one module, named in one table, `ENTRY_POINTS`:

    trainer       torchrun -m megatron_scalerl.trainer --run-dir RUN             (cluster.trainer_gpus processes)
    generator     python -m megatron_scalerl.commands serve --model RUN/model --port P ... -- --load-format dummy
                  (`scalerl serve`, one per server; it starts vLLM's server, inference/vllm_server.py)
    orchestrator  python -m megatron_scalerl.orchestrator --run-dir RUN [--resume]

(SLURM's preflight checks, `python -m megatron_scalerl.launch.preflight node` on each node before the roles, build
their own line in preflight.py, a module that stays light: this one imports torch.)

Every role reads the run directory. `prepare_run_dir` writes what the roles need before they start:
- `recipe.yaml`, the resolved recipe (`trainer.precision` too: never `auto` there);
- `model/`: the served model's `config.json` (from the recipe's model section) and the tokenizer files. The
  generators start from it with vLLM's dummy weights: the trainer sends the real ones (its initial checkpoint, or the
  one it resumed from) before the orchestrator gives them work, so a generator never needs a checkpoint on disk.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.families import hf_config_dict
from megatron_scalerl.families.llama4.rope_note import note_once
from megatron_scalerl.fileio import atomic_write_text
from megatron_scalerl.launch.supervise import Restarts, RunWatch
from megatron_scalerl.models.memory_plan import reserve_gib
from megatron_scalerl.models.tokenizer import (
    GENERATION_CONFIG,
    TOKENIZER_FILES,
    ensure_generation_config,
    has_tokenizer,
    special_token_ids,
    tokenizer_facts,
)
from megatron_scalerl.orchestrator.state import rewind_to_checkpoint
from megatron_scalerl.platform.precision import Precision, resolve_precision, with_resolved_precision
from megatron_scalerl.recipe import Recipe, require_init_from_matches
from megatron_scalerl.run.deadlines import Deadline
from megatron_scalerl.run.directory import RECIPE_FILE, STOP_TIMEOUT_S, clear_stop_request
from megatron_scalerl.run.metrics_log import MetricsLog
from megatron_scalerl.run.tls import RunTLS

MODEL_DIR = "model"
# the module each process a launch starts runs (`python -m`, the trainer's under torchrun)
ENTRY_POINTS = {
    "trainer": "megatron_scalerl.trainer",
    "generator": "megatron_scalerl.commands",  # with `serve` first: the `scalerl serve` command
    "orchestrator": "megatron_scalerl.orchestrator",
}


def python_command(role: str, *args: str) -> list[str]:
    """`python -m` the role's module (`ENTRY_POINTS`) with `args`, in this interpreter."""
    return [sys.executable, "-m", ENTRY_POINTS[role], *args]


def tokenizer_source(recipe: Recipe, given: Path | None) -> Path:
    """The directory whose tokenizer files the run uses: `given`, else `trainer.init_from` when it has them."""
    for candidate in (given, Path(recipe.trainer.init_from) if recipe.trainer.init_from else None):
        if candidate is not None and has_tokenizer(candidate):
            return candidate
    raise UserError("the run needs a tokenizer (the orchestrator renders prompts and grades answers): pass "
                    "--tokenizer DIR, or start from an HF checkpoint with tokenizer files (trainer.init_from)"
                    + (f"; {given} has none" if given else ""))


def prepare_run_dir(run_dir: Path, recipe: Recipe, tokenizer_dir: Path, *, cuda: bool) -> Recipe:
    """Write `recipe.yaml` and `model/` (config.json, generation_config.json + tokenizer files) into `run_dir`; the recipe as written, its
    `trainer.precision` resolved for the trainer's device (`cuda`: GPUs, else this CPU; `platform.precision`), so
    that the run's record says what it trained in. An HF `trainer.init_from` of another model than the recipe's is
    refused first, before anything is written or any role starts (`recipe.require_init_from_matches`)."""
    require_init_from_matches(recipe)
    say_rope_note(recipe)  # before the tokenizer, whose loading may read a config.json of the model
    tokenizer = tokenizer_facts(tokenizer_dir)
    if len(tokenizer) > recipe.model.vocab_size:
        raise UserError(f"tokenizer {tokenizer_dir}: {len(tokenizer)} ids, more than model.vocab_size "
                        f"{recipe.model.vocab_size}")
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe, precision = with_resolved_precision(recipe, cuda=cuda)
    say_precision(precision)
    atomic_write_text(run_dir / RECIPE_FILE, recipe.to_yaml())
    model_dir = run_dir / MODEL_DIR
    model_dir.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, model_dir / name)
    config = {**hf_config_dict(recipe.model), **special_token_ids(tokenizer)}
    atomic_write_text(model_dir / "config.json", json.dumps(config, indent=1) + "\n")
    if (tokenizer_dir / GENERATION_CONFIG).is_file():  # the model's end tokens: the generators stop at them
        shutil.copy2(tokenizer_dir / GENERATION_CONFIG, model_dir / GENERATION_CONFIG)
    ensure_generation_config(model_dir, config)
    return recipe


def say_precision(precision: Precision) -> None:
    """The launch's line on the trainer's precision (a warning where bf16 would be emulated): at a new run's
    preparation, and when a run is resumed (its recipe.yaml may say bf16 for a machine that emulates it)."""
    print(f"{'warning: ' if precision.emulated_bf16 else ''}trainer precision: {precision.reason}", flush=True)


def say_launch_notes(recipe: Recipe, *, cuda: bool, resume: bool) -> None:
    """What both launchers' role builders say before the roles start: the RoPE note (a resumed run has not had it
    yet) and, for a resumed run, the precision line (a new run's came from `prepare_run_dir`)."""
    say_rope_note(recipe)
    if resume:
        say_precision(resolve_precision(recipe.trainer.precision, cuda=cuda))


def say_rope_note(recipe: Recipe) -> None:
    """Once per launch, before any role reads the model's config: the note on a Scout-style rope_scaling
    (`rope_note`), which the roles then leave unsaid. Both `prepare_run_dir` (a new run) and the launchers' role
    builders (a resumed run too) call it; the second call of a launch says nothing."""
    note = note_once(recipe.model.rope_scaling)
    if note:
        print(note, flush=True)


def trainer_command(run_dir: Path, recipe: Recipe, *, rendezvous: str | None = None) -> list[str]:
    """torchrun over the trainer's processes: all `cluster.trainer_gpus` of them on this machine, or, given
    `rendezvous` (host:port on the first trainer node), this node's `cluster.gpus_per_node` of `cluster.trainer_nodes`
    nodes; each node's rank then comes from $PET_NODE_RANK (torchrun's own variable for --node-rank).

    On SIGTERM torchrun gives its workers as long to stop (finish the step, checkpoint) as the launcher gives the
    trainer (`STOP_TIMEOUT_S`), not its own default of 30 s, after which it would SIGKILL them mid-checkpoint."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    if rendezvous is None:
        where = ["--standalone", f"--nproc-per-node={recipe.cluster.trainer_gpus}"]
    else:
        host, port = rendezvous.rsplit(":", 1)
        where = [f"--nnodes={recipe.cluster.trainer_nodes}", f"--nproc-per-node={recipe.cluster.gpus_per_node}",
                 f"--master-addr={host}", f"--master-port={port}"]
    return [torchrun, *where, f"--shutdown-timeout={STOP_TIMEOUT_S:.0f}", "-m", ENTRY_POINTS["trainer"],
            "--run-dir", str(run_dir)]


def generator_tls(recipe: Recipe, *, slurm: bool) -> bool:
    """Whether the run's generators serve HTTPS (`cluster.generator_tls`): `auto` is on under SLURM (`slurm`), where
    their ports face the cluster network, and off for a local launch, whose generators listen on 127.0.0.1 only."""
    return recipe.cluster.generator_tls == "on" or (recipe.cluster.generator_tls == "auto" and slurm)


def generator_url(host: str, port: int, tls: RunTLS | None) -> str:
    return f"{'https' if tls else 'http'}://{host}:{port}"


def generator_command(run_dir: Path, recipe: Recipe, *, port: int, host: str, dtype: str, log: Path,
                      master_port: int | None = None, tls: RunTLS | None = None) -> list[str]:
    """`scalerl serve` of the run's model directory with dummy weights (the trainer sends the real ones), capturing
    routes when the recipe asks for the MoE model's routing (`Recipe.captures_routes`), serving HTTPS with the run's
    certificate given `tls` (`run.tls.run_tls`). Given `master_port`, a server spanning
    `Recipe.generator_server_nodes` nodes (the SLURM launcher's), run on each of them and meeting at
    `host:master_port` (its first node), each node's rank in $SCALERL_NODE_RANK; without, all of its workers here.
    On GPUs, what weight sync adds after vLLM starts is kept out of vLLM's share (`--reserve-gib`)."""
    max_len = recipe.rollout.max_prompt_tokens + recipe.rollout.max_new_tokens
    span = ["--nnodes", str(recipe.generator_server_nodes), "--master-addr", host, "--master-port",
            str(master_port)] if master_port is not None else []
    return python_command(
        "generator", "serve", "--model", str(run_dir / MODEL_DIR), "--host", host, "--port", str(port),
        "--tp", str(recipe.parallelism.generator_tp), *span, "--dtype", dtype, "--max-model-len", str(max_len),
        "--seed", str(recipe.trainer.seed), "--log", str(log),
        *(["--ssl-keyfile", str(tls.key), "--ssl-certfile", str(tls.cert)] if tls else []),
        *([] if recipe.trainer.fp32_lm_head else ["--no-fp32-lm-head"]),
        *(["--capture-routes"] if recipe.captures_routes else []),
        "--reserve-gib", f"{reserve_gib(recipe):.3f}",
        "--", "--load-format", "dummy")


def orchestrator_command(run_dir: Path, *, resume: bool) -> list[str]:
    return python_command("orchestrator", "--run-dir", str(run_dir), *(["--resume"] if resume else []))


def restart_budget(run_dir: Path, recipe: Recipe, allocation_lost: Callable[[], str | None] = lambda: None,
                   settle_s: float = 0.0) -> Restarts:
    """The launch's budget for restarting a failed trainer or orchestrator (`recipe.launch`). Each restart rewinds
    the run to the trainer's last checkpoint (stream, orchestrator state, metrics: `rewind_to_checkpoint`), clears
    the stop request the trainer's stop left, and is a `launcher` record in metrics.jsonl at that checkpoint's step
    (`launch/restarts`: the restarts of this launch so far, `launch/restart_cause`). `allocation_lost`, `settle_s`
    (seconds): see `Restarts`."""

    def prepare(restart: int, cause: str) -> int:
        step = rewind_to_checkpoint(run_dir, partial(print, flush=True), metrics=True)
        clear_stop_request(run_dir)
        MetricsLog(run_dir, "launcher").log(step, {"launch/restarts": float(restart), "launch/restart_cause": cause})
        return step

    return Restarts(recipe.launch.max_restarts, recipe.launch.restart_backoff_s, prepare,
                    orchestrator_command(run_dir, resume=True), allocation_lost, settle_s)


def run_watch(run_dir: Path, recipe: Recipe) -> RunWatch:
    """What the supervisor watches in the run directory (`supervise.RunWatch`): the trainer's requests to start a
    generator again, and the watchdog over metrics.jsonl with the run's deadlines (`launch.wait_floor_min`,
    `launch.first_wait_min`), over the trainer's logged steps (every `logging.log_interval`)."""
    every = recipe.logging.log_interval
    return RunWatch(run_dir, Deadline.of(recipe.launch, unit="steps" if every == 1 else "logged steps"),
                    logged_every=every)
