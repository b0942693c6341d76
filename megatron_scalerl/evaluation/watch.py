"""`scalerl eval watch RUN_DIR`: evaluate every N-th checkpoint of a run as it appears (scheduled evaluations).

For each checkpoint `RUN/checkpoints/iter_N` with N a multiple of `every` (or the run's last step), complete (its manifest and every file's
size; a checkpoint still being written has no manifest yet and is looked at again later), and not evaluated yet:

    1. export it to HF (`models.convert.megatron_to_hf`, at the run's own layout) into RUN/eval/iter_N/hf;
    2. serve the export: the watch's one vLLM server (`CheckpointServer`) starts on the first export and loads each
       later one in place (float32 on CPUs, the run's precision on GPUs);
    3. evaluate each dataset (`harness.evaluate`: the run's recipe gives the template, sampling and length control)
       into RUN/eval/iter_N/<dataset>/;
    4. append one `eval` row per dataset to RUN/metrics.jsonl at step N: `eval/<dataset>/mean_at_k`,
       `.../pass_at_k/<k>`, `.../cons_at_k`, lengths, truncation, and the run's `gpu_hours` at that step (the
       orchestrator's last figure at or before it), so the forecaster can fit the downstream curve; mirrored to wandb
       like every row;
    5. delete the export (`keep_exports` keeps it).

A dataset's `summary.json` marks it done: a restarted watcher never evaluates it again, and picks up a half-done
checkpoint where it stopped. The watcher ends once the run's last step (`trainer.max_steps`) is evaluated, or at
the end of one pass with `once` (as `slurm/eval.sbatch` does after a finished run).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from megatron_scalerl.checkpoint.store import CheckpointStore
from megatron_scalerl.errors import UserError
from megatron_scalerl.evaluation.harness import SUMMARY, EvalRequest, evaluate
from megatron_scalerl.metrics import MetricsLog, read_metrics
from megatron_scalerl.recipe import Recipe, load_recipe
from megatron_scalerl.rope_note import note_once

log = logging.getLogger("megatron_scalerl.eval")

SERVER_READY_TIMEOUT_S = 900.0


def eval_dir(run_dir: Path, iteration: int) -> Path:
    return run_dir / "eval" / f"iter_{iteration:07d}"


def pending(run_dir: Path, every: int, datasets: list[str], last: int) -> list[int]:
    """Complete checkpoints due for evaluation (multiples of `every`, and the run's `last` step) with a dataset not
    yet done, oldest first."""
    store = CheckpointStore(run_dir, keep=1)
    due = []
    for iteration in sorted(store.iterations()):
        if (iteration % every and iteration != last) or all((eval_dir(run_dir, iteration) / d / SUMMARY).is_file() for d in datasets):
            continue
        problems = store.problems(store.path(iteration), checksums=False)
        if problems:
            log.info("iter_%07d not complete yet (%s): later", iteration, problems[0])
            continue
        due.append(iteration)
    return due


def gpu_hours_at(run_dir: Path, step: int) -> float | None:
    """The run's GPU-hours at optimizer step `step`: the orchestrator's last figure at or before it."""
    rows = [r for r in read_metrics(run_dir, role="orchestrator") if "gpu_hours" in r and r["step"] <= step]
    return rows[-1]["gpu_hours"] if rows else None


def _dataset_label(dataset: str) -> str:
    return Path(dataset).stem if dataset.endswith(".jsonl") else dataset


def _model_len(recipe: Recipe, tokenizer: Any, datasets: list[str]) -> int:
    """Tokens per sequence the server needs: the datasets' longest prompt + rollout.max_new_tokens (evaluation
    prompts are often longer than the training ones), at most the model's max_position_embeddings."""
    from megatron_scalerl.evaluation.harness import load_dataset
    from megatron_scalerl.rollout.prompts import render_prompt

    longest = max(len(tokenizer(render_prompt(p.problem, tokenizer)).input_ids) if tokenizer is not None
                  else len(p.problem) for d in datasets for p in load_dataset(d))
    return min(recipe.model.max_position_embeddings, longest + recipe.rollout.max_new_tokens)


