"""Problems: the rows of a recipe's prompt sources (JSONL, parquet, reasoning-gym, our synthetic tasks), read into
`Problem`s that carry what grading them needs.

    sources = load_sources(recipe.data.train, seed=recipe.data_seed)   # [Source]: its config and its problems

A problem's `key` names its source and row ("data/train.jsonl#12": line 12; "reasoning_gym/basic_arithmetic#7"), so
it is the same in every run over the same data: No-Positive-Resampling and the validation split use it. A row is
checked as it is read, against what its source's verifier needs (a gold answer, or tests the verifier can run); a
bad row is an error naming its file and line.

Fields are found as users' data has them: a column by its name, else a dotted name through nested objects
(`reward_model.ground_truth`); a problem column holding chat messages (`[{"role": "user", "content": ...}]`) is the
conversation as given (`Problem.messages`). A row's `data_source` and `extra_info` are kept for rewards written in
verl's form (tasks/verifiers.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import DataSource
from megatron_scalerl.tasks import synthetic
from megatron_scalerl.tasks.verifiers import (
    VerifierError,
    import_verifier,
    reads_gold_answer,
    resolve_verifier,
    takes_problem_row,
)


@dataclass(frozen=True)
class Problem:
    key: str  # "<source>#<row>", stable across runs
    problem: str
    answer: str  # the gold answer, as text ("" for a problem graded by its tests)
    tests: Mapping[str, Any] | None = field(default=None, hash=False)  # the code verifier's tests (see its docs)
    domain: str = "math"  # the source's domain: names its validation curve
    verifier: str = "math"  # the source's verifier (a registered name or "package.module:function")
    template: str = "math"  # the source's prompt template (prompts.render_prompt)
    thinking: bool = True  # the prompt opens a thinking block; the answer is what follows its end
    system_prompt: str | None = None  # the source's system message
    instruction: str | None = None  # the text after the problem, instead of the template's ("": none)
    answer_format: str = "math_verify"  # how a gold-comparing verifier reads the answer (tasks/answers.py)
    messages: tuple[Mapping[str, str], ...] | None = field(default=None, hash=False)  # a conversation, as given
    data_source: str = "math"  # the row's `data_source`, else the source's domain (verl-form rewards get it)
    extra_info: Mapping[str, Any] = field(default_factory=dict, hash=False)  # the row's `extra_info` (verl form)
    environment: str | None = None  # the source's environment (tasks/environments.py); None: one reply per sample
    max_tool_calls: int = 0  # observations the environment may insert per sample

    def row(self) -> dict[str, Any]:
        """What a verifier receives besides the answer (tasks/verifiers.py)."""
        return {"key": self.key, "problem": self.problem, "answer": self.answer, "tests": self.tests,
                "answer_format": self.answer_format, "data_source": self.data_source,
                "extra_info": dict(self.extra_info)}


@dataclass(frozen=True)
class Source:
    """One `data.train` entry and its problems, in file order."""

    config: DataSource
    problems: list[Problem]


MISSING = object()
ROLES = ("system", "user", "assistant")


def field_value(record: Mapping[str, Any], name: str) -> Any:
    """The value of field `name` in `record`: the key itself, else a dotted path through nested objects
    ("reward_model.ground_truth"); MISSING when neither is there."""
    if name in record:
        return record[name]
    value: Any = record
    for part in name.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return MISSING
        value = value[part]
    return value


def _messages(value: list, where: str, field_name: str) -> tuple[dict[str, str], ...]:
    """A chat conversation given as the problem: messages with a role and a text content, the last the user's."""
    messages = []
    for i, message in enumerate(value):
        if not (isinstance(message, Mapping) and message.get("role") in ROLES
                and isinstance(message.get("content"), str)):
            raise UserError(f"{where}: field '{field_name}'[{i}] must be a chat message {{role: "
                            f"{'|'.join(ROLES)}, content: text}}, got {str(message)[:80]}")
        messages.append({"role": message["role"], "content": message["content"]})
    if not messages or messages[-1]["role"] != "user":
        raise UserError(f"{where}: field '{field_name}' is a chat conversation that does not end with a user message")
    return tuple(messages)


