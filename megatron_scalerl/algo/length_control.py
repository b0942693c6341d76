"""Length control (paper section 2): forced interruption of long thinking, the length-penalty alternative, and
truncation accounting. Pure logic: callers ask these functions what to do, or hand them how to make a request; they
talk to no server themselves.

Interruption (recipe: algorithm.length_control, mode `interruption`). Per sample, a thinking budget B is drawn
uniformly from the integers [think_budget_min, think_budget_max] by an RNG seeded with (seed, sample key), so a sample's
budget does not depend on the order in which samples are drawn. Generation runs in two stages:

  1. generate at most B tokens. Ended on its own (EOS) -> done.
  2. stopped at B tokens:
       thinking still open  -> interrupt: append the phrase token ids ("... </think>") and generate at most
                               `answer_budget` more tokens;
       thinking closed      -> the answer is in progress: continue without a phrase, up to the hard cap
                               (rollout.max_new_tokens) minus the tokens generated so far.
     A second stage that stops on its limit instead of EOS leaves the sample truncated.

The phrase tokens were not sampled by the policy: they are out of the loss. The stages are run by
`generate_in_stages`, the one flow of training (token ids, `orchestrator.generation`, where a stage may be several
turns with an environment) and evaluation (text, `evaluation.sampling`); each side says how a stage is made and joins
the stages its own way.

Length penalty (mode `length_penalty`, DAPO-style, on correct answers only), |y| the completion length in tokens:
    R_len = clip((L_max - |y|) / L_cache - 1, -1, 0)
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from megatron_scalerl.errors import UserError

# Paper: runs whose truncation rate reached 10-15% became unstable; ScaleRL stays under 5%.
TRUNCATION_ALARM_RATE = 0.10


@dataclass(frozen=True)
class Continuation:
    """The second stage of a sample whose first stage stopped at its thinking budget."""

    append_ids: tuple[int, ...]  # token ids appended before generating again (the phrase); not in the loss
    max_new_tokens: int  # tokens the second stage may generate
    interrupted: bool  # True when the phrase was forced in


class InterruptionPolicy:
    """Budgets and continuations of the forced-interruption scheme. Lengths in tokens."""

    def __init__(self, *, think_budget_min: int, think_budget_max: int, phrase_ids: Sequence[int],
                 phrase_token_reserve: int, answer_budget: int, max_new_tokens: int, seed: int):
        if not 0 < think_budget_min <= think_budget_max:
            raise UserError(f"length_control: need 0 < think_budget_min ({think_budget_min}) <= think_budget_max "
                            f"({think_budget_max})")
        if not phrase_ids:
            raise UserError("length_control.interruption_phrase: tokenises to no token")
        if len(phrase_ids) > phrase_token_reserve:
            raise UserError(f"length_control.phrase_token_reserve: the interruption phrase is {len(phrase_ids)} "
                            f"tokens, more than the {phrase_token_reserve} reserved")
        if think_budget_max + phrase_token_reserve + answer_budget > max_new_tokens:
            raise UserError(f"length_control: think_budget_max + phrase_token_reserve + answer_budget = "
                            f"{think_budget_max + phrase_token_reserve + answer_budget} exceeds max_new_tokens "
                            f"{max_new_tokens}")
        self.think_budget_min = think_budget_min
        self.think_budget_max = think_budget_max
        self.phrase_ids = tuple(int(t) for t in phrase_ids)
        self.answer_budget = answer_budget
        self.max_new_tokens = max_new_tokens
        self.seed = seed

    @classmethod
    def from_recipe(cls, recipe: Any, tokenizer: Any) -> InterruptionPolicy | None:
        """The recipe's setting (algorithm.length_control.mode): forced interruption -> its policy, the phrase
        tokenised by `tokenizer` (no special tokens); length_penalty or none -> None (one request up to
        rollout.max_new_tokens; the penalty is added to the reward, `length_penalty`)."""
        config = recipe.algorithm.length_control
        if config.mode != "interruption":
            return None
        return cls.from_config(config, phrase_ids=tokenizer.encode(config.interruption_phrase, add_special_tokens=False),
                               max_new_tokens=recipe.rollout.max_new_tokens, seed=recipe.trainer.seed)

    @classmethod
    def from_config(cls, config: Any, *, phrase_ids: Sequence[int], max_new_tokens: int,
                    seed: int) -> InterruptionPolicy:
        """From a recipe's length_control section of mode interruption; `phrase_ids` = the tokenizer's ids of
        config.interruption_phrase."""
        if config.mode != "interruption":
            raise UserError(f"length_control.mode is '{config.mode}', not 'interruption'")
        return cls(think_budget_min=config.think_budget_min, think_budget_max=config.think_budget_max,
                   phrase_ids=phrase_ids, phrase_token_reserve=config.phrase_token_reserve,
                   answer_budget=config.answer_budget, max_new_tokens=max_new_tokens, seed=seed)

    def think_budget(self, sample_key: str) -> int:
        """The sample's thinking budget in tokens, uniform in [think_budget_min, think_budget_max], deterministic."""
        return random.Random(f"{self.seed}/{sample_key}").randint(self.think_budget_min, self.think_budget_max)

    def continuation(self, *, generated_tokens: int, think_closed: bool) -> Continuation:
        """What to do once the first stage stopped at its budget (`generated_tokens`) without an EOS."""
        if think_closed:
            return Continuation(append_ids=(), max_new_tokens=self.max_new_tokens - generated_tokens,
                                interrupted=False)
        return Continuation(append_ids=self.phrase_ids, max_new_tokens=self.answer_budget, interrupted=True)


