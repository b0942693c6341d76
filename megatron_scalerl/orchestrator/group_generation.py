"""One prompt's group: its samples generated on the fleet, graded and rewarded (the orchestrator's unit of work, for
training and for validation alike).

Samples are generated token-in/token-out (`generation.generate_sample`) under the recipe's sampling
(`rollout.temperature`, `top_p`, `max_new_tokens`) and length control (the forced interruption's policy); each
completion's text (special tokens kept, the model's end tokens dropped) is graded by the problem's verifier
(`RewardGrader`), and its reward is `algorithm.reward_correct` / `reward_incorrect` (a verl-form score: the share of
the way between them), plus the length penalty under `algorithm.length_control.mode: length_penalty`. Lengths in
tokens.
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
from megatron_scalerl.orchestrator.generation import generate_sample, route_layers
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.tasks.problems import Problem
from megatron_scalerl.tasks.prompts import THINK_CLOSE, render_prompt
from megatron_scalerl.tasks.rewards import RewardGrader, reward_of


class GroupGenerator:
    """Groups of samples of the recipe's kind from `fleet`, graded by `grader`; `tokenizer` renders the prompts."""

    def __init__(self, recipe: Recipe, tokenizer: Any, fleet: Fleet, grader: RewardGrader):
        self.recipe, self.tokenizer, self.fleet, self.grader = recipe, tokenizer, fleet, grader
        self.policy = InterruptionPolicy.from_recipe(recipe, tokenizer)
        self.think_close_ids = tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
        self.end_ids = end_token_ids(tokenizer)  # the tokenizer's EOS and its checkpoint's generation_config.json's
        self.route_layers = route_layers(recipe)  # the MoE layers whose routes each request asks for (or none)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The rendered prompt's token ids; UserError past `rollout.max_prompt_tokens`."""
        ids = self.tokenizer(render_prompt(problem, self.tokenizer)).input_ids
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
                                                         think_close_ids=self.think_close_ids) for r in requests))
        grades = await asyncio.gather(*(self.grader.grade(self.text(s.completion_ids), problem) for s in results))
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

    def text(self, ids: list[int]) -> str:
        """The completion's text for grading, special tokens kept (`</think>` may be one) but the model's end tokens
        (`end_token_ids`: every one the generators stop at) dropped."""
        return self.tokenizer.decode([t for t in ids if t not in self.end_ids], skip_special_tokens=False)