def _as_text(value: Any, where: str, field_name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise UserError(f"{where}: field '{field_name}' must be a string or a number, got "
                        f"{type(value).__name__ if value is not None else 'null'}")
    text = str(value).strip()
    if not text:
        raise UserError(f"{where}: field '{field_name}' is empty")
    return text


class RowReader:
    """Turns a source's rows (dicts) into Problems, checked against what the source's verifier needs. `owner` names
    the setting the source comes from in errors ("data.train", an eval benchmark, `--problems`)."""

    def __init__(self, source: DataSource, owner: str = "data.train"):
        self.source = source  # its fields, verifier, domain and template
        try:
            verifier = import_verifier(resolve_verifier(source.verifier))
        except VerifierError as exc:
            raise UserError(f"{owner} ({source.label}): {exc}") from None
        self.gold_needed = not takes_problem_row(verifier)
        self.check = getattr(verifier, "check_problem", None)
        if source.answer_format != "math_verify" and not reads_gold_answer(verifier):
            raise UserError(f"{owner} ({source.label}): answer_format {source.answer_format!r} is how a verifier "
                            f"comparing with the gold answer reads the reply; verifier {source.verifier!r} reads "
                            "the reply itself")

    def required(self) -> list[str]:
        """The fields every row must have."""
        return [self.source.problem_field] + ([self.source.answer_field] if self.gold_needed else [])

    def fields(self) -> list[str]:
        """The fields a row may use."""
        return list(dict.fromkeys([self.source.problem_field, self.source.answer_field, self.source.tests_field,
                                   "setup", "data_source", "extra_info"]))

    def read(self, record: Any, where: str, key: str) -> Problem:
        """The Problem in `record`; `where` names the row ("file:line") in errors."""
        source = self.source
        required = self.required()
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected an object with {' and '.join(map(repr, required))}, got "
                            f"{type(record).__name__}")
        for name in required:
            if field_value(record, name) is MISSING:
                raise UserError(f"{where}: no field '{name}' (fields: {', '.join(sorted(record)) or 'none'})")
        asked = field_value(record, source.problem_field)
        messages = _messages(asked, where, source.problem_field) if isinstance(asked, list) else None
        if messages is not None and source.system_prompt is not None and messages[0]["role"] == "system":
            raise UserError(f"{where}: the conversation has its own system message and the source sets "
                            "system_prompt: drop one")
        answer = field_value(record, source.answer_field)
        answer = None if answer is MISSING else answer
        extra = record.get("extra_info")
        problem = Problem(key=key, problem=messages[-1]["content"] if messages else
                          _as_text(asked, where, source.problem_field),
                          answer="" if answer is None and not self.gold_needed else
                          _as_text(answer, where, source.answer_field),
                          tests=self._tests(record, where), domain=source.domain_name, verifier=source.verifier,
                          template=source.template_name, thinking=source.thinking,
                          system_prompt=source.system_prompt, instruction=source.instruction,
                          answer_format=source.answer_format, messages=messages,
                          data_source=str(record.get("data_source") or source.domain_name),
                          extra_info=extra if isinstance(extra, dict) else {},
                          environment=source.environment,
                          max_tool_calls=source.max_tool_calls if source.environment else 0)
        if self.check is not None:
            try:
                self.check(problem.row())
            except ValueError as exc:
                raise UserError(f"{where}: {exc} (verifier {source.verifier!r})") from None
        return problem

    def _tests(self, record: dict, where: str) -> dict | None:
        """The row's tests: an object, or a JSON string of one (as some datasets ship them); a top-level `setup`
        is folded into them."""
        tests = field_value(record, self.source.tests_field)
        tests = None if tests is MISSING else tests
        if isinstance(tests, str):
            try:
                tests = json.loads(tests)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: field '{self.source.tests_field}' is a string but not JSON ({exc.msg})"
                                ) from None
        if tests is None:
            return None
        if not isinstance(tests, dict):
            raise UserError(f"{where}: field '{self.source.tests_field}' must be an object, got {type(tests).__name__}")
        if record.get("setup") is not None and "setup" not in tests:
            tests = {**tests, "setup": record["setup"]}
        return tests


