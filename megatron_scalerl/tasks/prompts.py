"""Prompt data: problem sets (JSONL, parquet, reasoning-gym), the held-out validation split, the epoch sampler with
No-Positive-Resampling, and the prompt template shared by training and evaluation.

    sources = load_sources(recipe.data.train, seed=recipe.trainer.seed)          # [(problems, weight)] per source
    train, validation = split_validation(sources, recipe.data.validation_holdout, seed=recipe.trainer.seed)
    sampler = PromptSampler(train, seed=recipe.trainer.seed, resampling=npr)
    problem = sampler.next()                     # a Problem: key, problem text, gold answer
    text = render_prompt(problem.problem, tokenizer)

A problem's `key` names its source and row ("data/train.jsonl#12": line 12; "reasoning_gym/basic_arithmetic#7"),
so it is the same in every run over the same data: No-Positive-Resampling and the validation split use it.

Epochs: epoch e visits, in an order shuffled by (seed, e), every prompt of a source with weight w floor(w) times plus
a seeded fraction w - floor(w) of them; prompts retired by No-Positive-Resampling are skipped when drawn. The order
does not depend on which prompts are retired, so the sampler's state is just (epoch, position) and a resumed run
draws exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_scalerl.algo.resampling import NoPositiveResampling
from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import DataSource

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
INSTRUCTION = (f"Think step by step between {THINK_OPEN} and {THINK_CLOSE}, then give the final answer as "
               "\\boxed{...}.")


@dataclass(frozen=True)
class Problem:
    key: str  # "<source>#<row>", stable across runs
    problem: str
    answer: str  # the gold answer, as text


def render_prompt(problem: str, tokenizer: Any = None) -> str:
    """The text the generator continues: the problem and `INSTRUCTION` as the user's message (through the
    tokenizer's chat template when it has one, else "Problem: ...\\nSolution: "), then the opened thinking block.
    Everything the model writes up to `THINK_CLOSE` is thinking (`rewards.strip_thinking` drops it)."""
    message = f"{problem.strip()}\n\n{INSTRUCTION}"
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        head = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        head = f"Problem: {message}\nSolution: "
    return f"{head}{THINK_OPEN}\n"


def _as_text(value: Any, where: str, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise UserError(f"{where}: field '{field}' must be a string or a number, got "
                        f"{type(value).__name__ if value is not None else 'null'}")
    text = str(value).strip()
    if not text:
        raise UserError(f"{where}: field '{field}' is empty")
    return text


def _row(record: Any, where: str, fields: tuple[str, str], key: str) -> Problem:
    """The Problem in `record` (a row) whose problem and answer are under `fields`; `where` names the row."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected an object with '{fields[0]}' and '{fields[1]}', got {type(record).__name__}")
    for field in fields:
        if field not in record:
            raise UserError(f"{where}: no field '{field}' (fields: {', '.join(sorted(record)) or 'none'})")
    return Problem(key, *(_as_text(record[field], where, field) for field in fields))


def _read_jsonl(source: DataSource, path: Path) -> list[Problem]:
    problems = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            problems.append(_row(record, where, (source.problem_field, source.answer_field),
                                 f"{source.path}#{line_number}"))
    return problems


def _read_parquet(source: DataSource, path: Path) -> list[Problem]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise UserError(f"{path}: not a readable parquet file ({exc})") from None
    columns = set(table.column_names)
    for field in (source.problem_field, source.answer_field):
        if field not in columns:
            raise UserError(f"{path}: no column '{field}' (columns: {', '.join(sorted(columns))})")
    rows = table.select([source.problem_field, source.answer_field]).to_pylist()
    return [_row(record, f"{path}: row {index}", (source.problem_field, source.answer_field), f"{source.path}#{index}")
            for index, record in enumerate(rows)]


def _generate_reasoning_gym(source: DataSource, seed: int) -> list[Problem]:
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(source.task, size=source.size, seed=seed, **source.options)
    except Exception as exc:  # an unknown task or bad arguments: reasoning-gym raises ValueError or others
        raise UserError(f"data.train: reasoning_gym task '{source.task}': {exc}") from None
    return [_row(entry, f"reasoning_gym/{source.task}[{i}]", ("question", "answer"), f"reasoning_gym/{source.task}#{i}")
            for i, entry in enumerate(dataset)]


