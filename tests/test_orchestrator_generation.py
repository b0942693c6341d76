"""The recipe's length-control setting picks the generation policy; the thinking-closed check on token ids; an
interrupted sample's two requests joined on token ids, and an environment's turns inside the stages: budgets, the
cap, stops (a fake fleet; against a real server: tests/test_environments.py)."""

from __future__ import annotations

import asyncio

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megatron_scalerl.algo.length_control import InterruptionPolicy
from megatron_scalerl.algo.versions import NO_VERSION
from megatron_scalerl.inference.fleet import Generation, GenerationRequest
from megatron_scalerl.orchestrator.generation import ToolLoop, contains, generate_sample
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.tasks.environments import Episode, Observation


def _tokenizer() -> PreTrainedTokenizerFast:
    words = "Okay , time is up . Let me stop thinking and formulate a final answer now </think>".split()
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(words))}},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def test_interruption_setting_builds_the_recipes_policy():
    recipe = load_recipe("scalerl", model_preset="tiny_moe")
    policy = InterruptionPolicy.from_recipe(recipe, _tokenizer())
    control = recipe.algorithm.length_control
    tokenizer = _tokenizer()
    assert policy.phrase_ids == tuple(tokenizer.encode(control.interruption_phrase, add_special_tokens=False))
    assert policy.phrase_ids[-1] == tokenizer.convert_tokens_to_ids("</think>")  # the phrase closes thinking
    assert (policy.answer_budget, policy.max_new_tokens) == (control.answer_budget, recipe.rollout.max_new_tokens)
    assert control.think_budget_min <= policy.think_budget("p/0") <= control.think_budget_max


def test_length_penalty_and_none_generate_in_one_request():
    for mode in ("length_penalty", "none"):
        recipe = load_recipe("scalerl", [f"algorithm.length_control.mode={mode}"], model_preset="tiny_moe")
        assert InterruptionPolicy.from_recipe(recipe, _tokenizer()) is None


def test_contains_finds_a_contiguous_run():
    assert contains([5, 1, 2, 3], [2, 3]) and not contains([5, 2, 9, 3], [2, 3]) and not contains([1, 2], [])


class _FakeFleet:
    """Answers each request with `max_tokens` tokens (ids 1, 2, ...) of version 4, stopping on its limit."""

    def __init__(self):
        self.requests = []

    async def generate(self, request, *, server=None):
        self.requests.append((request, server))
        n = request.max_tokens
        return Generation(request.key, request.prompt_ids, list(range(1, n + 1)), [-0.5] * n, [4] * n, "length",
                          server or "http://gen0")


def test_an_interrupted_sample_joins_its_stages_on_token_ids():
    policy = InterruptionPolicy(think_budget_min=6, think_budget_max=6, phrase_ids=[90, 91], phrase_token_reserve=2,
                                answer_budget=3, max_new_tokens=11, seed=0)
    fleet = _FakeFleet()
    request = GenerationRequest("p/0", [7, 8], max_tokens=11, seed=10)
    sample = asyncio.run(generate_sample(fleet, request, policy, think_close_ids=[99]))
    (first, _), (second, server) = fleet.requests
    assert (first.max_tokens, first.seed) == (6, 10)
    assert (second.key, second.max_tokens, second.seed, server) == ("p/0#answer", 3, 11, "http://gen0")
    assert second.prompt_ids == [7, 8, 1, 2, 3, 4, 5, 6, 90, 91]
    assert sample.completion_ids == [1, 2, 3, 4, 5, 6, 90, 91, 1, 2, 3]
    assert sample.versions == [4] * 6 + [NO_VERSION] * 2 + [4] * 3
    assert sample.loss_mask == [True] * 6 + [False] * 2 + [True] * 3
    assert sample.logprobs == [-0.5] * 6 + [0.0] * 2 + [-0.5] * 3
    assert sample.interrupted and sample.truncated and sample.finish_reason == "length"


class _StoppingFleet:
    """Answers each request with tokens 1, 2, 3, ... up to `max_tokens`, stopping after a token among the request's
    stop_token_ids (version 4, log-prob -0.5 each)."""

    def __init__(self):
        self.requests = []

    async def generate(self, request, *, server=None):
        self.requests.append(request)
        tokens = []
        for token in range(1, request.max_tokens + 1):
            tokens.append(token)
            if token in request.stop_token_ids:
                break
        reason = "stop" if tokens[-1] in request.stop_token_ids else "length"
        ran = range(request.routes_from, len(request.prompt_ids) + len(tokens) - 1)  # the positions it ran first
        routes = torch.tensor(list(ran), dtype=torch.uint8).view(-1, 1, 1) if request.route_layers else None
        return Generation(request.key, request.prompt_ids, tokens, [-0.5] * len(tokens), [4] * len(tokens), reason,
                          "http://gen0", routes=routes)


