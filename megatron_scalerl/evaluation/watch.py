"""`scalerl eval watch RUN_DIR`: evaluate every N-th checkpoint of a run as it appears (scheduled evaluations).

Settings (`WatchSettings`), each from the first of: its command-line flag, its SCALERL_EVAL_* variable, the run's
recipe (RUN/recipe.yaml, section `eval:`), the built-in default; the watch says once where each came from.

    every           --every       SCALERL_EVAL_EVERY      eval.interval_steps     (steps)
    datasets        --dataset     SCALERL_EVAL_DATASETS   eval.benchmarks         (the variable: space-separated)
    samples         --samples     SCALERL_EVAL_SAMPLES    eval.samples_per_problem  (k of pass@k, mean@k)
    temperature                                           eval.temperature
    max_new_tokens                                        eval.max_new_tokens     (tokens per sample at most)
    once            --once        SCALERL_EVAL_ONCE=1                             default: watch until the last step

A dataset is a shipped benchmark (aime24, aime25), a local benchmark of the recipe's `eval.benchmarks` (a mapping
with its JSONL file, verifier and template; by its name on the command line), or a JSONL file; `--verifier` grades
them all instead of their own verifiers (`harness.load_benchmark`). Every one is read and checked when the watch
starts. The evaluation samples as the recipe's rollout does (top_p, length control; each problem with its own
template) but at the eval section's temperature and length cap (`evaluated_recipe`).

For each checkpoint `RUN/checkpoints/iter_N` with N a multiple of `every` (or the run's last step), complete (its
manifest and every file's size; a checkpoint still being written has no manifest yet and is looked at again later),
and not evaluated yet:

    1. export it to HF (`models.convert.megatron_to_hf`, at the run's own layout) into RUN/eval/iter_N/hf;
    2. serve the export: the watch's one vLLM server (`CheckpointServer`) starts on the first export and loads each
       later one in place (float32 on CPUs, the run's precision on GPUs);
    3. evaluate each dataset (`harness.evaluate`: the run's recipe gives the sampling and length control, each
       problem's template and verifier its own) into RUN/eval/iter_N/<dataset>/;
    4. append one `eval` row per dataset to RUN/metrics.jsonl at step N (`metric_figures`): `eval/<dataset>/mean_at_k`,
       `.../pass_at_k/<k>`, `.../cons_at_k`, `.../tests_passed_mean`, `.../failures/<kind>`, lengths, truncation, and
       the run's `gpu_hours` at that step (the orchestrator's last figure at or before it), so the forecaster can fit
       the downstream curve; mirrored to wandb like every row;
    5. delete the export (`keep_exports` keeps it).

A dataset's `summary.json` marks it done: a restarted watcher never evaluates it again, and picks up a half-done
checkpoint where it stopped. The watcher ends once the run's last step (`trainer.max_steps`) is evaluated, or at
the end of one pass with `once` (as `slurm/eval.sbatch` does after a finished run).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatron_scalerl.checkpoint.store import CheckpointStore
from megatron_scalerl.errors import UserError
from megatron_scalerl.evaluation.harness import SUMMARY, Benchmark, EvalRequest, evaluate, load_benchmark
from megatron_scalerl.families.llama4.rope_note import note_once
from megatron_scalerl.http_json import request_json
from megatron_scalerl.inference.vllm_server import VLLMServer, VLLMServerConfig, reload_from_disk
from megatron_scalerl.models.convert import megatron_to_hf
from megatron_scalerl.platform.local_workers import free_port
from megatron_scalerl.platform.precision import serving_dtype
from megatron_scalerl.recipe import EvalConfig, LocalBenchmark, Recipe, benchmark_name
from megatron_scalerl.run.metrics_log import MetricsLog, read_metrics
from megatron_scalerl.tasks.prompts import render_prompt

log = logging.getLogger("megatron_scalerl.eval")

SERVER_READY_TIMEOUT_S = 900.0
EVAL_VARIABLES = {"every": "SCALERL_EVAL_EVERY", "datasets": "SCALERL_EVAL_DATASETS",
                  "samples": "SCALERL_EVAL_SAMPLES", "once": "SCALERL_EVAL_ONCE"}


@dataclass(frozen=True)
class WatchSettings:
    """What a watch evaluates and how (the module docstring); `sources`: setting -> where its value came from."""

    every: int  # steps: checkpoints whose step is a multiple of it are evaluated (and the run's last)
    datasets: tuple[str | LocalBenchmark, ...]  # names (shipped, or the recipe's local ones), JSONL files, entries
    samples: int  # completions per problem (k)
    temperature: float
    max_new_tokens: int  # tokens per sample at most
    once: bool  # one pass over the checkpoints present, then exit
    sources: dict[str, str]

    def describe(self) -> str:
        values = {"every": f"{self.every} steps", "datasets": " ".join(map(benchmark_name, self.datasets)),
                  "samples": str(self.samples),
                  "temperature": f"{self.temperature:g}", "max_new_tokens": str(self.max_new_tokens),
                  "once": "yes" if self.once else "no"}
        return "eval settings: " + ", ".join(f"{k} {v} ({self.sources[k]})" for k, v in values.items())


def _positive(value: int | str, where: str) -> int:
    number = int(value) if isinstance(value, int) or value.isdigit() else 0
    if number < 1:
        raise UserError(f"{where}: {value!r} is not a whole number >= 1")
    return number


def _datasets(value: list[str] | str, where: str) -> tuple[str, ...]:
    names = tuple(value.split() if isinstance(value, str) else value)
    if not names:
        raise UserError(f"{where}: names no dataset")
    return names


def _switch(value: bool | str, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if value not in ("0", "1"):
        raise UserError(f"{where}: {value!r} must be 1 (one pass) or 0")
    return value == "1"


def watch_settings(config: EvalConfig, env: Mapping[str, str], *, every: int | None = None,
                   datasets: list[str] | None = None, samples: int | None = None, once: bool = False
                   ) -> WatchSettings:
    """The watch's settings from its flags (None, or False for `once`: not given), the SCALERL_EVAL_* variables in
    `env` and the run's `eval:` section `config`, in that order (the module docstring's table)."""
    sources = {"temperature": "recipe eval.temperature", "max_new_tokens": "recipe eval.max_new_tokens"}

    def first(name: str, flag: Any, option: str, parse: Callable[[Any, str], Any], fallback: Any, origin: str) -> Any:
        variable = EVAL_VARIABLES[name]
        for value, where in ((flag, option), (env.get(variable, "").strip() or None, variable)):
            if value is not None:
                sources[name] = where
                return parse(value, where)
        sources[name] = origin
        return fallback

    return WatchSettings(
        every=first("every", every, "--every", _positive, config.interval_steps, "recipe eval.interval_steps"),
        datasets=first("datasets", datasets, "--dataset", _datasets, tuple(config.benchmarks),
                       "recipe eval.benchmarks"),
        samples=first("samples", samples, "--samples", _positive, config.samples_per_problem,
                      "recipe eval.samples_per_problem"),
        temperature=config.temperature, max_new_tokens=config.max_new_tokens,
        once=first("once", True if once else None, "--once", _switch, False, "default"), sources=sources)


def evaluated_recipe(recipe: Recipe, settings: WatchSettings) -> Recipe:
    """`recipe` as the evaluation samples: its rollout's temperature and length cap are the watch's (the harness,
    the length control and the server's max_model_len read them there)."""
    rollout = recipe.rollout.model_copy(update={"temperature": settings.temperature,
                                                "max_new_tokens": settings.max_new_tokens})
    return recipe.model_copy(update={"rollout": rollout})


def eval_dir(run_dir: Path, iteration: int) -> Path:
    return run_dir / "eval" / f"iter_{iteration:07d}"


def pending(run_dir: Path, every: int, datasets: list[str], last: int) -> list[int]:
    """Complete checkpoints due for evaluation (multiples of `every`, and the run's `last` step) with a dataset (by
    name) not yet done, oldest first."""
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


def load_benchmarks(recipe: Recipe, settings: WatchSettings, verifier: str | None = None) -> list[Benchmark]:
    """The watch's datasets read and checked (`harness.load_benchmark`, names resolved against the recipe's
    `eval.benchmarks`); UserError for two with one name (they would share a directory and metrics)."""
    benchmarks = [load_benchmark(d, recipe.eval.benchmarks, verifier) for d in settings.datasets]
    names = [b.name for b in benchmarks]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"eval datasets: {', '.join(map(repr, twice))} named twice ({settings.sources['datasets']})")
    return benchmarks


