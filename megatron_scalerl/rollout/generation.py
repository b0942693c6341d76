"""One training sample from the fleet, with the recipe's length control applied inside generation.

    policy = length_control_policy(recipe, tokenizer)     # None unless length_control.mode is "interruption"
    sample = await generate_sample(fleet, GenerationRequest(key, prompt_ids, recipe.rollout.max_new_tokens), policy,
                                   think_close_ids=tokenizer.encode("</think>", add_special_tokens=False))

Interruption (`algo.length_control`): the first request may generate the sample's thinking budget (tokens, drawn per
sample key). If it stops there without EOS, the policy decides: thinking still open -> the interruption phrase is
appended and a second request on the same server (its prefix cache holds the first part) generates at most the
answer budget; thinking closed -> the answer goes on up to the hard cap. The phrase tokens carry log-prob 0, weight
version None and loss mask False (`join_segments`): the loss ignores them. Without a policy (length penalty or none)
one request generates up to `max_tokens`. A sample that stops on a limit without EOS is truncated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_scalerl.algo.length_control import InterruptionPolicy, join_segments
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.rollout.fleet import Fleet, Generation, GenerationRequest


@dataclass
class Sample:
    """A finished sample. Per completion token: `logprobs` (generator's), `versions` (weight version that sampled
    it; None for the appended phrase), `loss_mask` (False for the phrase)."""

    key: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[str | None]
    loss_mask: list[bool]
    finish_reason: str  # of the last request: "stop" or "length"
    interrupted: bool  # the phrase was forced in
    truncated: bool  # stopped on a length limit without EOS
    server: str

    @classmethod
    def from_generation(cls, generation: Generation) -> Sample:
        return cls(generation.key, generation.prompt_ids, generation.completion_ids, generation.logprobs,
                   generation.versions, [True] * len(generation.completion_ids), generation.finish_reason,
                   interrupted=False, truncated=generation.finish_reason == "length", server=generation.server)


def length_control_policy(recipe: Recipe, tokenizer: Any) -> InterruptionPolicy | None:
    """The recipe's setting (algorithm.length_control.mode): forced interruption -> its policy, the phrase
    tokenised by `tokenizer` (no special tokens); length_penalty or none -> None (one request up to
    rollout.max_new_tokens; the penalty is added to the reward, `algo.length_control.length_penalty`)."""
    config = recipe.algorithm.length_control
    if config.mode != "interruption":
        return None
    return InterruptionPolicy.from_config(
        config, phrase_ids=tokenizer.encode(config.interruption_phrase, add_special_tokens=False),
        max_new_tokens=recipe.rollout.max_new_tokens, seed=recipe.trainer.seed)


def contains(tokens: Sequence[int], pattern: Sequence[int]) -> bool:
    """Whether `pattern` occurs in `tokens` as a contiguous run (False for an empty pattern)."""
    n = len(pattern)
    return n > 0 and any(list(tokens[i:i + n]) == list(pattern) for i in range(len(tokens) - n + 1))


async def generate_sample(fleet: Fleet, request: GenerationRequest, policy: InterruptionPolicy | None = None, *,
                          think_close_ids: Sequence[int] = ()) -> Sample:
    """`request` generated under `policy` (None: one request up to `request.max_tokens`)."""
    if policy is None:
        return Sample.from_generation(await fleet.generate(request))
    first = await fleet.generate(replace(request, max_tokens=policy.think_budget(request.key)))
    if first.finish_reason != "length":
        return Sample.from_generation(first)
    continuation = policy.continuation(generated_tokens=len(first.completion_ids),
                                       think_closed=contains(first.completion_ids, think_close_ids))
    if continuation.max_new_tokens <= 0:
        return Sample.from_generation(first)
    second_request = replace(request, key=f"{request.key}#answer", max_tokens=continuation.max_new_tokens,
                             prompt_ids=[*request.prompt_ids, *first.completion_ids, *continuation.append_ids],
                             seed=None if request.seed is None else request.seed + 1)
    second = await fleet.generate(second_request, server=first.server)
    ids, logprobs, mask = join_segments(first.completion_ids, first.logprobs, continuation, second.completion_ids,
                                        second.logprobs)
    versions = [*first.versions, *([None] * len(continuation.append_ids)), *second.versions]
    return Sample(request.key, list(request.prompt_ids), ids, logprobs, versions, mask, second.finish_reason,
                  interrupted=continuation.interrupted, truncated=second.finish_reason == "length",
                  server=second.server)