class _Answering(Episode):
    def __init__(self):
        self.seen = []

    def step(self, completion_ids):
        self.seen.append(list(completion_ids))
        return Observation((90, 91, 92))


def test_budgets_count_the_models_tokens_and_the_cap_counts_observations_too():
    policy = InterruptionPolicy(think_budget_min=12, think_budget_max=12, phrase_ids=[80, 81], phrase_token_reserve=2,
                                answer_budget=4, max_new_tokens=40, seed=0)
    fleet, episode = _StoppingFleet(), _Answering()
    tools = ToolLoop(episode, ((5,),), max_calls=2, where="test")
    sample = asyncio.run(generate_sample(fleet, GenerationRequest("p/0", [7], max_tokens=40), policy,
                                         think_close_ids=[99], tools=tools))
    assert [r.key for r in fleet.requests] == ["p/0", "p/0#t1", "p/0#t2", "p/0#answer"]
    assert [r.max_tokens for r in fleet.requests] == [12, 7, 2, 4]  # 12 model tokens thinking, then the answer's 4
    assert [bool(r.stop_token_ids) for r in fleet.requests] == [True, True, False, False]  # deaf after 2 calls
    obs, phrase = [90, 91, 92], [80, 81]
    assert sample.completion_ids == [1, 2, 3, 4, 5, *obs, 1, 2, 3, 4, 5, *obs, 1, 2, *phrase, 1, 2, 3, 4]
    assert fleet.requests[-1].prompt_ids == [7, *sample.completion_ids[:-4]]
    assert sample.loss_mask == [True] * 5 + [False] * 3 + [True] * 5 + [False] * 3 + [True] * 2 + [False] * 2 + [
        True] * 4
    assert episode.seen == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, *obs, 1, 2, 3, 4, 5]]
    assert (sample.tool_calls, sample.observation_tokens, sample.interrupted, sample.truncated) == (2, 6, True, True)

    # the hard cap counts observations: one that would leave the model no room ends the sample, cut, without it
    capped = asyncio.run(generate_sample(_StoppingFleet(), GenerationRequest("p/1", [7], max_tokens=8),
                                         tools=ToolLoop(_Answering(), ((5,),), max_calls=2, where="test")))
    assert capped.completion_ids == [1, 2, 3, 4, 5] and capped.truncated and capped.tool_calls == 0


def test_a_sample_that_ends_with_an_observation_has_routes_for_every_position():
    """Each stage's budget spent at a call: the observation is appended and no request runs it (the answer stage's,
    at the end of the sample). Every position has routes all the same: the ones requests ran, in order, and those
    no request ran (the final token, the closing observation) repeating the last."""
    policy = InterruptionPolicy(think_budget_min=12, think_budget_max=12, phrase_ids=[80, 81], phrase_token_reserve=2,
                                answer_budget=4, max_new_tokens=40, seed=0)
    fleet = _StoppingFleet()
    sample = asyncio.run(generate_sample(fleet, GenerationRequest("p/0", [7], max_tokens=40, route_layers=(0,)),
                                         policy, think_close_ids=[99],
                                         tools=ToolLoop(_Answering(), ((4,),), max_calls=5, where="test")))
    obs, phrase = [90, 91, 92], [80, 81]
    assert sample.completion_ids == [*([1, 2, 3, 4, *obs] * 3), *phrase, 1, 2, 3, 4, *obs]
    assert sample.tool_calls == 4 and sample.truncated
    length = 1 + len(sample.completion_ids)
    ran = length - 1 - len(obs)  # every position but the final observation and the final token
    assert sample.routes.shape == (length, 1, 1)
    assert sample.routes.flatten().tolist() == [*range(ran), *[ran - 1] * (length - ran)]


def test_a_stop_token_without_its_whole_sequence_lets_the_model_write_on():
    fleet, episode = _StoppingFleet(), _Answering()
    sample = asyncio.run(generate_sample(fleet, GenerationRequest("p/0", [7], max_tokens=9),
                                         tools=ToolLoop(episode, ((4, 3),), max_calls=2, where="test")))
    assert episode.seen == [] and sample.completion_ids == [1, 2, 3, 1, 2, 3, 1, 2, 3]  # ends "3", never "4, 3"
    assert [r.prompt_ids for r in fleet.requests] == [[7], [7, 1, 2, 3], [7, 1, 2, 3, 1, 2, 3]]
