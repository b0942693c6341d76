"""Multi-turn samples: an environment that answers the model while it writes, token for token.

A `data.train` source with `environment:` has multi-turn samples (docs/tasks.md, "Tools and environments"):

    environment = load_environment("python_tool", EnvironmentContext(tokenizer, grader.run_python), "data.train[0]")
    messages = environment.prompt(conversation(problem))   # it may add to the prompt the source renders
    episode = environment.start(problem)                   # one per sample
    answer = await next_step(episode, completion_ids, where)   # at each stop: Observation | EndEpisode | None

The interface a user implements (a subclass of `Environment`, named `package.module:Class` on the source):

- `__init__(context)`: once per run, with the run's tokenizer and `run_python` (a program run in the run's code
  sandbox, `data.code_sandbox`, on a reward worker that holds no secret).
- `stop_sequences`: token-id sequences that end a model turn. The generators stop at each one's last token (vLLM's
  `stop_token_ids`: the fleet generates token ids and never detokenizes, and a stop string could end inside a token);
  the episode is asked only when the reply ends with a whole sequence.
- `prompt(messages)`: the chat messages the source renders (its template's instruction, its system prompt, its
  thinking switch); it may add to them (the tool's note). Default: as they are.
- `start(problem)`: an `Episode` for one sample.
- `Episode.step(completion_ids)`: the sample's completion so far (the model's tokens and every observation before,
  in order); returns an `Observation` (token ids inserted into the sample: in the context, out of the loss, no
  log-prob, no policy version), `EndEpisode` (the sample ends: scored by the environment, `score` in [0, 1] read as
  a verl-form score, or by the source's verifier on the final answer, `score` None), or None (not a call: the model
  writes on). Sync (run on a thread) or async; no answer within `STEP_TIMEOUT_S` fails the run naming the
  environment.

The sample's budgets (orchestrator/generation.py): observations count toward `rollout.max_new_tokens`, the model's
own tokens alone toward the thinking budget and the answer budget; after the source's `max_tool_calls` observations
the generators stop only at the model's end tokens.

`python_tool` (`PythonTool`): a fenced ```python block the model closes, inside its thinking (a source with thinking;
after `</think>` is the answer, never run) or anywhere in its reply (`thinking: false`), runs in the sandbox: a fresh
one per call (nothing carries over between calls: no variables, no files), within `TOOL_LIMITS`. Its output, stdout
then stderr, at most `OUTPUT_CHARS` characters (the rest cut, with a note), comes back as an ```output block. A
timeout, an error or a limit is an observation saying so (`Observation.failure` names it for the metrics).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_scalerl.errors import UserError
from megatron_scalerl.tasks.problems import Problem
from megatron_scalerl.tasks.prompts import THINK_CLOSE
from megatron_scalerl.tasks.sandbox import Limits, RunResult

STEP_TIMEOUT_S = 120.0  # an episode's answer to one stop, at most (seconds)
OUTPUT_CHARS = 1000  # python_tool: characters of a call's output inserted, at most
TOOL_LIMITS = Limits(cpu_s=2, wall_s=4.0, memory_mb=512, processes=32, output_bytes=64 * 1024, file_mb=16)
TOOL_NOTE = "You can run Python: write a ```python block and its output follows in an ```output block."
OPEN_FENCE, CLOSE_FENCE = "```python", "```"


@dataclass(frozen=True)
class Observation:
    """Tokens inserted into the sample after a stop. `failure`: the tool call's kind of failure ("timeout", or
    another of tasks/sandbox.FAILURE_KINDS), None when it ran to its end; only the metrics read it."""

    token_ids: tuple[int, ...]
    failure: str | None = None


@dataclass(frozen=True)
class EndEpisode:
    """The sample ends here. `score` in [0, 1]: its reward as a verl-form score; None: the source's verifier grades
    the final answer."""

    score: float | None = None


StepAnswer = Observation | EndEpisode | None


@dataclass(frozen=True)
class EnvironmentContext:
    """What an environment gets from the run: its tokenizer, and `run_python(program, limits)`, an awaitable
    tasks/sandbox.RunResult of the program run once in the run's code sandbox."""

    tokenizer: Any
    run_python: Callable[[str, Limits], Awaitable[RunResult]]


class Episode:
    """One sample's conversation with its environment (see the module docstring)."""

    def step(self, completion_ids: list[int]) -> StepAnswer | Awaitable[StepAnswer]:
        raise NotImplementedError