def jsonl_records(path: Path) -> Iterator[tuple[str, int, Any]]:
    """(where, line number, parsed value) of every non-blank line of a JSONL file; `where` is "file:line"."""
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                yield where, line_number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None


def _read_jsonl(reader: RowReader, path: Path) -> list[Problem]:
    return [reader.read(record, where, f"{reader.source.path}#{line}") for where, line, record in jsonl_records(path)]


def _read_parquet(reader: RowReader, path: Path) -> list[Problem]:
    import pyarrow.parquet as pq  # deferred: pyarrow loads in ~0.5 s; only parquet sources need it

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise UserError(f"{path}: not a readable parquet file ({exc})") from None
    present = set(table.column_names)

    def column(name: str) -> str:  # the column holding field `name`: its own, else its dotted path's first part
        return name if name in present else name.split(".")[0]

    for name in reader.required():
        if column(name) not in present:
            raise UserError(f"{path}: no column '{name}' (columns: {', '.join(sorted(present))})")
    columns = list(dict.fromkeys(column(name) for name in reader.fields() if column(name) in present))
    rows = table.select(columns).to_pylist()
    return [reader.read(record, f"{path}: row {index}", f"{reader.source.path}#{index}")
            for index, record in enumerate(rows)]


def _generate_reasoning_gym(reader: RowReader, seed: int, owner: str) -> list[Problem]:
    import reasoning_gym  # deferred: reasoning-gym imports its every task (~1 s); only its sources need it

    source = reader.source
    try:
        dataset = reasoning_gym.create_dataset(source.task, size=source.size, seed=seed, **source.options)
    except Exception as exc:  # an unknown task or bad arguments: reasoning-gym raises ValueError or others
        raise UserError(f"{owner}: reasoning_gym task '{source.task}': {exc}") from None
    return [reader.read({source.problem_field: entry["question"], source.answer_field: entry["answer"]},
                        f"reasoning_gym/{source.task}[{i}]", f"reasoning_gym/{source.task}#{i}")
            for i, entry in enumerate(dataset)]


def _generate_synthetic(reader: RowReader, seed: int, owner: str) -> list[Problem]:
    source = reader.source
    try:
        rows = synthetic.generate(source.task, size=source.size, seed=seed)
    except ValueError as exc:
        raise UserError(f"{owner}: synthetic task '{source.task}': {exc}") from None
    return [reader.read({source.problem_field: row["problem"], source.answer_field: row.get("answer"),
                         source.tests_field: row.get("tests")}, f"synthetic/{source.task}[{i}]",
                        f"synthetic/{source.task}#{i}") for i, row in enumerate(rows)]


def load_source(source: DataSource, *, seed: int, owner: str = "data.train") -> list[Problem]:
    """The problems of one source, in file order (generated sources: with `seed`); errors name `owner`, the setting
    it comes from (a `data.train` entry, an eval benchmark)."""
    reader = RowReader(source, owner)
    if source.kind == "reasoning_gym":
        problems = _generate_reasoning_gym(reader, seed, owner)
    elif source.kind == "synthetic":
        problems = _generate_synthetic(reader, seed, owner)
    else:
        path = Path(source.path)
        if not path.is_file():
            raise UserError(f"{owner}: {source.kind} file {path} does not exist"
                            + (f" (relative to {Path.cwd()})" if not path.is_absolute() else ""))
        problems = _read_jsonl(reader, path) if source.kind == "jsonl" else _read_parquet(reader, path)
    if not problems:
        raise UserError(f"{owner}: {source.label} has no problems")
    return problems


def load_sources(sources: Sequence[DataSource], *, seed: int) -> list[Source]:
    """Every source with its problems; a key found twice (the same file listed twice) is an error."""
    loaded = [Source(source, load_source(source, seed=seed)) for source in sources]
    seen: set[str] = set()
    for source in loaded:
        for problem in source.problems:
            if problem.key in seen:
                raise UserError(f"data.train: problem {problem.key} appears twice (is a source listed twice?)")
            seen.add(problem.key)
    return loaded
