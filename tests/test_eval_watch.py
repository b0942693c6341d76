"""The eval watcher's settings: a flag, then a SCALERL_EVAL_* variable, then the run's recipe (`eval:`), then the
built-in default; the shipped presets' defaults. The watcher on real checkpoints: tests/test_eval_harness.py."""

from pathlib import Path

import pytest

from megatron_scalerl.errors import UserError
from megatron_scalerl.evaluation.watch import evaluated_recipe, watch_settings
from megatron_scalerl.recipe import PRESET_DIR, load_recipe

SCALERL = load_recipe("scalerl")


def test_a_flag_wins_over_its_variable_which_wins_over_the_recipe():
    env = {"SCALERL_EVAL_EVERY": "50", "SCALERL_EVAL_DATASETS": "aime24 aime25", "SCALERL_EVAL_SAMPLES": "4",
           "SCALERL_EVAL_ONCE": "1"}
    flags = watch_settings(SCALERL.eval, env, every=7, datasets=["x.jsonl"], samples=2, once=True)
    assert (flags.every, flags.datasets, flags.samples, flags.once) == (7, ("x.jsonl",), 2, True)
    assert [flags.sources[k] for k in ("every", "datasets", "samples", "once")] == ["--every", "--dataset",
                                                                                   "--samples", "--once"]
    given = watch_settings(SCALERL.eval, env, every=7)
    assert (given.every, given.datasets, given.samples, given.once) == (7, ("aime24", "aime25"), 4, True)
    assert given.sources == {"every": "--every", "datasets": "SCALERL_EVAL_DATASETS", "samples": "SCALERL_EVAL_SAMPLES",
                             "once": "SCALERL_EVAL_ONCE", "temperature": "recipe eval.temperature",
                             "max_new_tokens": "recipe eval.max_new_tokens"}
    recipe = watch_settings(SCALERL.eval, {"SCALERL_EVAL_EVERY": " ", "SCALERL_EVAL_ONCE": "0"})  # blank: not set
    assert (recipe.every, recipe.datasets, recipe.samples, recipe.once) == (100, ("aime24",), 16, False)
    assert recipe.describe() == (
        "eval settings: every 100 steps (recipe eval.interval_steps), datasets aime24 (recipe eval.benchmarks), "
        "samples 16 (recipe eval.samples_per_problem), temperature 1 (recipe eval.temperature), max_new_tokens 14336 "
        "(recipe eval.max_new_tokens), once no (SCALERL_EVAL_ONCE)")
    assert watch_settings(SCALERL.eval, {}).sources["once"] == "default"


@pytest.mark.parametrize("flags, env, message", [
    ({"every": 0}, {}, "--every: 0 is not a whole number >= 1"),
    ({}, {"SCALERL_EVAL_SAMPLES": "many"}, "SCALERL_EVAL_SAMPLES: 'many' is not a whole number >= 1"),
    ({}, {"SCALERL_EVAL_ONCE": "yes"}, "SCALERL_EVAL_ONCE: 'yes' must be 1 (one pass) or 0"),
])
def test_a_bad_setting_names_where_it_came_from(flags, env, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        watch_settings(SCALERL.eval, env, **flags)


@pytest.mark.parametrize("preset", sorted(p.stem for p in Path(PRESET_DIR).glob("*.yaml")))
def test_the_shipped_presets_evaluate_as_their_eval_section_says_and_as_they_train(preset):
    recipe = load_recipe(preset)
    settings = watch_settings(recipe.eval, {})
    assert (settings.every, list(settings.datasets), settings.samples) == (
        recipe.eval.interval_steps, recipe.eval.benchmarks, recipe.eval.samples_per_problem)
    evaluated = evaluated_recipe(recipe, settings)
    assert (evaluated.rollout.temperature, evaluated.rollout.max_new_tokens) == (recipe.eval.temperature,
                                                                                 recipe.eval.max_new_tokens)
    # what the watcher sampled before it read the eval section: the rollout's own settings (the demo's cap is 96)
    assert (recipe.eval.temperature, recipe.eval.max_new_tokens) == (recipe.rollout.temperature,
                                                                     recipe.rollout.max_new_tokens)
    assert evaluated.model_copy(update={"rollout": recipe.rollout}) == recipe