class Environment:
    """Subclass it and name it on a source, `environment: package.module:Class` (see the module docstring)."""

    stop_sequences: Sequence[Sequence[int]] = ()

    def __init__(self, context: EnvironmentContext):
        self.context = context

    def prompt(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        return messages

    def start(self, problem: Problem) -> Episode:
        raise NotImplementedError


def load_environment(name: str, context: EnvironmentContext, where: str) -> Environment:
    """The environment `name` (python_tool, or package.module:Class) built for this run; UserError naming `where`
    (the source) when it cannot be imported or built, or is not what the interface needs."""
    label = f"{where}: environment {name!r}"
    if name == "python_tool":
        cls: Any = PythonTool
    else:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise UserError(f"{label}: cannot import it ({type(exc).__name__}: {exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UserError(f"{label} is not a subclass of megatron_scalerl.tasks.environments.Environment")
    if cls.start is Environment.start:
        raise UserError(f"{label} has no start(problem): it must return an Episode per sample")
    try:
        environment = cls(context)
    except Exception as exc:  # noqa: BLE001 - a user's class: any failure to build it is the recipe's to fix
        raise UserError(f"{label}: building it failed: {type(exc).__name__}: {exc}") from None
    vocabulary = len(context.tokenizer)
    stops = [tuple(s) for s in environment.stop_sequences]
    bad = [s for s in stops if not s or not all(isinstance(t, int) and 0 <= t < vocabulary for t in s)]
    if not stops or bad:
        raise UserError(f"{label}: stop_sequences must be non-empty token-id sequences of the tokenizer's "
                        f"vocabulary (0..{vocabulary - 1}); got {bad[0] if bad else 'none'}")
    return environment


def ends_with_stop(completion_ids: Sequence[int], stop_sequences: Sequence[Sequence[int]]) -> bool:
    """Whether the completion ends with one of the stop sequences, whole."""
    return any(len(s) <= len(completion_ids) and list(completion_ids[len(completion_ids) - len(s):]) == list(s)
               for s in stop_sequences)


async def next_step(episode: Episode, completion_ids: list[int], where: str) -> StepAnswer:
    """The episode's answer to the completion so far (a sync `step` runs on a thread), within STEP_TIMEOUT_S;
    UserError naming `where` when it is late or not an answer the interface allows."""
    try:
        if inspect.iscoroutinefunction(episode.step):
            answer = await asyncio.wait_for(episode.step(list(completion_ids)), STEP_TIMEOUT_S)
        else:
            answer = await asyncio.wait_for(asyncio.to_thread(episode.step, list(completion_ids)), STEP_TIMEOUT_S)
    except TimeoutError:
        raise UserError(f"{where}: the episode's step did not answer within {STEP_TIMEOUT_S:g} s") from None
    if answer is None or isinstance(answer, EndEpisode) and (answer.score is None or 0.0 <= answer.score <= 1.0):
        return answer
    if isinstance(answer, Observation) and all(isinstance(t, int) for t in answer.token_ids):
        return answer
    raise UserError(f"{where}: step returned {answer!r}: an Observation of token ids, EndEpisode(score in [0, 1] "
                    "or None) or None")


class PythonTool(Environment):
    """The built-in tool: runs the ```python blocks the model closes (see the module docstring)."""

    def __init__(self, context: EnvironmentContext):
        super().__init__(context)
        tokenizer = context.tokenizer
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        # a closing fence's last token ends with a backtick (possibly before whitespace of its own), whatever the
        # tokenizer merges it with: each such token is a stop; the episode reads the text to see a block closed
        self.stop_sequences = tuple((i,) for i, text in enumerate(texts) if text.rstrip().endswith("`"))

    def prompt(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        return with_tool_note(messages)

    def start(self, problem: Problem) -> Episode:
        return PythonEpisode(self.context, thinking=problem.thinking)


def with_tool_note(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """`messages` with TOOL_NOTE after the last one's text (python_tool's prompt)."""
    messages = [dict(m) for m in messages]
    messages[-1]["content"] = f"{messages[-1]['content'].rstrip()}\n\n{TOOL_NOTE}"
    return messages


def closed_block(text: str) -> str | None:
    """The program of the ```python block that `text` ends by closing, or None."""
    body = text.rstrip()
    if not body.endswith(CLOSE_FENCE):
        return None
    start = body.rfind(OPEN_FENCE)
    if start < 0:
        return None
    head, newline, program = body[start + len(OPEN_FENCE):-len(CLOSE_FENCE)].partition("\n")
    if not newline or head.strip() or CLOSE_FENCE in program:
        return None
    return program


def tool_output(result: RunResult, limits: Limits = TOOL_LIMITS) -> str:
    """What a call's run shows the model: its output (stdout, then stderr) cut to OUTPUT_CHARS, then what stopped
    it, if anything did."""
    stopped = {"timeout": f"timed out after {limits.wall_s:g} s",
               "memory": f"stopped: out of memory ({limits.memory_mb} MiB)",
               "processes": f"stopped: too many processes ({limits.processes})",
               "filesystem": f"stopped: file limit ({limits.file_mb} MiB)",
               "output_limit": "stopped: too much output",
               "sandbox_error": "the sandbox could not run the program"}.get(result.failure or "")
    text = (result.stdout + result.stderr).rstrip("\n")
    if len(text) > OUTPUT_CHARS:
        text = f"{text[:OUTPUT_CHARS]}\n[output cut at {OUTPUT_CHARS} characters]"
    if stopped:
        text = f"{text}\n[{stopped}]" if text.strip() else f"[{stopped}]"
    return text


def observation_text(reply: str, output: str) -> str:
    """The observation after `reply` (which ends by closing a block): `output` in an ```output block, on a line of
    its own."""
    opening = "```output\n" if reply.endswith("\n") else "\n```output\n"
    return f"{opening}{output}\n```\n"


class PythonEpisode(Episode):
    """One sample's calls of the Python tool: each closed block run in a fresh sandbox."""

    def __init__(self, context: EnvironmentContext, *, thinking: bool):
        self.context, self.thinking = context, thinking
        self.seen = 0  # completion tokens up to the end of the last observation: a block opens after them

    async def step(self, completion_ids: list[int]) -> StepAnswer:
        decode = self.context.tokenizer.decode
        if self.thinking and THINK_CLOSE in decode(completion_ids, skip_special_tokens=False):
            return None  # the answer: never run
        text = decode(completion_ids[self.seen:], skip_special_tokens=False)
        program = closed_block(text)
        if program is None:
            return None
        result = await self.context.run_python(program, TOOL_LIMITS)
        ids = tuple(self.context.tokenizer.encode(observation_text(text, tool_output(result)),
                                                  add_special_tokens=False))
        self.seen = len(completion_ids) + len(ids)
        return Observation(ids, failure=result.failure)