class CheckpointServer:
    """One vLLM server for a whole watch: started on the first export it is given, then each later export is loaded
    into it in place (`vllm_server.reload_from_disk`: vLLM's layered reload plus the CPU MoE re-packing, prefix cache
    dropped) instead of a new server per checkpoint (minutes each for the 8B and Scout presets on GPUs).

    On GPUs the export (Megatron on the same GPUs) needs the memory the server holds: `release` puts the server to
    sleep (vLLM's sleep mode, level 2: weights and KV cache freed) before an export and `serve` wakes it before the
    reload. A server that died between checkpoints is started again on the next export. Served under the run's name,
    behind a key of its own (its dev routes run any worker method); float32 on CPUs, the run's precision on GPUs;
    `max_model_len` from the datasets; its log: RUN/eval/vllm.log."""

    def __init__(self, run_dir: Path, recipe: Recipe, datasets: list[str]):
        import secrets

        import torch

        self.run_dir, self.recipe, self.datasets = run_dir, recipe, datasets
        self.on_gpus = torch.cuda.is_available()
        self.api_key = secrets.token_hex(16)
        self.server: Any = None
        self.tokenizer: Any = None

    @property
    def name(self) -> str:
        return self.recipe.name

    def release(self) -> None:
        """Before an export: free the GPU memory the server holds (nothing to do on CPUs or before the first start)."""
        from megatron_scalerl.http_json import request_json

        if self.on_gpus and self._running():
            request_json(self.server.url, "/sleep", query={"level": 2}, timeout_s=SERVER_READY_TIMEOUT_S,
                         api_key=self.api_key)

    def serve(self, export: Path) -> str:
        """The URL of a server that now serves the weights of `export` (an HF directory of this run)."""
        from megatron_scalerl.http_json import request_json
        from megatron_scalerl.rollout.vllm_server import reload_from_disk

        if self.server is not None and not self._running():
            log.warning("the evaluation server exited (code %s); starting a new one. %s:\n%s",
                        self.server.process.returncode, self.server.log_path, self.server.log_tail())
            self.close()
        if self.server is None:
            self._start(export)
            how = "a new server"
        else:
            if self.on_gpus:
                request_json(self.server.url, "/wake_up", timeout_s=SERVER_READY_TIMEOUT_S, api_key=self.api_key)
            reload_from_disk(self.server.url, export, timeout_s=SERVER_READY_TIMEOUT_S, api_key=self.api_key)
            how = "loaded into the running server"
        print(f"serving {export} at {self.server.url}: {how}", flush=True)
        return self.server.url

    def _running(self) -> bool:
        return self.server is not None and self.server.process is not None and self.server.process.poll() is None

    def _start(self, export: Path) -> None:
        from transformers import AutoTokenizer

        from megatron_scalerl.launch.roles import serving_dtype
        from megatron_scalerl.platform.local_workers import free_port
        from megatron_scalerl.rollout.vllm_server import VLLMServer, VLLMServerConfig

        if (export / "tokenizer_config.json").is_file():
            self.tokenizer = AutoTokenizer.from_pretrained(str(export))
        config = VLLMServerConfig(  # weight_transfer on (the default): the reload route
            model=str(export), port=free_port(), dtype=serving_dtype(self.recipe, self.on_gpus), api_key=self.api_key,
            max_model_len=_model_len(self.recipe, self.tokenizer, self.datasets),
            tensor_parallel_size=self.recipe.parallelism.generator_tp, seed=self.recipe.trainer.seed,
            extra_args=("--served-model-name", self.name, *(("--enable-sleep-mode",) if self.on_gpus else ())),
            env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
        self.server = VLLMServer(config, self.run_dir / "eval" / "vllm.log").start()
        self.server.wait_ready(SERVER_READY_TIMEOUT_S)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def evaluate_checkpoint(serving: CheckpointServer, iteration: int, request: EvalRequest, *,
                        keep_exports: bool = False) -> list[dict]:
    """Steps 1-5 for one checkpoint of `serving`'s run; the summaries of the datasets evaluated now."""
    from megatron_scalerl.models.convert import megatron_to_hf

    run_dir, recipe = serving.run_dir, serving.recipe
    where = eval_dir(run_dir, iteration)
    export = where / "hf"
    if not (export / "config.json").is_file():
        shutil.rmtree(export, ignore_errors=True)
        serving.release()
        megatron_to_hf(CheckpointStore(run_dir, keep=1).path(iteration), export, recipe.parallelism)
    metrics = MetricsLog(run_dir, "eval", wandb_mode=recipe.logging.wandb_mode,
                         wandb_project=recipe.logging.wandb_project, run_name=recipe.name)
    summaries = []
    hours = gpu_hours_at(run_dir, iteration)
    try:
        url = serving.serve(export)
        for dataset in serving.datasets:
            label = _dataset_label(dataset)
            if (where / label / SUMMARY).is_file():
                continue
            summary = evaluate(EvalRequest(**{**request.__dict__, "endpoint": url, "model": serving.name,
                                              "api_key": serving.api_key,
                                              "dataset": dataset, "out": where / label,
                                              "extra": {"step": iteration}}), recipe, serving.tokenizer)
            figures = {f"eval/{label}/{k}": v for k, v in summary.items() if isinstance(v, int | float)}
            figures.update({f"eval/{label}/pass_at_k/{k}": v for k, v in summary["pass_at_k"].items()})
            metrics.log(iteration, {**figures, **({"gpu_hours": hours} if hours is not None else {})})
            summaries.append(summary)
            print(f"iter_{iteration:07d} {label}: mean@{summary['samples_per_problem']} "
                  f"{summary['mean_at_k']:.3f}, pass@{summary['samples_per_problem']} "
                  f"{summary['pass_at_k'][str(summary['samples_per_problem'])]:.3f}, cons "
                  f"{summary['cons_at_k']:.3f}", flush=True)
    finally:
        metrics.close()
        if not keep_exports:
            shutil.rmtree(export, ignore_errors=True)
    return summaries


def watch(run_dir: Path, request: EvalRequest, datasets: list[str], *, every: int, once: bool, poll_s: float = 60.0,
          keep_exports: bool = False) -> int:
    """Evaluate due checkpoints until the run's last step is evaluated (or one pass with `once`); how many
    checkpoints were evaluated."""
    if not (run_dir / "recipe.yaml").is_file():
        raise UserError(f"{run_dir}: no recipe.yaml, not a run directory")
    if every < 1:
        raise UserError(f"--every must be at least 1 (got {every})")
    recipe = load_recipe(run_dir / "recipe.yaml")
    note = note_once(recipe.model.rope_scaling)  # this job's processes (its vLLM server too) then stay quiet on it
    if note:
        print(note, flush=True)
    last = recipe.trainer.max_steps
    evaluated = 0
    serving = CheckpointServer(run_dir, recipe, datasets)
    try:
        while True:
            for iteration in pending(run_dir, every, [_dataset_label(d) for d in datasets], last):
                evaluate_checkpoint(serving, iteration, request, keep_exports=keep_exports)
                evaluated += 1
            done = all((eval_dir(run_dir, last) / _dataset_label(d) / SUMMARY).is_file() for d in datasets)
            if once or done:
                return evaluated
            time.sleep(poll_s)
    finally:
        serving.close()