def metric_figures(name: str, summary: dict) -> dict[str, float]:
    """The `eval` row's figures of one dataset's summary: its numbers as `eval/<name>/<figure>`, pass@k as
    `eval/<name>/pass_at_k/<k>`, and failures as `eval/<name>/failures/<kind>` (samples)."""
    figures = {f"eval/{name}/{k}": v for k, v in summary.items() if isinstance(v, int | float)}
    figures.update({f"eval/{name}/pass_at_k/{k}": v for k, v in summary["pass_at_k"].items()})
    figures.update({f"eval/{name}/failures/{kind}": n for kind, n in summary["failures"].items()})
    return figures


def _model_len(recipe: Recipe, tokenizer: Any, benchmarks: list[Benchmark]) -> int:
    """Tokens per sequence the server needs: the datasets' longest prompt + rollout.max_new_tokens (evaluation
    prompts are often longer than the training ones), at most the model's max_position_embeddings."""
    longest = max(len(tokenizer(render_prompt(p, tokenizer)).input_ids) if tokenizer is not None
                  else len(p.problem) for b in benchmarks for p in b.problems)
    return min(recipe.model.max_position_embeddings, longest + recipe.rollout.max_new_tokens)


class CheckpointServer:
    """One vLLM server for a whole watch: started on the first export it is given, then each later export is loaded
    into it in place (`vllm_server.reload_from_disk`: vLLM's layered reload plus the CPU MoE re-packing, prefix cache
    dropped) instead of a new server per checkpoint (minutes each for the 8B and Scout presets on GPUs).

    On GPUs the export (Megatron on the same GPUs) needs the memory the server holds: `release` puts the server to
    sleep (vLLM's sleep mode, level 2: weights and KV cache freed) before an export and `serve` wakes it before the
    reload. A server that died between checkpoints is started again on the next export. Served under the run's name,
    behind a key of its own (its dev routes run any worker method); float32 on CPUs, the run's precision on GPUs;
    `max_model_len` from the benchmarks; its log: RUN/eval/vllm.log. Its sampling is the requests' alone, as every
    server's (`VLLMServerConfig.command`), though an export carries its initial checkpoint's generation_config.json."""

    def __init__(self, run_dir: Path, recipe: Recipe, benchmarks: list[Benchmark]):
        import secrets

        import torch

        if recipe.generator_server_nodes > 1:
            raise UserError(f"{run_dir}: the evaluation serves on one node (slurm/eval.sbatch), and this run's "
                            f"generators span {recipe.generator_server_nodes} nodes (parallelism.generator_tp="
                            f"{recipe.parallelism.generator_tp} over cluster.gpus_per_node="
                            f"{recipe.cluster.gpus_per_node}): a multi-node evaluation job is not built")
        self.run_dir, self.recipe, self.benchmarks = run_dir, recipe, benchmarks
        self.on_gpus = torch.cuda.is_available()
        self.api_key = secrets.token_hex(16)
        self.server: Any = None
        self.tokenizer: Any = None

    @property
    def name(self) -> str:
        return self.recipe.name

    def release(self) -> None:
        """Before an export: free the GPU memory the server holds (nothing to do on CPUs or before the first start)."""
        if self.on_gpus and self._running():
            request_json(self.server.url, "/sleep", query={"level": 2}, timeout_s=SERVER_READY_TIMEOUT_S,
                         api_key=self.api_key)

    def serve(self, export: Path) -> str:
        """The URL of a server that now serves the weights of `export` (an HF directory of this run)."""
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
        from transformers import AutoTokenizer  # deferred: a heavy import, needed once a checkpoint is served

        if (export / "tokenizer_config.json").is_file():
            self.tokenizer = AutoTokenizer.from_pretrained(str(export))
        config = VLLMServerConfig(  # weight_transfer on (the default): the reload route
            model=str(export), port=free_port(), dtype=serving_dtype(self.recipe, self.on_gpus), api_key=self.api_key,
            max_model_len=_model_len(self.recipe, self.tokenizer, self.benchmarks),
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
        for benchmark in serving.benchmarks:
            if (where / benchmark.name / SUMMARY).is_file():
                continue
            summary = evaluate(replace(request, endpoint=url, model=serving.name, api_key=serving.api_key,
                                       out=where / benchmark.name, extra={"step": iteration}),
                               benchmark, recipe, serving.tokenizer)
            figures = metric_figures(benchmark.name, summary)
            metrics.log(iteration, {**figures, **({"gpu_hours": hours} if hours is not None else {})})
            summaries.append(summary)
            print(f"iter_{iteration:07d} {benchmark.name}: mean@{summary['samples_per_problem']} "
                  f"{summary['mean_at_k']:.3f}, pass@{summary['samples_per_problem']} "
                  f"{summary['pass_at_k'][str(summary['samples_per_problem'])]:.3f}, cons "
                  f"{summary['cons_at_k']:.3f}", flush=True)
    finally:
        metrics.close()
        if not keep_exports:
            shutil.rmtree(export, ignore_errors=True)
    return summaries


def watch(run_dir: Path, recipe: Recipe, request: EvalRequest, settings: WatchSettings, *, verifier: str | None = None,
          poll_s: float = 60.0, keep_exports: bool = False) -> int:
    """Evaluate the due checkpoints of the run in `run_dir` (its `recipe`) with `request`'s samples and grading
    (`verifier`: instead of each dataset's own), until the run's last step is evaluated (or one pass with
    `settings.once`); how many checkpoints were evaluated."""
    note = note_once(recipe.model.rope_scaling)  # this job's processes (its vLLM server too) then stay quiet on it
    if note:
        print(note, flush=True)
    print(settings.describe(), flush=True)
    last = recipe.trainer.max_steps
    benchmarks = load_benchmarks(recipe, settings, verifier)
    names = [b.name for b in benchmarks]
    evaluated = 0
    serving = CheckpointServer(run_dir, evaluated_recipe(recipe, settings), benchmarks)
    try:
        while True:
            for iteration in pending(run_dir, settings.every, names, last):
                evaluate_checkpoint(serving, iteration, request, keep_exports=keep_exports)
                evaluated += 1
            done = all((eval_dir(run_dir, last) / name / SUMMARY).is_file() for name in names)
            if settings.once or done:
                return evaluated
            time.sleep(poll_s)
    finally:
        serving.close()
