"""Length control: interruption budgets and continuations, the two-request flow, the loss mask, the length penalty,
truncation rates."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from megatron_scalerl.algo.length_control import (
    Continuation,
    InterruptionPolicy,
    generate_in_stages,
    length_metrics,
    length_penalty,
)
from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import load_recipe

RECIPE = load_recipe("scalerl")
LENGTH = RECIPE.algorithm.length_control
PHRASE_IDS = list(range(500, 520))  # a 20-token phrase


def policy(seed: int = 1234, **changes):
    config = LENGTH.model_copy(update=changes)
    return InterruptionPolicy.from_config(config, phrase_ids=PHRASE_IDS, max_new_tokens=RECIPE.rollout.max_new_tokens,
                                          seed=seed)


def test_budgets_are_within_bounds_cover_them_and_are_deterministic():
    keys = [f"prompt-{p}/sample-{s}" for p in range(200) for s in range(16)]
    budgets = [policy().think_budget(k) for k in keys]
    assert all(10_000 <= b <= 12_000 for b in budgets)
    assert sum(budgets) / len(budgets) == pytest.approx(11_000, abs=40)  # uniform: mean 11000, sd ~577 / sqrt(3200)
    assert [policy().think_budget(k) for k in keys[:50]] == budgets[:50]  # same seed, any order/instance
    assert [policy().think_budget(k) for k in reversed(keys[:50])] == budgets[:50][::-1]
    assert [policy(seed=7).think_budget(k) for k in keys[:50]] != budgets[:50]
    tiny = policy(think_budget_min=10, think_budget_max=12)
    counts = Counter(tiny.think_budget(k) for k in keys)
    assert set(counts) == {10, 11, 12} and min(counts.values()) > len(keys) / 3 - 150


def test_interruption_when_thinking_is_still_open():
    step = policy().continuation(generated_tokens=10_500, think_closed=False)
    assert step == Continuation(append_ids=tuple(PHRASE_IDS), max_new_tokens=2000, interrupted=True)


def test_no_phrase_when_thinking_already_closed():
    step = policy().continuation(generated_tokens=10_500, think_closed=True)
    assert step == Continuation(append_ids=(), max_new_tokens=14_336 - 10_500, interrupted=False)


def test_worst_case_interrupted_sample_fits_the_hard_cap():
    p = policy()
    step = p.continuation(generated_tokens=12_000, think_closed=False)
    assert 12_000 + len(step.append_ids) + step.max_new_tokens <= RECIPE.rollout.max_new_tokens


def test_configuration_errors():
    with pytest.raises(UserError, match="phrase is 20 tokens, more than the 8 reserved"):
        policy(phrase_token_reserve=8)
    with pytest.raises(UserError, match="mode is 'length_penalty'"):
        policy(mode="length_penalty")
    with pytest.raises(UserError, match="exceeds max_new_tokens"):
        policy(answer_budget=4000)
    with pytest.raises(UserError, match="no token"):
        InterruptionPolicy.from_config(LENGTH, phrase_ids=[], max_new_tokens=14_336, seed=0)


def test_length_penalty_hand_values():
    lengths = torch.tensor([5_000, 12_000, 13_000, 13_500, 14_000, 15_000, 13_000])
    correct = torch.tensor([True, True, True, True, True, True, False])
    penalty = length_penalty(lengths, correct, max_len=14_000, cache_len=2_000)
    # clip((14000 - |y|) / 2000 - 1, -1, 0): 0 until 12k, then linear to -1 at 14k; incorrect answers get 0.
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.5, -0.75, -1.0, -1.0, 0.0])
    with pytest.raises(UserError, match="penalty_cache_len"):
        length_penalty(lengths, correct, max_len=2_000, cache_len=2_000)


def test_truncation_and_interruption_rates():
    lengths = torch.tensor([100, 14_336, 12_500, 300, 14_336, 200, 250, 9_000, 8_000, 7_000])
    truncated = lengths == 14_336
    interrupted = torch.tensor([False, True, True, False, True, False, False, False, False, False])
    metrics = length_metrics(lengths, truncated, interrupted)
    assert metrics["truncation_rate"] == pytest.approx(0.2)
    assert metrics["interruption_rate"] == pytest.approx(0.3)
    assert metrics["length_max"] == 14_336 and metrics["length_mean"] == pytest.approx(lengths.double().mean())
    assert metrics["truncation_alarm"] == 1.0
    assert length_metrics(lengths, torch.zeros(10, dtype=torch.bool), interrupted)["truncation_alarm"] == 0.0


def _staged(policy_, key, *, first_ends, second_ends="stop", think_closed=False, seed=5):
    """generate_in_stages with requests that record their arguments; outputs are (finish reason, tokens)."""
    calls = []

    class Out:
        def __init__(self, finish_reason, tokens):
            self.finish_reason, self.tokens = finish_reason, tokens

    async def first(max_tokens, seed_):
        calls.append(("first", max_tokens, seed_))
        return Out(first_ends, max_tokens)

    async def second(head, continuation, seed_):
        calls.append(("second", head.tokens, continuation, seed_))
        return Out(second_ends, continuation.max_new_tokens)

    stages = asyncio.run(generate_in_stages(policy_, key, RECIPE.rollout.max_new_tokens, seed, first=first,
                                            second=second, measure=lambda out: (out.tokens, think_closed)))
    return stages, calls


def test_one_flow_decides_the_stages():
    p = policy()
    budget = p.think_budget("k")
    # no policy: one request up to the hard cap, seeded as asked
    stages, calls = _staged(None, "k", first_ends="length")
    assert calls == [("first", RECIPE.rollout.max_new_tokens, 5)] and stages.truncated and not stages.interrupted
    # ended on its own within the budget: one request, not truncated
    stages, calls = _staged(p, "k", first_ends="stop")
    assert calls == [("first", budget, 5)] and stages.second is None and not stages.truncated
    # stopped at the budget, thinking open: the phrase and the answer budget, seeded seed + 1
    stages, calls = _staged(p, "k", first_ends="length", second_ends="length")
    assert calls[1] == ("second", budget, p.continuation(generated_tokens=budget, think_closed=False), 6)
    assert stages.interrupted and stages.truncated and stages.last is stages.second
    # thinking closed: no phrase, the rest of the hard cap, not interrupted
    stages, calls = _staged(p, "k", first_ends="length", think_closed=True, seed=None)
    assert calls[1][2].append_ids == () and calls[1][3] is None and not stages.interrupted and not stages.truncated
