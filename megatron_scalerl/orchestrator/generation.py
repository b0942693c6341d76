"""One training sample from the fleet, with the recipe's length control applied inside generation.

    policy = InterruptionPolicy.from_recipe(recipe, tokenizer)  # None unless length_control.mode is "interruption"
    sample = await generate_sample(fleet, GenerationRequest(key, prompt_ids, recipe.rollout.max_new_tokens), policy,
                                   think_close_ids=tokenizer.encode("</think>", add_special_tokens=False))

Interruption (`algo.length_control.generate_in_stages`, the flow evaluation shares): the first request may generate
the sample's thinking budget (tokens, drawn per sample key). If it stops there without EOS, the policy decides:
thinking still open -> the interruption phrase is appended and a second request on the same server (its prefix cache
holds the first part) generates at most the answer budget; thinking closed -> the answer goes on up to the hard cap.
Here the stages are token ids: the phrase tokens carry log-prob 0, policy version NO_VERSION and loss mask False:
the loss ignores them. Without a policy (length penalty or none) one request generates up to
`max_tokens`. A sample that stops on a limit without EOS is truncated.

Routes (MoE routing replay, `algorithm.routing_replay`; `route_layers(recipe)` on the request): a sample's routes
cover every position of prompt + completion, aligned with the token ids. The first request returns those of its
prompt and of its tokens but the last; the second stage returns them from the first stage's last token on
(`routes_from`), the phrase tokens and its own completion included, so each position's routes come from the request
that ran it, the first stage's from its server even when the second went to another after a failure. The last
token never ran: it repeats the routes of the one before (the batch contract, `batches.train_batch`).

Environments (a source's `environment:`, tasks/environments.py; `ToolLoop` on the call): each stage is then a loop of
model turns. A request stops at the last token of any of the environment's stop sequences as well as at EOS; when
the completion ends with a whole stop sequence the episode answers: its Observation is appended (like the phrase:
log-prob 0, NO_VERSION, out of the loss) and the next request, on the same server, continues prompt + everything so
far, token ids as they are (nothing is re-tokenised: the trainer trains on exactly these ids); None lets the model
write on; EndEpisode ends the sample. The thinking budget and the answer budget count the model's tokens alone;
`request.max_tokens` (rollout.max_new_tokens) caps the whole completion, observations included: an observation that
would leave no room for the model to answer ends the sample truncated instead. After `max_tool_calls` observations
the requests stop only at EOS. Routes: each request returns those of the positions it ran first (`routes_from`: the
ones before it ran in earlier requests), observations included; an observation the sample ends with (its stage's
budget spent at the call) no request ran, and repeats the routes before it, as the final token does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from megatron_scalerl.algo.length_control import Continuation, InterruptionPolicy, generate_in_stages
from megatron_scalerl.algo.versions import NO_VERSION
from megatron_scalerl.families import layer_plan
from megatron_scalerl.inference.fleet import Fleet, GenerationRequest
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.tasks.environments import EndEpisode, Episode, ends_with_stop, next_step


@dataclass
class Sample:
    """A finished sample. Per completion token: `logprobs` (generator's), `versions` (policy version that sampled
    it, `algo.versions`; NO_VERSION for the appended phrase and observations), `loss_mask` (False for those). `routes`:
    None unless requested, else uint8 [len(prompt_ids) + len(completion_ids), MoE layers, top-k], the generator's
    expert ids of each position (the last position's repeat the one before; see the module docstring). Tool figures
    (an environment's samples): observations inserted (`tool_calls`), their kinds of failure (`tool_failures`),
    their tokens (`observation_tokens`); `score`: the environment's own score when it ended the episode with one."""

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
    tool_calls: int = 0
    tool_failures: dict[str, int] = field(default_factory=dict)
    observation_tokens: int = 0
    score: float | None = None


@dataclass(frozen=True)
class ToolLoop:
    """A sample's environment: its episode, the stop sequences of the environment, at most `max_calls`
    observations; `where` names the source in errors."""

    episode: Episode
    stop_sequences: tuple[tuple[int, ...], ...]
    max_calls: int
    where: str

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(s[-1] for s in self.stop_sequences))


def _with_last(parts: list[torch.Tensor], length: int) -> torch.Tensor | None:
    """Routes of consecutive positions joined, for `length` positions: those no request ran (the final token, and an
    observation a sample ends with, its stage's budget spent) repeat the last row (None: not requested)."""
    if not parts:
        return None
    routes = torch.cat(parts)
    return torch.cat([routes, routes[-1:].expand(length - len(routes), *routes.shape[1:])])


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


class _SampleBuilder:
    """One sample as its requests make it: the completion so far (model tokens, the phrase, observations), per token
    log-prob, version and loss mask, the routes, the server, how the last request ended."""

    def __init__(self, fleet: Fleet, request: GenerationRequest, tools: ToolLoop | None):
        self.fleet, self.request, self.tools = fleet, request, tools
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.mask: list[bool] = []
        self.routes: list[torch.Tensor] = []
        self.covered = 0  # positions of prompt + completion whose routes came back
        self.server: str | None = None
        self.finish_reason = "length"
        self.interrupted = False
        self.calls, self.failures, self.observed = 0, {}, 0
        self.score: float | None = None

    def _insert(self, ids: Sequence[int]) -> None:
        """Tokens the model did not sample (the phrase, an observation): in the context, out of the loss."""
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [NO_VERSION] * len(ids)
        self.mask += [False] * len(ids)

    def model_ids(self) -> list[int]:
        return [t for t, sampled in zip(self.ids, self.mask, strict=True) if sampled]

    async def stage(self, key: str, model_budget: int, seed: int | None) -> _SampleBuilder:
        """Model turns from the completion so far: at most `model_budget` model tokens and the sample's cap in all,
        answering the environment's stops (see the module docstring)."""
        generated, turn, tools = 0, 0, self.tools
        while True:
            limit = min(model_budget - generated, self.request.max_tokens - len(self.ids))
            if limit <= 0:
                self.finish_reason = "length"
                return self
            listening = tools is not None and self.calls < tools.max_calls
            prompt = [*self.request.prompt_ids, *self.ids]
            generation = await self.fleet.generate(replace(
                self.request, key=key if turn == 0 else f"{key}#t{turn}", prompt_ids=prompt, max_tokens=limit,
                seed=None if seed is None else seed + 2 * turn, routes_from=self.covered,
                stop_token_ids=tools.stop_token_ids if listening else ()), server=self.server)
            turn += 1
            new = generation.completion_ids
            self.ids += new
            self.logprobs += generation.logprobs
            self.versions += generation.versions
            self.mask += [True] * len(new)
            if generation.routes is not None:
                self.routes.append(generation.routes)
            self.covered = len(prompt) + len(new) - 1
            self.server, self.finish_reason = generation.server, generation.finish_reason
            generated += len(new)
            if not (listening and generation.finish_reason == "stop" and new and new[-1] in tools.stop_token_ids):
                return self
            if not ends_with_stop(self.ids, tools.stop_sequences):
                continue
            answer = await next_step(tools.episode, self.ids, tools.where)
            if isinstance(answer, EndEpisode):
                self.score = answer.score
                return self
            if answer is None:
                continue
            if len(self.ids) + len(answer.token_ids) >= self.request.max_tokens:
                self.finish_reason = "length"  # no room left to answer after it: the sample is cut here
                return self
            self._insert(answer.token_ids)
            self.calls += 1
            self.observed += len(answer.token_ids)
            if answer.failure is not None:
                self.failures[answer.failure] = self.failures.get(answer.failure, 0) + 1

    async def answer_stage(self, continuation: Continuation, seed: int | None) -> _SampleBuilder:
        """The second stage: the phrase (if any) appended, then at most `continuation.max_new_tokens` model tokens."""
        if len(self.ids) + len(continuation.append_ids) >= self.request.max_tokens:
            self.finish_reason = "length"  # observations used the room the phrase and the answer had
            return self
        self._insert(continuation.append_ids)
        self.interrupted = continuation.interrupted
        return await self.stage(f"{self.request.key}#answer", continuation.max_new_tokens, seed)

    def sample(self) -> Sample:
        return Sample(self.request.key, list(self.request.prompt_ids), self.ids, self.logprobs, self.versions,
                      self.mask, self.finish_reason, interrupted=self.interrupted,
                      truncated=self.finish_reason == "length", server=self.server or "",
                      routes=_with_last(self.routes, len(self.request.prompt_ids) + len(self.ids)),
                      tool_calls=self.calls, tool_failures=self.failures,
                      observation_tokens=self.observed, score=self.score)


async def generate_sample(fleet: Fleet, request: GenerationRequest, policy: InterruptionPolicy | None = None, *,
                          think_close_ids: Sequence[int] = (), tools: ToolLoop | None = None) -> Sample:
    """`request` generated under `policy` (None: one stage up to `request.max_tokens`) and, with `tools`, its
    environment; every request after the first goes to the server of the one before (its prefix cache holds the
    sample so far), the second stage's as `<key>#answer`."""
    builder = _SampleBuilder(fleet, request, tools)

    async def first(max_tokens: int, seed: int | None) -> _SampleBuilder:
        return await builder.stage(request.key, max_tokens, seed)

    async def second(_: _SampleBuilder, continuation: Continuation, seed: int | None) -> _SampleBuilder:
        return await builder.answer_stage(continuation, seed)

    await generate_in_stages(policy, request.key, request.max_tokens, request.seed, first=first, second=second,
                             measure=lambda b: (len(b.ids), contains(b.model_ids(), think_close_ids)))
    return builder.sample()
