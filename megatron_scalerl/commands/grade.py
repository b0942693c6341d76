"""`scalerl grade`: grade completions with any registered verifier, to test data and verifiers before a run.

    scalerl grade --verifier code --problems problems.jsonl --completions completions.jsonl [--json]

Problems: JSONL rows with an `id` and the fields the verifier reads (`problem`; `answer` for math; `tests` for code,
see docs/code_verifier.md; a dotted field name reaches into nested objects: `--answer-field reward_model.ground_truth`),
read and checked as a run reads its data (a bad row is named by file and line). Completions: JSONL rows `{"id",
"completion"}`, any number per problem, matched by `id`. A completion is graded as a run grades it: the text after
its last `</think>` is the answer (`--no-thinking`: the whole text is, as for a source with `thinking: false`), read
in `--answer-format` for a verifier that compares with the gold answer. Prints a table
and a summary (pass rate, mean fraction of tests passed, failures by kind); `--json`: one JSON object per completion
and line, with `id`, `correct`, `fraction`, `timed_out`, `failure`, `error` and `seconds`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from pydantic import ValidationError

from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import DataSource
from megatron_scalerl.tasks.problems import Problem, RowReader, jsonl_records
from megatron_scalerl.tasks.rewards import Grade, RewardGrader
from megatron_scalerl.tasks.sandbox import SANDBOXES, chosen_sandbox, require_sandbox, sandbox_kind
from megatron_scalerl.tasks.verifiers import known_verifiers


def register(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("--verifier", required=True,
                        help=f"a registered verifier ({', '.join(known_verifiers())}) or package.module:function")
    parser.add_argument("--problems", required=True, type=Path, help="JSONL: one problem per line, with an `id`")
    parser.add_argument("--completions", required=True, type=Path, help='JSONL: {"id", "completion"} per line')
    parser.add_argument("--json", action="store_true", help="one JSON object per completion instead of a table")
    parser.add_argument("--no-thinking", action="store_true", help="the completions have no thinking: grade all")
    parser.add_argument("--answer-format", default="math_verify",
                        help="how the answer is read: math_verify (default), boxed, hash, last_number, regex:PATTERN")
    parser.add_argument("--id-field", default="id", help="the problems' id field (default: id)")
    parser.add_argument("--problem-field", default="problem", help="(a dotted name reaches into nested objects)")
    parser.add_argument("--answer-field", default="answer", help="(a dotted name reaches into nested objects)")
    parser.add_argument("--tests-field", default="tests", help="(a dotted name reaches into nested objects)")
    parser.add_argument("--workers", type=int, default=None, help="grader processes (default: cores, at most 8)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per completion (default: 10)")
    parser.add_argument("--sandbox", choices=SANDBOXES, default=None,
                        help="the code verifier's sandbox (default: $SCALERL_SANDBOX, else bwrap; rlimits is weaker)")
    parser.set_defaults(func=_grade)


def _field(record: object, name: str, where: str) -> object:
    if not isinstance(record, dict) or name not in record:
        raise UserError(f"{where}: no field '{name}'")
    return record[name]


def read_problems(args: argparse.Namespace) -> dict[str, Problem]:
    """The problems file's rows by id, read and checked like a run's data source."""
    if not args.problems.is_file():
        raise UserError(f"--problems: {args.problems} does not exist")
    try:
        source = DataSource(kind="jsonl", path=str(args.problems), verifier=args.verifier, domain="grade",
                            problem_field=args.problem_field, answer_field=args.answer_field,
                            tests_field=args.tests_field, thinking=not args.no_thinking,
                            answer_format=args.answer_format)
    except ValidationError as exc:
        raise UserError(f"--answer-format: {exc.errors()[0]['msg']}") from None
    reader, problems = RowReader(source, owner="--problems"), {}
    for where, _, record in jsonl_records(args.problems):
        key = str(_field(record, args.id_field, where))
        if key in problems:
            raise UserError(f"{where}: id {key!r} appears twice")
        problems[key] = reader.read(record, where, key)
    return problems


def read_completions(path: Path, problems: dict[str, Problem]) -> list[tuple[str, str]]:
    """(id, completion) of every row, in file order; an id with no problem is an error naming the line."""
    if not path.is_file():
        raise UserError(f"--completions: {path} does not exist")
    rows = []
    for where, _, record in jsonl_records(path):
        key, text = str(_field(record, "id", where)), _field(record, "completion", where)
        if key not in problems:
            raise UserError(f"{where}: id {key!r} is not in the problems file")
        if not isinstance(text, str):
            raise UserError(f"{where}: field 'completion' must be a string, got {type(text).__name__}")
        rows.append((key, text))
    return rows


def _grade(args: argparse.Namespace) -> int:
    problems = read_problems(args)
    completions = read_completions(args.completions, problems)
    args.sandbox = args.sandbox or chosen_sandbox()
    if args.verifier == "code":
        warning = require_sandbox(args.sandbox, "scalerl grade")
        if warning:
            print(warning, file=sys.stderr, flush=True)
    with RewardGrader(num_workers=args.workers, timeout_s=args.timeout, code_sandbox=args.sandbox) as grader:
        grades = grader.grade_many([(text, problems[key]) for key, text in completions])
    if args.json:
        for (key, _), grade in zip(completions, grades, strict=True):
            print(json.dumps({"id": key, "correct": grade.correct, "fraction": grade.fraction,
                              "timed_out": grade.timed_out, "failure": grade.failure, "error": grade.error,
                              "seconds": round(grade.seconds, 3)}))
        return 0
    print(table(completions, grades))
    print(summary(grades, len(problems), len({key for key, _ in completions}), args.verifier, args.sandbox))
    return 0


def table(completions: list[tuple[str, str]], grades: list[Grade]) -> str:
    width = max([2, *(len(key) for key, _ in completions)])
    lines = [f"{'id':<{width}}  correct  fraction  failure"]
    lines += [f"{key:<{width}}  {'yes' if g.correct else 'no':<7}  {g.fraction:8.2f}  {g.failure or ''}"
              for (key, _), g in zip(completions, grades, strict=True)]
    return "\n".join(lines)


def summary(grades: list[Grade], problems: int, answered: int, verifier: str, sandbox: str = "bwrap") -> str:
    """Pass rate, mean fraction and failures by kind of `grades`; the sandbox, for the code verifier."""
    n = max(len(grades), 1)
    failures = Counter(g.failure for g in grades if g.failure is not None)
    lines = [f"graded {len(grades)} completions of {answered} of {problems} problems with verifier {verifier!r}",
             f"pass rate {sum(g.correct for g in grades) / n:.3f}, mean fraction of tests passed "
             f"{sum(g.fraction for g in grades) / n:.3f}",
             "failures: " + (", ".join(f"{kind} {count}" for kind, count in failures.most_common()) or "none")]
    if verifier == "code":
        lines.append(f"sandbox: {sandbox_kind(sandbox)}")
    return "\n".join(lines)
