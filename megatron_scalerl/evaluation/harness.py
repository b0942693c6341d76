"""One evaluation: K samples of every problem of a benchmark from an OpenAI-compatible endpoint, graded, summarised.

    benchmark = load_benchmark("aime24", recipe.eval.benchmarks)   # or a recipe's local benchmark, or a JSONL file
    summary = evaluate(EvalRequest(endpoint, model, samples=16, out=Path("eval/out")), benchmark, recipe, tokenizer)

Benchmarks (`load_benchmark`): the shipped AIME sets by name (`eval/data/aime24.jsonl`, `aime25`), a local benchmark
of the recipe's `eval.benchmarks` (`recipe.LocalBenchmark`: a JSONL file with its verifier and template) by its entry
or its name, or any JSONL file by path (named by its stem). Rows are read and checked as a `data.train` jsonl source
is (`tasks.problems.load_source`): a bad row is an error naming its file and line.

Prompts are rendered as training renders them, in the benchmark's own format (`tasks.prompts.render_prompt`: the
problem, its template's instruction (a boxed answer, or a Python program in a fenced block) or its own, an opened
thinking block unless it sets `thinking: false`, through the tokenizer's chat template when it has one); sampling and length control are the recipe's (`rollout.temperature`,
`top_p`, `max_new_tokens`, the forced interruption: `evaluation/sampling.py`). Grading: the answer part (after the
last `</think>`; the whole reply without thinking) by the problem's own verifier in worker processes (`tasks.rewards.RewardGrader`: "math" with
math-verify against the gold answer, "code" running the row's tests in a sandbox), `grader_timeout_s` seconds per
answer; an answer that runs out of time counts as wrong and is listed in the summary. A code sample is correct when
all its tests pass, so pass@k of a code benchmark is pass@k over tests.

Writes into `out/`: `problems.jsonl` (one line per problem: its samples' text, answer (the last `\\boxed{}`, or for the
code template the final code block), verdict, share of tests passed, kind of failure, tokens, truncation,
interruption, grader time-out) and then `summary.json` (`evaluation.pass_at_k.summarize`: `mean_at_k`, `pass_at_k`
keyed by k, `cons_at_k`, lengths, truncation; `tests_passed_mean`: the mean share of a sample's tests passed (1 or 0
per sample without tests); `failures`: samples per kind of failure (`Grade.failure`); plus what was evaluated and
how). Both are written atomically, the summary last: a directory with a summary.json holds a finished evaluation.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_scalerl.algo.length_control import InterruptionPolicy
from megatron_scalerl.errors import UserError
from megatron_scalerl.evaluation.pass_at_k import summarize
from megatron_scalerl.evaluation.sampling import CompletionClient, SamplingSettings, sample_completion
from megatron_scalerl.fileio import atomic_write_text
from megatron_scalerl.recipe import SHIPPED_BENCHMARKS, DataSource, LocalBenchmark, Recipe
from megatron_scalerl.tasks.answers import extract_answer, extract_boxed
from megatron_scalerl.tasks.code_verifier import final_code_block
from megatron_scalerl.tasks.problems import Problem, load_source
from megatron_scalerl.tasks.prompts import render_prompt
from megatron_scalerl.tasks.rewards import RewardGrader, answer_part
from megatron_scalerl.tasks.sandbox import require_sandbox

EVAL_DATA = Path(__file__).resolve().parents[2] / "eval" / "data"
DATASETS = {name: EVAL_DATA / f"{name}.jsonl" for name in SHIPPED_BENCHMARKS}
SUMMARY, PROBLEMS = "summary.json", "problems.jsonl"


@dataclass
class EvalRequest:
    endpoint: str  # base URL of an OpenAI-compatible server
    model: str  # the served model's name
    samples: int  # K per problem
    out: Path
    api_key: str | None = None
    concurrency: int = 32  # requests in flight
    grader_timeout_s: float = 10.0
    grader_workers: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in summary.json (e.g. the checkpoint step)


@dataclass(frozen=True)
class Benchmark:
    """A benchmark read and checked, ready to evaluate. `name` labels its output directory and its metrics
    (`eval/<name>/...`); `source`: its rows' file, fields, verifier and template."""

    name: str
    source: DataSource
    problems: list[Problem]


def load_benchmark(spec: str | LocalBenchmark, entries: Sequence[str | LocalBenchmark] = (),
                   verifier: str | None = None) -> Benchmark:
    """The benchmark `spec` names: a local benchmark (an entry of a recipe's `eval.benchmarks`, or the name of a
    local one among `entries`), a shipped one by name (aime24, aime25), or a JSONL file with problem/answer rows.
    `verifier`, when given, grades it instead of its own (math for a shipped one or a file; the template follows
    it where the benchmark names none). UserError for a name that is none of these, an unknown verifier, or a bad
    row (named by its file and line)."""
    if isinstance(spec, str):
        spec = next((e for e in entries if isinstance(e, LocalBenchmark) and e.name == spec), spec)
    if isinstance(spec, LocalBenchmark):
        name, source = spec.name, spec.source()
    else:
        path = DATASETS.get(spec, Path(spec))
        if not path.is_file():
            local = ", ".join(e.name for e in entries if isinstance(e, LocalBenchmark)) or "none"
            raise UserError(f"dataset {spec!r}: neither a shipped dataset ({', '.join(DATASETS)}), a local benchmark "
                            f"of the recipe's eval.benchmarks ({local}), nor a JSONL file")
        name = spec if spec in DATASETS else path.stem
        source = DataSource(kind="jsonl", path=str(path), domain="eval")  # evaluation feeds no validation curve
    if verifier is not None:
        source = source.model_copy(update={"verifier": verifier})
    return Benchmark(name, source, load_source(source, seed=0, owner=f"eval benchmark {name!r}"))