def load_source(source: DataSource, *, seed: int) -> list[Problem]:
    """The problems of one `data.train` entry, in file order (reasoning_gym: generated with `seed`)."""
    if source.kind == "reasoning_gym":
        problems = _generate_reasoning_gym(source, seed)
    else:
        path = Path(source.path)
        if not path.is_file():
            raise UserError(f"data.train: {source.kind} file {path} does not exist"
                            + (f" (relative to {Path.cwd()})" if not path.is_absolute() else ""))
        problems = _read_jsonl(source, path) if source.kind == "jsonl" else _read_parquet(source, path)
    if not problems:
        raise UserError(f"data.train: {source.path or source.task} has no problems")
    return problems


def load_sources(sources: Sequence[DataSource], *, seed: int) -> list[tuple[list[Problem], float]]:
    """(problems, weight) of every source; a key found twice (the same file listed twice) is an error."""
    loaded = [(load_source(source, seed=seed), source.weight) for source in sources]
    seen: set[str] = set()
    for problems, _ in loaded:
        for problem in problems:
            if problem.key in seen:
                raise UserError(f"data.train: problem {problem.key} appears twice (is a source listed twice?)")
            seen.add(problem.key)
    return loaded


def split_validation(sources: list[tuple[list[Problem], float]], holdout: int, *, seed: int
                     ) -> tuple[list[tuple[list[Problem], float]], list[Problem]]:
    """Hold `holdout` problems out of training for the i.i.d. validation curve: a seeded draw over all sources.
    Returns the sources without them, and the held-out problems in a seeded order."""
    every = [problem for problems, _ in sources for problem in problems]
    if holdout >= len(every):
        raise UserError(f"data.validation_holdout: {holdout} held-out prompts leave none of the {len(every)} "
                        "training prompts")
    validation = random.Random(f"validation/{seed}").sample(every, holdout)
    held = {problem.key for problem in validation}
    return [([p for p in problems if p.key not in held], weight) for problems, weight in sources], validation


def epoch_order(sources: list[tuple[list[Problem], float]], *, seed: int, epoch: int) -> list[Problem]:
    """The prompts of `epoch` in the order they are drawn (see the module docstring for weights)."""
    rng = random.Random(f"epoch/{seed}/{epoch}")
    order: list[Problem] = []
    for problems, weight in sources:
        copies = math.floor(weight)
        order.extend(problems * copies)
        order.extend(rng.sample(problems, round((weight - copies) * len(problems))))
    rng.shuffle(order)
    return order


class PromptSampler:
    """Draws training prompts epoch after epoch, skipping those No-Positive-Resampling retired."""

    def __init__(self, sources: list[tuple[list[Problem], float]], *, seed: int, resampling: NoPositiveResampling):
        self.sources = sources
        self.seed = seed
        self.resampling = resampling
        self.keys = {problem.key for problems, _ in sources for problem in problems}
        self.epoch = 0
        self.position = 0  # prompts of the epoch's order drawn (retired ones included)
        self._order = epoch_order(sources, seed=seed, epoch=0)

    def next(self) -> Problem:
        """The next prompt not retired; a new epoch starts when this one is used up."""
        while True:
            if self.position >= len(self._order):
                if self.keys <= self.resampling.retired:
                    raise UserError(f"every one of the {len(self.keys)} training prompts is retired by "
                                    "No-Positive-Resampling: nothing is left to train on")
                self.epoch, self.position = self.epoch + 1, 0
                self._order = epoch_order(self.sources, seed=self.seed, epoch=self.epoch)
                continue
            problem = self._order[self.position]
            self.position += 1
            if problem.key not in self.resampling.retired:
                return problem

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict` (the retirements come from the resampling state, saved beside it)."""
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"prompt sampler state: malformed ({type(exc).__name__}: {exc})") from None
        order = epoch_order(self.sources, seed=self.seed, epoch=epoch)
        if not 0 <= position <= len(order):
            raise UserError(f"prompt sampler state: position {position} is outside epoch {epoch}'s {len(order)} "
                            "prompts (did the data change?)")
        self.epoch, self.position, self._order = epoch, position, order
