"""One prompt's group: its samples generated on the fleet, graded and rewarded (the orchestrator's unit of work, for
training and for validation alike).

Samples are generated token-in/token-out (`generation.generate_sample`) under the recipe's sampling
(`rollout.temperature`, `top_p`, `max_new_tokens`) and length control (the forced interruption's policy); each
completion's text (special tokens kept, the model's end tokens dropped) is graded by the problem's verifier
(`RewardGrader`), and its reward is `algorithm.reward_correct` / `reward_incorrect` (a verl-form score: the share of
the way between them), plus the length penalty under `algorithm.length_control.mode: length_penalty`. Lengths in
tokens.

A problem whose source names an `environment` (tasks/environments.py) gets its prompt through the environment's
`prompt` and an episode per sample (`generation.ToolLoop`); the environments are built once, when the generator is
(a bad one is refused then, naming its source). A sample its episode ended with a score is rewarded by that score
(a verl-form score); the others are graded by the verifier as above.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import torch

from megatron_scalerl.algo.length_control import InterruptionPolicy, length_penalty
from megatron_scalerl.errors import UserError
from megatron_scalerl.inference.fleet import Fleet, GenerationRequest
from megatron_scalerl.models.tokenizer import end_token_ids
from megatron_scalerl.orchestrator.batch_building import RolloutGroup
from megatron_scalerl.orchestrator.generation import Sample, ToolLoop, generate_sample, route_layers
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.tasks.environments import Environment, EnvironmentContext, load_environment
from megatron_scalerl.tasks.problems import Problem
from megatron_scalerl.tasks.prompts import THINK_CLOSE, conversation, render_prompt
from megatron_scalerl.tasks.rewards import Grade, RewardGrader, reward_of
from megatron_scalerl.tasks.verifiers import WRONG_ANSWER


class GroupGenerator:
    """Groups of samples of the recipe's kind from `fleet`, graded by `grader`; `tokenizer` renders the prompts."""

    def __init__(self, recipe: Recipe, tokenizer: Any, fleet: Fleet, grader: RewardGrader):
        self.recipe, self.tokenizer, self.fleet, self.grader = recipe, tokenizer, fleet, grader
        self.policy = InterruptionPolicy.from_recipe(recipe, tokenizer)
        self.think_close_ids = tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
        self.end_ids = end_token_ids(tokenizer)  # the tokenizer's EOS and its checkpoint's generation_config.json's
        self.route_layers = route_layers(recipe)  # the MoE layers whose routes each request asks for (or none)
        context = EnvironmentContext(tokenizer, grader.run_python)
        self.environments: dict[str, Environment] = {}  # by name: the sources' environments, built once
        for i, source in enumerate(recipe.data.train):
            if source.environment is not None and source.environment not in self.environments:
                self.environments[source.environment] = load_environment(source.environment, context,
                                                                         f"data.train[{i}] ({source.label})")

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The rendered prompt's token ids (through its environment's `prompt`, if any); UserError past
        `rollout.max_prompt_tokens`."""
        messages = conversation(problem)
        if problem.environment is not None:
            messages = self.environments[problem.environment].prompt(messages)
        ids = self.tokenizer(render_prompt(problem, self.tokenizer, messages)).input_ids
        if len(ids) > self.recipe.rollout.max_prompt_tokens:
            raise UserError(f"prompt {problem.key} is {len(ids)} tokens, over rollout.max_prompt_tokens "
                            f"({self.recipe.rollout.max_prompt_tokens})")
        return list(ids)

    async def generate(self, problem: Problem, key: str, samples: int, admitted_version: int = 0) -> RolloutGroup:
        """`samples` samples of `problem` (request keys `key/i`), graded and rewarded, as one group (index -1 until
        the caller numbers it; `admitted_version`: the generators' policy version when it was admitted)."""
        rollout, algorithm = self.recipe.rollout, self.recipe.algorithm
        prompt = self.prompt_ids(problem)
        requests = [GenerationRequest(key=f"{key}/{i}", prompt_ids=prompt, max_tokens=rollout.max_new_tokens,
                                      temperature=rollout.temperature, top_p=rollout.top_p,
                                      route_layers=self.route_layers) for i in range(samples)]
        results = await asyncio.gather(*(generate_sample(self.fleet, r, self.policy,
                                                         think_close_ids=self.think_close_ids,
                                                         tools=self.tool_loop(problem)) for r in requests))
        grades = await asyncio.gather(*(self.grade(s, problem) for s in results))
        correct = [g.correct for g in grades]
        rewards = [reward_of(g, algorithm.reward_correct, algorithm.reward_incorrect) for g in grades]
        if algorithm.length_control.mode == "length_penalty":
            config = algorithm.length_control
            penalty = length_penalty(torch.tensor([len(s.completion_ids) for s in results]), torch.tensor(correct),
                                     max_len=config.penalty_max_len, cache_len=config.penalty_cache_len)
            rewards = [r + float(p) for r, p in zip(rewards, penalty, strict=True)]
        return RolloutGroup(problem=problem, index=-1, admitted_version=admitted_version, samples=list(results),
                            rewards=rewards, correct=correct,
                            failures=dict(Counter(g.failure for g in grades if g.failure is not None)),
                            reward_metrics=[g.metrics for g in grades])

    def tool_loop(self, problem: Problem) -> ToolLoop | None:
        """A new episode of the problem's environment for one sample (None: the problem has none)."""
        if problem.environment is None:
            return None
        environment = self.environments[problem.environment]
        return ToolLoop(environment.start(problem), tuple(tuple(s) for s in environment.stop_sequences),
                        problem.max_tool_calls, f"environment {problem.environment!r} on {problem.key}")

    async def grade(self, sample: Sample, problem: Problem) -> Grade:
        """The sample's grade: its episode's score when it ended with one (a verl-form score), else the verifier's."""
        if sample.score is not None:
            correct = sample.score >= 1.0
            return Grade(correct=correct, fraction=float(correct), failure=None if correct else WRONG_ANSWER,
                         score=sample.score)
        return await self.grader.grade(self.text(sample.completion_ids), problem)

    def text(self, ids: list[int]) -> str:
        """The completion's text for grading, special tokens kept (`</think>` may be one) but the model's end tokens
        (`end_token_ids`: every one the generators stop at) dropped."""
        return self.tokenizer.decode([t for t in ids if t not in self.end_ids], skip_special_tokens=False)
