"""Prompts: the template shared by training and evaluation, the held-out validation split, and the epoch sampler with
No-Positive-Resampling and task mixtures.

    sources = load_sources(recipe.data.train, seed=recipe.data_seed)          # problems.Source per data.train entry
    train, validation = split_validation(sources, recipe.data.validation_holdout, seed=recipe.data_seed)
    sampler = PromptSampler(train, seed=recipe.trainer.seed, resampling=npr)  # the order: the run's own seed
    problem = sampler.next()                     # a Problem: key, problem text, gold answer or tests, domain
    text = render_prompt(problem, tokenizer)        # in the source's format: thinking or not, its instruction

Epochs: epoch e visits, in an order shuffled by (seed, e), every prompt of a source with weight w floor(w) times plus
a seeded fraction w - floor(w) of them; prompts retired by No-Positive-Resampling are skipped when drawn. The order
does not depend on which prompts are retired, so the sampler's state is just (epoch, position) and a resumed run
draws exactly what the uninterrupted one would have.

Mixtures: when the sources have a `share`, each source runs its own epochs (as above) and the draws alternate between
sources by share: the next draw goes to the source furthest below its share of all draws so far, so any run of draws
holds each source's share to within one prompt. A source whose prompts are all retired drops out of the mixture.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from megatron_scalerl.errors import UserError
from megatron_scalerl.tasks.problems import Problem, Source

if TYPE_CHECKING:  # the sampler reads only its `retired` set; importing `algo` would load torch into `scalerl grade`
    from megatron_scalerl.algo.resampling import NoPositiveResampling

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
INSTRUCTIONS = {  # by template (a source's `template`), for a prompt that opens a thinking block
    "math": f"Think step by step between {THINK_OPEN} and {THINK_CLOSE}, then give the final answer as \\boxed{{...}}.",
    "code": f"Think step by step between {THINK_OPEN} and {THINK_CLOSE}, then give your solution as one Python "
            "program in a ```python fenced code block.",
}
REPLY_INSTRUCTIONS = {  # by template, for a source with `thinking: false`: the reply is the answer
    "math": "Give the final answer as \\boxed{...}.",
    "code": "Give your solution as one Python program in a ```python fenced code block.",
}
# The plain format (`Problem: ...\nSolution: <think>\n`, what `render_prompt` writes without a chat template) as a
# chat template, for the tokenizers we train (the demo's): a user message renders exactly as `render_prompt` renders
# a prompt, so a chat client and the training see the same text. A system message comes first, its text and a blank
# line; an assistant message continues the thinking block (THINK_OPEN) its generation prompt opened and ends with
# EOS, as the completions trained on do; other roles are refused. `enable_thinking=false` (Qwen3's switch, which
# `render_prompt` sets for a source without thinking) opens no thinking block. No BOS: the tokenizer adds it when it
# encodes a prompt (vLLM's chat route adds it when asked: `add_special_tokens`).
PLAIN_CHAT_TEMPLATE = r"""
{%- set thinking = enable_thinking is not defined or enable_thinking -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {{- message['content'] + '\n\n' -}}
  {%- elif message['role'] == 'user' -%}
    {{- 'Problem: ' + message['content'] + '\nSolution: ' -}}
  {%- elif message['role'] == 'assistant' -%}
    {%- if thinking and not message['content'].startswith('<think>') -%}{{- '<think>\n' -}}{%- endif -%}
    {{- message['content'] + eos_token -}}
  {%- else -%}
    {{- raise_exception('the plain Problem/Solution chat template renders system, user and assistant messages, not '
                        + message['role']) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and thinking -%}{{- '<think>\n' -}}{%- endif -%}
"""


def conversation(problem: Problem) -> list[dict[str, str]]:
    """The chat messages that ask `problem`: the source's system prompt, then its conversation as given (a problem
    field of chat messages: the source's own `instruction`, if any, joins its last message) or the problem and its
    instruction (the source's `instruction`, else its template's, for thinking or for a plain reply)."""
    instruction = problem.instruction
    if problem.messages is not None:
        messages = [dict(m) for m in problem.messages]
    else:
        if instruction is None:
            instruction = (INSTRUCTIONS if problem.thinking else REPLY_INSTRUCTIONS)[problem.template]
        messages = [{"role": "user", "content": problem.problem.strip()}]
    if instruction:
        messages[-1]["content"] = f"{messages[-1]['content'].strip()}\n\n{instruction}"
    if problem.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": problem.system_prompt})
    return messages


def _plain_prompt(messages: list[dict[str, str]], key: str) -> str:
    """The plain format of a system message and a user message (a tokenizer without a chat template)."""
    *system, user = messages
    if [m["role"] for m in system] not in ([], ["system"]):
        raise UserError(f"prompt {key}: a conversation of {len(messages)} messages needs the tokenizer's chat "
                        "template, and this tokenizer has none")
    return "".join(f"{m['content']}\n\n" for m in system) + f"Problem: {user['content']}\nSolution: "


def render_prompt(problem: Problem, tokenizer: Any = None, messages: list[dict[str, str]] | None = None) -> str:
    """The text the generator continues: `messages` (default `conversation(problem)`; an environment adds to them)
    through the tokenizer's chat template when it has one (else the plain "Problem: ...\\nSolution: " format), with its generation prompt. A thinking problem's prompt
    then opens the thinking block (unless the chat template's generation prompt opens it, as `PLAIN_CHAT_TEMPLATE`
    and DeepSeek-R1's do): everything the model writes up to `THINK_CLOSE` is thinking (`rewards.strip_thinking`
    drops it). A problem without thinking opens none (the template's own switch, `enable_thinking`, set false); a
    chat template that opens one anyway is an error, since the whole reply would be graded as the answer."""
    messages = conversation(problem) if messages is None else messages
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        switch = {} if problem.thinking else {"enable_thinking": False}
        head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **switch)
    else:
        head = _plain_prompt(messages, problem.key)
    opened = head.rstrip().endswith(THINK_OPEN)
    if problem.thinking:
        return head if head.endswith(f"{THINK_OPEN}\n") else f"{head}{THINK_OPEN}\n"
    if opened:
        raise UserError(f"prompt {problem.key}: the tokenizer's chat template opens a thinking block even with "
                        "enable_thinking false, so a source with thinking: false cannot be asked through it")
    return head


def split_validation(sources: list[Source], holdout: int, *, seed: int) -> tuple[list[Source], list[Problem]]:
    """Hold problems out of training for the i.i.d. validation curve: a source's own `validation_holdout` from it
    alone, and `holdout` in one seeded draw over the sources without their own. Returns the sources without them,
    and the held-out problems (the shared draw first, then each source's own, each in a seeded order)."""
    pooled = [p for s in sources if s.config.validation_holdout is None for p in s.problems]
    draws = [("data.validation_holdout", pooled, holdout, f"validation/{seed}")] if pooled else []
    draws += [(f"data.train ({s.config.label}).validation_holdout", s.problems, s.config.validation_holdout,
               f"validation/{seed}/{s.config.label}") for s in sources if s.config.validation_holdout is not None]
    validation: list[Problem] = []
    for name, problems, count, rng_seed in draws:
        if count >= len(problems):
            raise UserError(f"{name}: {count} held-out prompts leave none of the {len(problems)} training prompts")
        validation += random.Random(rng_seed).sample(problems, count)
    held = {problem.key for problem in validation}
    return [replace(s, problems=[p for p in s.problems if p.key not in held]) for s in sources], validation


def epoch_order(sources: list[Source], *, seed: int, epoch: int) -> list[Problem]:
    """The prompts of `epoch` in the order they are drawn (see the module docstring for weights)."""
    rng = random.Random(f"epoch/{seed}/{epoch}")
    order: list[Problem] = []
    for source in sources:
        weight, problems = source.config.weight, source.problems
        copies = math.floor(weight)
        order.extend(problems * copies)
        order.extend(rng.sample(problems, round((weight - copies) * len(problems))))
    rng.shuffle(order)
    return order


class _Epochs:
    """Epoch after epoch over some sources (one, in a mixture), skipping retired prompts; seed `seed`."""

    def __init__(self, sources: list[Source], *, seed: str | int, resampling: NoPositiveResampling):
        self.sources, self.seed, self.resampling = sources, seed, resampling
        self.keys = {problem.key for source in sources for problem in source.problems}
        self.epoch, self.position = 0, 0  # prompts of the epoch's order drawn (retired ones included)
        self._order = epoch_order(sources, seed=seed, epoch=0)

    def exhausted(self) -> bool:
        return self.keys <= self.resampling.retired

    def next(self) -> Problem:
        """The next prompt not retired (a new epoch starts when this one is used up); call only while not
        `exhausted()`."""
        while True:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = epoch_order(self.sources, seed=self.seed, epoch=self.epoch)
                continue
            problem = self._order[self.position]
            self.position += 1
            if problem.key not in self.resampling.retired:
                return problem

    def load(self, epoch: int, position: int) -> None:
        order = epoch_order(self.sources, seed=self.seed, epoch=epoch)
        if not 0 <= position <= len(order):
            raise UserError(f"prompt sampler state: position {position} is outside epoch {epoch}'s {len(order)} "
                            "prompts (did the data change?)")
        self.epoch, self.position, self._order = epoch, position, order


class PromptSampler:
    """Draws training prompts epoch after epoch, skipping those No-Positive-Resampling retired; a mixture when the
    sources have shares (module docstring)."""

    def __init__(self, sources: list[Source], *, seed: int, resampling: NoPositiveResampling):
        self.mixed = sources[0].config.share is not None
        if self.mixed:  # one epoch stream per source, seeded apart (the first keeps the unmixed seed)
            self.streams = [_Epochs([s], seed=seed if i == 0 else f"{seed}/{i}", resampling=resampling)
                            for i, s in enumerate(sources)]
            total = sum(s.config.share for s in sources)
            self.shares = [s.config.share / total for s in sources]
        else:
            self.streams, self.shares = [_Epochs(sources, seed=seed, resampling=resampling)], [1.0]
        self.labels = [s.config.label for s in sources] if self.mixed else ["data.train"]
        self.draws = [0] * len(self.streams)  # prompts drawn from each stream
        self.dropped: set[int] = set()  # streams whose prompts are all retired

    @property
    def epoch(self) -> int:
        """Epochs completed by the stream furthest behind."""
        return min(stream.epoch for stream in self.streams)

    def next(self) -> Problem:
        """The next prompt not retired, from the stream furthest below its share (the only stream when unmixed)."""
        for i, stream in enumerate(self.streams):
            if i not in self.dropped and stream.exhausted():
                self.dropped.add(i)
                if self.mixed:
                    print(f"prompt sampler: every prompt of {self.labels[i]} is retired by No-Positive-Resampling; "
                          "the mixture goes on without it", flush=True)
        active = [i for i in range(len(self.streams)) if i not in self.dropped]
        if active:
            total = sum(self.draws) + 1
            chosen = max(active, key=lambda i: (self.shares[i] * total - self.draws[i], -i))
            problem = self.streams[chosen].next()  # not None: the stream has a prompt not retired
            self.draws[chosen] += 1
            return problem
        count = sum(len(stream.keys) for stream in self.streams)
        raise UserError(f"every one of the {count} training prompts is retired by No-Positive-Resampling: "
                        "nothing is left to train on")

    def state_dict(self) -> dict[str, Any]:
        if not self.mixed:
            return {"epoch": self.streams[0].epoch, "position": self.streams[0].position}
        return {"sources": [{"epoch": stream.epoch, "position": stream.position, "draws": draws}
                            for stream, draws in zip(self.streams, self.draws, strict=True)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict` (the retirements come from the resampling state, saved beside it)."""
        try:
            saved = state["sources"] if self.mixed else [{**state, "draws": 0}]
            if len(saved) != len(self.streams):
                raise ValueError(f"{len(saved)} sources saved, the recipe has {len(self.streams)}")
            positions = [(int(s["epoch"]), int(s["position"]), int(s["draws"])) for s in saved]
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"prompt sampler state: malformed or not this recipe's ({type(exc).__name__}: {exc}; "
                            "did data.train change?)") from None
        for stream, (epoch, position, _) in zip(self.streams, positions, strict=True):
            stream.load(epoch, position)
        self.draws = [draws for _, _, draws in positions]
