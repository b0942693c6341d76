"""The recipe's data and evaluation sections: the prompt sources (`DataSource`, `data.train`), how a source's or a
local benchmark's rows are read, asked and graded (`RowFormat`), the validation split (`DataConfig`) and the
downstream evaluation (`EvalConfig`, its `LocalBenchmark` entries). Part of the recipe's schema (schema.py holds
the rest); docs/tasks.md is their manual."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag, model_validator

from megatron_scalerl.section import NonNeg, Pos, PosFloat, Section

DOMAIN_NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # a domain names metrics (`val/<domain>/pass_rate`)
BUILTIN_ENVIRONMENTS = ("python_tool",)  # tasks/environments.py; any other environment is a class by path
ENVIRONMENT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


ANSWER_FORMATS = ("math_verify", "boxed", "hash", "last_number")  # and "regex:PATTERN" (tasks/answers.py)


def _answer_format(text: str) -> str:
    if text in ANSWER_FORMATS:
        return text
    if not text.startswith("regex:"):
        raise ValueError(f"{text!r} is not an answer format: {', '.join(ANSWER_FORMATS)} or regex:PATTERN")
    try:
        groups = re.compile(text.removeprefix("regex:")).groups
    except re.error as exc:
        raise ValueError(f"{text!r}: not a regular expression ({exc})") from None
    if groups < 1:
        raise ValueError(f"{text!r}: the pattern needs a group, (...): group 1 of its last match is the answer")
    return text


AnswerFormat = Annotated[str, AfterValidator(_answer_format)]


class RowFormat(Section):
    """How a prompt source's rows are read, asked and graded (shared by `data.train` entries and local evaluation
    benchmarks; tasks/problems.py reads rows, tasks/prompts.py renders them, tasks/rewards.py grades them).

    Fields name columns; a dotted name reaches into nested ones (`reward_model.ground_truth`) where no column has
    that exact name. A problem column holding chat messages (`[{role, content}, ...]`, as verl's parquet does) is
    the conversation as given. `thinking: false`: the prompt opens no thinking block, its instruction mentions none
    and the whole reply is graded (not under the forced interruption, which ends a thinking block). `instruction`:
    the text after the problem, instead of the one `template` picks ("" for none); `answer_format`: how a
    verifier that compares with the gold answer reads the reply's answer."""

    problem_field: str = Field(
        "problem", description="the column holding the problem text or chat messages (a dotted name: nested)")
    answer_field: str = Field("answer", description="the column holding the gold answer (a dotted name: nested)")
    tests_field: str = Field(
        "tests", description="the column holding the code verifier's tests (a dotted name: nested)")
    verifier: str = Field(
        "math", description="what grades its answers: math, code or package.module:function (tasks/verifiers.py)")
    template: Literal["math", "code"] | None = Field(
        None, description="the prompt's instruction: math or code; null: code for the code verifier, else math")
    thinking: bool = Field(
        True, description="the prompt opens a thinking block and the answer follows its end (false: whole reply)")
    system_prompt: str | None = Field(None, description="a system message before the problem (text); null: none")
    instruction: str | None = Field(
        None, description="the text after the problem instead of template's ('' for none); null: template's")
    answer_format: AnswerFormat = Field(
        "math_verify", description="how the answer is read: math_verify, boxed, hash (#### N), last_number, "
        "regex:PATTERN (group 1 of the last match)")

    @model_validator(mode="after")
    def _format(self) -> RowFormat:
        if self.template is not None and self.instruction is not None:
            raise ValueError("set `template` or `instruction`, not both (instruction replaces the text template "
                             "picks)")
        return self

    @property
    def template_name(self) -> str:
        return self.template or ("code" if self.verifier == "code" else "math")


class DataSource(RowFormat):
    """One prompt set. jsonl / parquet: a file (relative paths are read from the working directory) with one problem
    per row in `problem_field`, its gold answer in `answer_field` and, for the code verifier, its tests in
    `tests_field`; reasoning_gym: `size` problems of `task` generated offline with the recipe's seed and the task's
    config `options` (e.g. basic_arithmetic's max_terms); synthetic: `size` problems of one of our generated tasks
    (tasks/synthetic.py, e.g. code_functions), with tests.

    How its rows are read, asked and graded: `RowFormat`. `domain`: the name its validation curve and metrics go
    under (default: the verifier's name). `weight`: expected appearances of each of its prompts per epoch (2.0:
    twice; 0.5: a seeded half of them, a different half each epoch). `share`: its part of each batch's prompts,
    relative to the other sources' shares (set on every source or on none; without shares the sources' prompts are
    shuffled together by weight). `validation_holdout`: prompts held out of this source alone for validation
    (default: it takes part in the seeded draw of `data.validation_holdout` over the sources without their own).
    `environment`: multi-turn samples, the model's tool calls answered while it writes (`python_tool`, or a class of
    yours by path; tasks/environments.py), at most `max_tool_calls` per sample."""

    kind: Literal["jsonl", "parquet", "reasoning_gym", "synthetic"] = Field(
        description="jsonl or parquet file, reasoning_gym task, or one of our synthetic tasks (tasks/synthetic.py)")
    path: str | None = Field(None, description="jsonl / parquet: the file, relative to the working directory")
    task: str | None = Field(
        None, description="reasoning_gym / synthetic: the task's name (e.g. basic_arithmetic, code_functions)")
    size: Pos | None = Field(
        None, description="reasoning_gym / synthetic: problems generated offline with the recipe's seed (problems)")
    options: dict[str, int | float | str | bool] = Field(
        default_factory=dict, description="reasoning_gym: the task's config (e.g. max_terms)")
    weight: PosFloat = Field(
        1.0, description="expected appearances of each of its prompts per epoch (times; 0.5: a seeded half each epoch)")
    domain: str | None = Field(None, description="names its validation curve and metrics; null: the verifier's name")
    share: PosFloat | None = Field(
        None, description="its part of each batch's prompts relative to other sources' (ratio; set on all or none)")
    validation_holdout: NonNeg | None = Field(
        None, description="prompts held out of this source alone (prompts); null: in data.validation_holdout's draw")
    environment: str | None = Field(
        None, description="multi-turn: python_tool (runs the model's ```python blocks) or package.module:Class "
        "(tasks/environments.py); null: one reply per sample")
    max_tool_calls: NonNeg = Field(
        4, description="environment: observations inserted per sample at most (count); the model then writes on")

    @model_validator(mode="after")
    def _needs(self) -> DataSource:
        if self.kind in ("jsonl", "parquet") and not self.path:
            raise ValueError(f"kind {self.kind} needs `path`")
        if self.kind in ("reasoning_gym", "synthetic") and not (self.task and self.size):
            raise ValueError(f"kind {self.kind} needs `task` and `size`")
        if self.options and self.kind != "reasoning_gym":
            raise ValueError("`options` configure a reasoning_gym task; other sources have none")
        if self.domain is None and not DOMAIN_NAME.match(self.verifier):
            raise ValueError(f"verifier {self.verifier!r} is not a plain name: give the source a `domain` "
                             "(letters, digits, _ and -) to name its metrics")
        if self.domain is not None and not DOMAIN_NAME.match(self.domain):
            raise ValueError(f"domain {self.domain!r}: use letters, digits, _ and - (it names metrics)")
        if self.environment is not None and self.environment not in BUILTIN_ENVIRONMENTS and not ENVIRONMENT_PATH.match(
                self.environment):
            raise ValueError(f"environment {self.environment!r}: {' or '.join(BUILTIN_ENVIRONMENTS)}, or a class "
                             "as package.module:Class")
        if self.environment == "python_tool" and self.verifier == "code" and not self.thinking:
            raise ValueError("environment python_tool with verifier code and thinking: false would run the answer's "
                             "```python block as a tool call (a reply without thinking has its calls anywhere): "
                             "set thinking: true, so that the calls are the thinking's and the answer follows it")
        return self

    @property
    def domain_name(self) -> str:
        return self.domain or self.verifier

    @property
    def label(self) -> str:
        """How errors name the source: its file, or its generated task."""
        return self.path or f"{self.kind}/{self.task}"


class DataConfig(Section):
    train: Annotated[list[DataSource], Field(min_length=1)] = Field(
        description="the prompt sources (one or more; docs/tasks.md)")
    validation_holdout: NonNeg = Field(
        description="prompts held out of the sources without their own, for the validation curve (prompts)")
    validation_interval: Pos = Field(description="validate every N optimizer steps (steps; paper: 100)")
    validation_generations: Pos = Field(description="samples per validation prompt, mean@N (samples; paper: 16)")
    seed: int | None = Field(
        None, description="seed of the data (integer): the problems generated sources draw and the validation "
        "split; null: trainer.seed. A sweep gives all its runs the base's, so they validate on the same prompts")
    # tasks/sandbox.py: a run or evaluation with code sources refuses to start when bwrap does not work and this says
    # bwrap
    code_sandbox: Literal["bwrap", "rlimits"] = Field(
        "bwrap", description="what runs the code verifier's programs: bwrap, or the weaker rlimits only when named")

    @model_validator(mode="after")
    def _shares(self) -> DataConfig:
        shared = [s.share is not None for s in self.train]
        if any(shared) and not all(shared):
            missing = ", ".join(f"train[{i}]" for i, has in enumerate(shared) if not has)
            raise ValueError(f"`share` is set on some sources but not on {missing}: set it on every source or none")
        return self

    def domains(self) -> list[str]:
        """The domains of the training sources, in order of first appearance."""
        return list(dict.fromkeys(s.domain_name for s in self.train))


SHIPPED_BENCHMARKS = ("aime24", "aime25")  # evaluation datasets that come with the code (eval/data/<name>.jsonl)


class LocalBenchmark(RowFormat):
    """An evaluation benchmark read from a local JSONL file `path` (relative paths are read from the working
    directory), its rows read, asked and graded as a `data.train` jsonl source with the same `RowFormat` fields
    (DataSource's defaults): `{name: mycode, path: data/code_eval.jsonl, verifier: code}` is a code benchmark graded
    by running each row's tests. `name` labels its results and metrics (`eval/<name>/mean_at_k`) and names it on the
    command line (`--dataset mycode`)."""

    name: str = Field(
        description="labels its results, metrics (eval/<name>/mean_at_k) and names it on the command line")
    path: str = Field(description="the JSONL file, relative to the working directory")

    @model_validator(mode="after")
    def _check_name(self) -> LocalBenchmark:
        if not DOMAIN_NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: use letters, digits, _ and - (it names metrics)")
        if self.name in SHIPPED_BENCHMARKS:
            raise ValueError(f"name {self.name!r} is a shipped benchmark's: list it as `{self.name}`, or rename")
        return self

    def source(self) -> DataSource:
        """Its rows' source: a jsonl DataSource with its `RowFormat` fields (domain "eval": evaluation problems feed
        no validation curve)."""
        return DataSource(kind="jsonl", path=self.path, domain="eval",
                          **{name: getattr(self, name) for name in RowFormat.model_fields})


# an `eval.benchmarks` entry: a name is a shipped benchmark, a mapping a local one (so errors name only that form)
BenchmarkEntry = Annotated[
    Annotated[Literal[SHIPPED_BENCHMARKS], Tag("shipped")] | Annotated[LocalBenchmark, Tag("local")],
    Discriminator(lambda entry: "shipped" if isinstance(entry, str) else "local")]


def benchmark_name(benchmark: str | LocalBenchmark) -> str:
    """The name a benchmark entry goes by: a shipped one's name (or a JSONL file as given), a local one's `name`."""
    return benchmark.name if isinstance(benchmark, LocalBenchmark) else benchmark


class EvalConfig(Section):
    """The downstream evaluation of the run's checkpoints: its watcher's settings (`scalerl eval watch RUN` reads
    RUN/recipe.yaml; a command-line flag, then a SCALERL_EVAL_* variable, wins over each; evaluation/watch.py).
    `benchmarks`: shipped ones by name and local ones (`LocalBenchmark`), each at most once."""

    benchmarks: Annotated[list[BenchmarkEntry], Field(min_length=1)] = Field(
        description="evaluated: shipped ones by name (aime24, aime25) or local {name, path, ...} (--dataset)")
    interval_steps: Pos = Field(
        description="evaluate checkpoints whose step is a multiple of this, and the last (steps; --every)")
    samples_per_problem: Pos = Field(description="k of pass@k and mean@k (samples; --samples)")
    temperature: Annotated[float, Field(ge=0)] = Field(description="evaluation's sampling temperature (dimensionless)")
    max_new_tokens: Pos = Field(description="cap per evaluation sample (tokens); length control's budgets fit inside")

    @model_validator(mode="after")
    def _distinct(self) -> EvalConfig:
        names = [benchmark_name(b) for b in self.benchmarks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"benchmarks: {', '.join(map(repr, twice))} listed twice (a name labels its metrics)")
        return self
