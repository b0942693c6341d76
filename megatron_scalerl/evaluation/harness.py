"""One evaluation: K samples of every problem of a dataset from an OpenAI-compatible endpoint, graded, summarised.

    summary = evaluate(EvalRequest(endpoint, model, "aime24", samples=16, out=Path("eval/out")), recipe, tokenizer)

Prompts are the training template (`tasks.prompts.render_prompt`: the problem, the boxed-answer instruction, an
opened thinking block, through the tokenizer's chat template when it has one); sampling and length control are the
recipe's (`rollout.temperature`, `top_p`, `max_new_tokens`, the forced interruption: `evaluation/sampling.py`).
Grading: the answer part (after the last `</think>`) against the gold answer with math-verify in worker processes
(`tasks.rewards.RewardGrader`), `grader_timeout_s` seconds per answer; an answer that runs out of time counts as
wrong and is listed in the summary.

Writes into `out/`: `problems.jsonl` (one line per problem: its samples' text, extracted answer, verdict, tokens,
truncation, interruption, grader time-out) and then `summary.json` (`evaluation.metrics.summarize`: `mean_at_k`,
`pass_at_k` keyed by k, `cons_at_k`, lengths, truncation, plus what was evaluated and how). Both are written
atomically, the summary last: a directory with a summary.json holds a finished evaluation.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_scalerl.errors import UserError
from megatron_scalerl.evaluation.metrics import extract_boxed, summarize
from megatron_scalerl.evaluation.sampling import CompletionClient, SamplingSettings, sample_completion
from megatron_scalerl.fileio import atomic_write_text
from megatron_scalerl.recipe import DataSource, Recipe
from megatron_scalerl.rollout.generation import length_control_policy
from megatron_scalerl.tasks.prompts import Problem, load_source, render_prompt
from megatron_scalerl.tasks.rewards import RewardGrader, strip_thinking

EVAL_DATA = Path(__file__).resolve().parents[2] / "eval" / "data"
DATASETS = {"aime24": EVAL_DATA / "aime24.jsonl", "aime25": EVAL_DATA / "aime25.jsonl"}
SUMMARY, PROBLEMS = "summary.json", "problems.jsonl"


@dataclass
class EvalRequest:
    endpoint: str  # base URL of an OpenAI-compatible server
    model: str  # the served model's name
    dataset: str  # aime24, aime25, or a JSONL file with problem/answer fields
    samples: int  # K per problem
    out: Path
    api_key: str | None = None
    concurrency: int = 32  # requests in flight
    grader_timeout_s: float = 10.0
    grader_workers: int | None = None
    verifier: str = "math"
    problem_field: str = "problem"
    answer_field: str = "answer"
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in summary.json (e.g. the checkpoint step)


def load_dataset(name: str, problem_field: str = "problem", answer_field: str = "answer") -> list[Problem]:
    """A shipped dataset by name (aime24, aime25) or a JSONL file; a malformed row is a UserError naming its line."""
    path = DATASETS.get(name, Path(name))
    if not path.is_file():
        raise UserError(f"dataset {name!r}: neither a shipped dataset ({', '.join(DATASETS)}) nor a JSONL file")
    problems = load_source(DataSource(kind="jsonl", path=str(path), problem_field=problem_field,
                                      answer_field=answer_field), seed=0)
    if not problems:
        raise UserError(f"dataset {path}: no problems")
    return problems


def sampling_settings(recipe: Recipe, tokenizer: Any) -> SamplingSettings:
    """The recipe's sampling and length control (the interruption phrase tokenised by `tokenizer`)."""
    control = recipe.algorithm.length_control
    return SamplingSettings(temperature=recipe.rollout.temperature, top_p=recipe.rollout.top_p,
                            max_new_tokens=recipe.rollout.max_new_tokens,
                            policy=length_control_policy(recipe, tokenizer) if tokenizer is not None else None,
                            interruption_phrase=control.interruption_phrase)


class _Progress:
    """`done/total samples` on one stderr line (a terminal) or every tenth (a log file)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.start = total, label, 0, time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self) -> None:
        self.done += 1
        if self.tty or self.done == self.total or self.done % max(1, self.total // 10) == 0:
            rate = self.done / max(time.monotonic() - self.start, 1e-9)
            start = "\r" if self.tty else ""
            print(f"{start}{self.label}: {self.done}/{self.total} samples ({rate:.1f}/s)",
                  end="" if self.tty and self.done < self.total else "\n", file=sys.stderr, flush=True)


async def _evaluate(request: EvalRequest, problems: list[Problem], settings: SamplingSettings, tokenizer: Any,
                    grader: RewardGrader) -> list[dict]:
    progress = _Progress(len(problems) * request.samples, f"{request.dataset} @ {request.model}")

    async def one(client: CompletionClient, problem: Problem, prompt: str, i: int) -> dict:
        done = await sample_completion(client, prompt, f"{problem.key}#{i}", settings)
        grade = await grader.grade(done.text, problem.answer, request.verifier)
        progress.step()
        return {"text": done.text, "answer": extract_boxed(strip_thinking(done.text)), "correct": grade.correct,
                "tokens": done.tokens, "truncated": done.truncated, "interrupted": done.interrupted,
                "timed_out": grade.timed_out, "grader_error": grade.error}

    async with CompletionClient(request.endpoint, request.model, api_key=request.api_key,
                                concurrency=request.concurrency) as client:
        prompts = [render_prompt(p.problem, tokenizer) for p in problems]
        samples = await asyncio.gather(*(one(client, p, prompt, i) for p, prompt in zip(problems, prompts, strict=True)
                                         for i in range(request.samples)))
    k = request.samples
    return [{"key": p.key, "problem": p.problem, "gold": p.answer, "samples": samples[j * k:(j + 1) * k]}
            for j, p in enumerate(problems)]


def evaluate(request: EvalRequest, recipe: Recipe, tokenizer: Any) -> dict:
    """Run the evaluation, write problems.jsonl and summary.json into `request.out`, return the summary."""
    if request.samples < 1:
        raise UserError(f"--samples must be at least 1 (got {request.samples})")
    problems = load_dataset(request.dataset, request.problem_field, request.answer_field)
    settings = sampling_settings(recipe, tokenizer)
    start = time.monotonic()
    with RewardGrader(num_workers=request.grader_workers, timeout_s=request.grader_timeout_s) as grader:
        results = asyncio.run(_evaluate(request, problems, settings, tokenizer, grader))
    figures = summarize([{"correct": [s["correct"] for s in r["samples"]],
                          "answers": [s["answer"] for s in r["samples"]],
                          "tokens": [s["tokens"] for s in r["samples"]],
                          "truncated": [s["truncated"] for s in r["samples"]],
                          "timed_out": [s["timed_out"] for s in r["samples"]]} for r in results])
    summary = {**figures, "interruption_rate": sum(s["interrupted"] for r in results for s in r["samples"])
               / (len(results) * request.samples),
               "grader_timeouts_in": [r["key"] for r in results if any(s["timed_out"] for s in r["samples"])],
               "dataset": request.dataset, "model": request.model, "endpoint": request.endpoint,
               "sampling": {k: v for k, v in asdict(settings).items() if k != "policy"}
               | {"interruption": settings.policy is not None}, "seconds": time.monotonic() - start,
               **request.extra}
    request.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(request.out / PROBLEMS, "".join(json.dumps(r) + "\n" for r in results))
    atomic_write_text(request.out / SUMMARY, json.dumps(summary, indent=1) + "\n")
    return summary