def sampling_settings(recipe: Recipe, tokenizer: Any) -> SamplingSettings:
    """The recipe's sampling and length control (the interruption phrase tokenised by `tokenizer`)."""
    control = recipe.algorithm.length_control
    return SamplingSettings(temperature=recipe.rollout.temperature, top_p=recipe.rollout.top_p,
                            max_new_tokens=recipe.rollout.max_new_tokens,
                            policy=InterruptionPolicy.from_recipe(recipe, tokenizer) if tokenizer is not None else None,
                            interruption_phrase=control.interruption_phrase if control.mode == "interruption" else "")


def shown_answer(completion: str, problem: Problem) -> str | None:
    """What a sample answered, for its record and the majority vote: of its answer part, the final code block for
    the code template, else the answer its source's `answer_format` reads (the last `\\boxed{}` for math_verify);
    None when it has none. Grading never reads this."""
    answer = answer_part(completion, problem.thinking)
    if problem.template == "code":
        return final_code_block(answer)
    return extract_boxed(answer) if problem.answer_format == "math_verify" else extract_answer(answer,
                                                                                            problem.answer_format)


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


async def _evaluate(request: EvalRequest, benchmark: Benchmark, settings: SamplingSettings, tokenizer: Any,
                    grader: RewardGrader) -> list[dict]:
    problems = benchmark.problems
    progress = _Progress(len(problems) * request.samples, f"{benchmark.name} @ {request.model}")

    async def one(client: CompletionClient, problem: Problem, prompt: str, i: int) -> dict:
        done = await sample_completion(client, prompt, f"{problem.key}#{i}", settings)
        grade = await grader.grade(done.text, problem)  # the problem's own verifier
        progress.step()
        return {"text": done.text, "answer": shown_answer(done.text, problem), "correct": grade.correct,
                "tests_passed": grade.fraction, "failure": grade.failure, "tokens": done.tokens,
                "truncated": done.truncated, "interrupted": done.interrupted, "timed_out": grade.timed_out,
                "grader_error": grade.error}

    async with CompletionClient(request.endpoint, request.model, api_key=request.api_key,
                                concurrency=request.concurrency) as client:
        prompts = [render_prompt(p, tokenizer) for p in problems]
        samples = await asyncio.gather(*(one(client, p, prompt, i) for p, prompt in zip(problems, prompts, strict=True)
                                         for i in range(request.samples)))
    k = request.samples
    return [{"key": p.key, "problem": p.problem, "gold": p.answer, "samples": samples[j * k:(j + 1) * k]}
            for j, p in enumerate(problems)]


def evaluate(request: EvalRequest, benchmark: Benchmark, recipe: Recipe, tokenizer: Any) -> dict:
    """Evaluate `benchmark`, write problems.jsonl and summary.json into `request.out`, return the summary."""
    if request.samples < 1:
        raise UserError(f"--samples must be at least 1 (got {request.samples})")
    settings = sampling_settings(recipe, tokenizer)
    start = time.monotonic()
    if benchmark.source.verifier == "code":
        warning = require_sandbox(recipe.data.code_sandbox, f"the evaluation of {benchmark.name}")
        if warning:
            print(warning, flush=True)
    with RewardGrader(num_workers=request.grader_workers, timeout_s=request.grader_timeout_s,
                      code_sandbox=recipe.data.code_sandbox) as grader:
        results = asyncio.run(_evaluate(request, benchmark, settings, tokenizer, grader))
    samples = [s for r in results for s in r["samples"]]
    figures = summarize([{"correct": [s["correct"] for s in r["samples"]],
                          "answers": [s["answer"] for s in r["samples"]],
                          "tokens": [s["tokens"] for s in r["samples"]],
                          "truncated": [s["truncated"] for s in r["samples"]],
                          "timed_out": [s["timed_out"] for s in r["samples"]]} for r in results])
    source = benchmark.source
    summary = {**figures, "interruption_rate": sum(s["interrupted"] for s in samples) / len(samples),
               "tests_passed_mean": sum(s["tests_passed"] for s in samples) / len(samples),
               "failures": dict(sorted(Counter(s["failure"] for s in samples if s["failure"]).items())),
               "grader_timeouts_in": [r["key"] for r in results if any(s["timed_out"] for s in r["samples"])],
               "dataset": benchmark.name, "path": source.path, "verifier": source.verifier,
               "template": source.template_name, "model": request.model, "endpoint": request.endpoint,
               "sampling": {k: v for k, v in asdict(settings).items() if k != "policy"}
               | {"interruption": settings.policy is not None}, "seconds": time.monotonic() - start,
               **request.extra}
    request.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(request.out / PROBLEMS, "".join(json.dumps(r) + "\n" for r in results))
    atomic_write_text(request.out / SUMMARY, json.dumps(summary, indent=1) + "\n")
    return summary