class Segment(Protocol):
    """What the flow reads of one request's output: how it ended."""

    finish_reason: str  # "stop" (EOS or a stop token) or "length" (its token limit)


S = TypeVar("S", bound=Segment)


@dataclass(frozen=True)
class Stages(Generic[S]):
    """The requests that made one sample: `first`, and when a second stage ran, its `continuation` and `second`."""

    first: S
    continuation: Continuation | None = None
    second: S | None = None

    @property
    def last(self) -> S:
        """The request the sample ended with."""
        return self.first if self.second is None else self.second

    @property
    def interrupted(self) -> bool:
        """The phrase was forced in."""
        return self.continuation is not None and self.continuation.interrupted

    @property
    def truncated(self) -> bool:
        """The sample stopped on a length limit without EOS."""
        return self.last.finish_reason == "length"


async def generate_in_stages(policy: InterruptionPolicy | None, key: str, max_new_tokens: int, seed: int | None, *,
                             first: Callable[[int, int | None], Awaitable[S]],
                             second: Callable[[S, Continuation, int | None], Awaitable[S]],
                             measure: Callable[[S], tuple[int, bool]]) -> Stages[S]:
    """One sample of `key` under `policy` (None: one request up to `max_new_tokens` tokens).

    `first(max_tokens, seed)` makes the first request from the prompt; `second(first, continuation, seed)` the second
    one, from the prompt, the first request's output and `continuation.append_ids` (the phrase), generating at most
    `continuation.max_new_tokens`; `measure(output)` is (tokens generated, thinking closed). The second request is
    seeded `seed + 1` (unseeded stays unseeded). A first request that ended on its own, or that left the second stage
    no tokens, is the whole sample.
    """
    if policy is None:
        return Stages(await first(max_new_tokens, seed))
    head = await first(policy.think_budget(key), seed)
    if head.finish_reason != "length":
        return Stages(head)
    generated, think_closed = measure(head)
    continuation = policy.continuation(generated_tokens=generated, think_closed=think_closed)
    if continuation.max_new_tokens <= 0:
        return Stages(head)
    return Stages(head, continuation, await second(head, continuation, None if seed is None else seed + 1))


def length_penalty(lengths: torch.Tensor, correct: torch.Tensor, *, max_len: int, cache_len: int) -> torch.Tensor:
    """R_len for each sample [num_samples] float32: the formula above on correct samples, 0 on the others.

    lengths: completion lengths in tokens [num_samples]; correct: [num_samples] bool. Add it to the reward.
    """
    if not 0 < cache_len < max_len:
        raise UserError(f"length_control: need 0 < penalty_cache_len ({cache_len}) < penalty_max_len ({max_len})")
    penalty = ((max_len - lengths.to(torch.float64)) / cache_len - 1).clamp(-1.0, 0.0)
    return torch.where(correct.bool(), penalty, 0.0).float()


def length_metrics(lengths: torch.Tensor, truncated: torch.Tensor, interrupted: torch.Tensor) -> dict[str, float]:
    """One step's length health: completion length (tokens), truncation and interruption rates (fractions).

    lengths: [num_samples] tokens; truncated: [num_samples] bool (stopped on a hard limit without EOS);
    interrupted: [num_samples] bool (the phrase was forced in). `truncation_alarm` is 1.0 at or above
    TRUNCATION_ALARM_RATE.
    """
    samples = lengths.numel()
    if samples == 0:
        return {"samples": 0.0}
    rate = float(truncated.bool().sum()) / samples
    return {
        "samples": float(samples),
        "length_mean": float(lengths.double().mean()),
        "length_max": float(lengths.max()),
        "truncation_rate": rate,
        "interruption_rate": float(interrupted.bool().sum()) / samples,
        "truncation_alarm": float(rate >= TRUNCATION_ALARM_RATE),
    }
