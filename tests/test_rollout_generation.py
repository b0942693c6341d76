"""The recipe's length-control setting picks the generation policy; the thinking-closed check on token ids."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.rollout.generation import contains, length_control_policy


def _tokenizer() -> PreTrainedTokenizerFast:
    words = "Okay , time is up . Let me stop thinking and formulate a final answer now </think>".split()
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(words))}},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def test_interruption_setting_builds_the_recipes_policy():
    recipe = load_recipe("scalerl", model_preset="tiny_moe")
    policy = length_control_policy(recipe, _tokenizer())
    control = recipe.algorithm.length_control
    tokenizer = _tokenizer()
    assert policy.phrase_ids == tuple(tokenizer.encode(control.interruption_phrase, add_special_tokens=False))
    assert policy.phrase_ids[-1] == tokenizer.convert_tokens_to_ids("</think>")  # the phrase closes thinking
    assert (policy.answer_budget, policy.max_new_tokens) == (control.answer_budget, recipe.rollout.max_new_tokens)
    assert control.think_budget_min <= policy.think_budget("p/0") <= control.think_budget_max


def test_length_penalty_and_none_generate_in_one_request():
    for mode in ("length_penalty", "none"):
        recipe = load_recipe("scalerl", [f"algorithm.length_control.mode={mode}"], model_preset="tiny_moe")
        assert length_control_policy(recipe, _tokenizer()) is None


def test_contains_finds_a_contiguous_run():
    assert contains([5, 1, 2, 3], [2, 3]) and not contains([5, 2, 9, 3], [2, 3]) and not contains([1, 2], [])
