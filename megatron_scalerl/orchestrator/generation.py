"""One training sample from the fleet, with the recipe's length control applied inside generation.

    policy = InterruptionPolicy.from_recipe(recipe, tokenizer)  # None unless length_control.mode is "interruption"
    sample = await generate_sample(fleet, GenerationRequest(key, prompt_ids, recipe.rollout.max_new_tokens), policy,
                                   think_close_ids=tokenizer.encode("</think>", add_special_tokens=False))

Interruption (`algo.length_control.generate_in_stages`, the flow evaluation shares): the first request may generate
the sample's thinking budget (tokens, drawn per sample key). If it stops there without EOS, the policy decides:
thinking still open -> the interruption phrase is appended and a second request on the same server (its prefix cache
holds the first part) generates at most the answer budget; thinking closed -> the answer goes on up to the hard cap.
Here the stages are token ids: the phrase tokens carry log-prob 0, policy version NO_VERSION and loss mask False
(`join_segments`): the loss ignores them. Without a policy (length penalty or none) one request generates up to
`max_tokens`. A sample that stops on a limit without EOS is truncated.

Routes (MoE routing replay, `algorithm.routing_replay`; `route_layers(recipe)` on the request): a sample's routes
cover every position of prompt + completion, aligned with the token ids. The first request returns those of its
prompt and of its tokens but the last; the second stage returns them from the first stage's last token on
(`routes_from`), the phrase tokens and its own completion included, so each position's routes come from the request
that ran it, the first stage's from its server even when the second went to another after a failure. The last
token never ran: it repeats the routes of the one before (the batch contract, `batches.train_batch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from megatron_scalerl.algo.length_control import Continuation, InterruptionPolicy, generate_in_stages, join_segments
from megatron_scalerl.algo.versions import NO_VERSION
from megatron_scalerl.families import layer_plan
from megatron_scalerl.inference.fleet import Fleet, Generation, GenerationRequest
from megatron_scalerl.recipe import Recipe


@dataclass
class Sample:
    """A finished sample. Per completion token: `logprobs` (generator's), `versions` (policy version that sampled
    it, `algo.versions`; NO_VERSION for the appended phrase), `loss_mask` (False for the phrase). `routes`: None
    unless requested, else uint8 [len(prompt_ids) + len(completion_ids), MoE layers, top-k], the generator's expert
    ids of each position (the last position's repeat the one before; see the module docstring)."""

    key: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[bool]
    finish_reason: str  # of the last request: "stop" or "length"
    interrupted: bool  # the phrase was forced in
    truncated: bool  # stopped on a length limit without EOS
    server: str
    routes: torch.Tensor | None = None

    @classmethod
    def from_generation(cls, generation: Generation) -> Sample:
        return cls(generation.key, generation.prompt_ids, generation.completion_ids, generation.logprobs,
                   generation.versions, [True] * len(generation.completion_ids), generation.finish_reason,
                   interrupted=False, truncated=generation.finish_reason == "length", server=generation.server,
                   routes=_with_last(generation.routes))


def _with_last(*parts: torch.Tensor | None) -> torch.Tensor | None:
    """Routes of consecutive positions joined, the last row repeated for the final token (None: not requested)."""
    if parts[0] is None:
        return None
    routes = torch.cat(parts)
    return torch.cat([routes, routes[-1:]])


def route_layers(recipe: Recipe) -> tuple[int, ...]:
    """The decoder layers whose routes the recipe's samples carry: the model's MoE layers when it captures routing
    (`Recipe.captures_routes`: `algorithm.routing_replay` or `rollout.capture_routes`, which the recipe allows for
    MoE models only), none otherwise."""
    model = recipe.model
    if not recipe.captures_routes:
        return ()
    return tuple(i for i in range(model.num_layers) if layer_plan(model, i).moe)


def contains(tokens: Sequence[int], pattern: Sequence[int]) -> bool:
    """Whether `pattern` occurs in `tokens` as a contiguous run (False for an empty pattern)."""
    n = len(pattern)
    return n > 0 and any(list(tokens[i:i + n]) == list(pattern) for i in range(len(tokens) - n + 1))


async def generate_sample(fleet: Fleet, request: GenerationRequest, policy: InterruptionPolicy | None = None, *,
                          think_close_ids: Sequence[int] = ()) -> Sample:
    """`request` generated under `policy` (None: one request up to `request.max_tokens`); the second stage goes to
    the first one's server, as request `<key>#answer`."""

    async def first(max_tokens: int, seed: int | None) -> Generation:
        return await fleet.generate(replace(request, max_tokens=max_tokens, seed=seed))

    async def second(head: Generation, continuation: Continuation, seed: int | None) -> Generation:
        prompt = [*request.prompt_ids, *head.completion_ids, *continuation.append_ids]
        ran = len(request.prompt_ids) + len(head.completion_ids) - 1  # positions whose routes the head has
        return await fleet.generate(replace(
            request, key=f"{request.key}#answer", max_tokens=continuation.max_new_tokens, seed=seed,
            prompt_ids=prompt, routes_from=ran), server=head.server)

    stages = await generate_in_stages(
        policy, request.key, request.max_tokens, request.seed, first=first, second=second,
        measure=lambda head: (len(head.completion_ids), contains(head.completion_ids, think_close_ids)))
    if stages.continuation is None or stages.second is None:
        return Sample.from_generation(stages.first)
    head, tail, phrase = stages.first, stages.second, stages.continuation.append_ids
    ids, logprobs, mask = join_segments(head.completion_ids, head.logprobs, stages.continuation, tail.completion_ids,
                                        tail.logprobs)
    versions = [*head.versions, *([NO_VERSION] * len(phrase)), *tail.versions]
    return Sample(request.key, list(request.prompt_ids), ids, logprobs, versions, mask, tail.finish_reason,
                  interrupted=stages.interrupted, truncated=stages.truncated, server=tail.server,
                  routes=_with_last(head.routes, tail.routes))
