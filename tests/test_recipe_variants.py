"""The recipe's variant sections (recipe/variants.py): `algorithm.loss`, `trainer.lr_schedule` and
`algorithm.length_control`, each a choice of alternatives with their own fields, and the spellings from before
them, which load to the same recipe."""

import json
from pathlib import Path

import pytest
import yaml

from megatron_scalerl import recipe as rc
from megatron_scalerl.errors import RecipeError
from megatron_scalerl.recipe.variants import (
    Cispo,
    CosineSchedule,
    Dapo,
    Gspo,
    LengthPenalty,
    NoLengthControl,
    PpoClip,
    respell_flat,
)

BEFORE = Path(__file__).parent / "data" / "recipes_before_variants"

# RUN/recipe.yaml files the code wrote before the sections (flat eps_max / clip_low / clip_high beside a loss name,
# flat min_lr beside the schedule's name, every length-control field whatever the mode): how each was made
WRITTEN_BEFORE = {
    "scalerl": ("scalerl", []),
    "deepseek_grpo": ("deepseek_grpo", []),
    "qwen_dapo_cosine": ("qwen_dapo", ["trainer.lr_schedule=cosine", "trainer.min_lr=1e-8"]),
    "gspo_length_penalty": ("scalerl", ["algorithm.loss=gspo", "algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4",
                                        "algorithm.length_control.mode=length_penalty"]),
    "tis_reinforce_demo": ("demo_length_cap", ["algorithm.loss=tis_reinforce", "algorithm.eps_max=2.5"]),
}


@pytest.mark.parametrize("name", sorted(WRITTEN_BEFORE))
def test_a_recipe_written_before_the_sections_loads_to_the_same_recipe(name):
    old = yaml.safe_load((BEFORE / f"{name}.yaml").read_text())
    assert isinstance(old["algorithm"]["loss"], str) and "eps_max" in old["algorithm"]  # the old spelling
    preset, overrides = WRITTEN_BEFORE[name]
    before = rc.load_recipe(BEFORE / f"{name}.yaml")
    assert before.model_copy(update={"name": preset}) == rc.load_recipe(preset, overrides).model_copy(
        update={"name": preset})


def test_old_recipe_files_hold_each_alternative():
    loaded = {name: rc.load_recipe(BEFORE / f"{name}.yaml") for name in WRITTEN_BEFORE}
    assert {type(r.algorithm.loss).__name__ for r in loaded.values()} == {
        "Cispo", "PpoClip", "Dapo", "Gspo", "TisReinforce"}
    assert loaded["gspo_length_penalty"].algorithm.loss == Gspo(clip_low=3e-4, clip_high=4e-4)
    assert loaded["gspo_length_penalty"].algorithm.length_control == LengthPenalty(
        penalty_max_len=14000, penalty_cache_len=2000)
    assert loaded["qwen_dapo_cosine"].trainer.lr_schedule == CosineSchedule(min_lr=1e-8)
    assert isinstance(loaded["tis_reinforce_demo"].algorithm.length_control, NoLengthControl)


def test_a_loaded_recipe_holds_the_chosen_alternatives_fields_only():
    data = rc.load_recipe("scalerl").to_dict()
    assert data["algorithm"]["loss"] == {"type": "cispo", "eps_max": 4.0}
    assert data["trainer"]["lr_schedule"] == {"type": "constant"}
    assert "penalty_max_len" not in data["algorithm"]["length_control"]
    assert rc.validate(data) == rc.load_recipe("scalerl")  # what RUN/recipe.yaml holds reads back the same


def test_switching_an_alternative_starts_from_the_presets_values():
    # scalerl.yaml keeps the clip losses' values beside cispo's eps_max: a switch takes them
    assert rc.load_recipe("scalerl", ["algorithm.loss=dapo"]).algorithm.loss == Dapo(clip_low=0.2, clip_high=0.2)
    assert rc.load_recipe("scalerl", ["algorithm.loss.type=ppo_clip"]).algorithm.loss == PpoClip(
        clip_low=0.2, clip_high=0.2)
    # a bare name over a section keeps its fields: loo_dapo_loss's 0.26 carries into gspo
    assert rc.load_recipe("loo_dapo_loss", ["algorithm.loss=gspo"]).algorithm.loss == Gspo(clip_low=0.2,
                                                                                           clip_high=0.26)
    # the flat spelling users type still reaches the loss, and the new one too
    assert rc.load_recipe("scalerl", ["algorithm.eps_max=5"]).algorithm.loss == Cispo(eps_max=5.0)
    assert rc.load_recipe("scalerl", ["algorithm.loss.eps_max=6"]).algorithm.loss == Cispo(eps_max=6.0)
    assert rc.load_recipe("scalerl", ["trainer.lr_schedule=cosine"]).trainer.lr_schedule == CosineSchedule(min_lr=0.0)
    lc = rc.load_recipe("scalerl", ["algorithm.length_control.mode=length_penalty"]).algorithm.length_control
    assert lc == LengthPenalty(penalty_max_len=14000, penalty_cache_len=2000)
    # a bare name over a section tagged by `mode` keeps its fields too
    assert rc.load_recipe("scalerl", ["algorithm.length_control=length_penalty"]).algorithm.length_control == lc


def test_a_file_in_the_old_spelling_over_a_preset_in_the_new(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: scalerl\nalgorithm:\n  loss: dapo\n  clip_low: 0.1\n  clip_high: 0.3\n")
    assert rc.load_recipe(path).algorithm.loss == Dapo(clip_low=0.1, clip_high=0.3)


@pytest.mark.parametrize(("overrides", "path", "fragment"), [
    (["algorithm.loss.eps_max=0.5"], "algorithm.loss.eps_max", "greater than 1"),
    (["algorithm.loss.eps_maxx=5"], "algorithm.loss.eps_maxx", "unknown key"),
    (["algorithm.loss=reinforce"], "algorithm.loss", "cispo"),
    (["algorithm.loss=dapo", "algorithm.loss.clip_low=1.5"], "algorithm.loss.clip_low", "less than 1"),
    (["trainer.lr_schedule=cosine", "trainer.lr_schedule.min_lr=1"], "trainer", "min_lr 1.0 is above lr"),
    (["algorithm.length_control.mode=length_penalty", "algorithm.length_control.penalty_cache_len=20000"],
     "algorithm.length_control.penalty_cache_len", "must be < penalty_max_len"),
])
def test_a_bad_variant_field_is_named_by_its_key(overrides, path, fragment):
    with pytest.raises(RecipeError) as info:
        rc.load_recipe("scalerl", overrides)
    assert info.value.path == path and fragment in str(info.value), str(info.value)


def test_explain_describes_each_alternative():
    keys = rc.schema_keys()
    assert keys["algorithm.loss"].type_text == "cispo | tis_reinforce | ppo_clip | dapo | gspo"
    assert keys["algorithm.length_control.mode"].type_text == "one of interruption, length_penalty, none"
    assert {"cispo:", "dapo:", "gspo:"} <= set(keys["algorithm.loss.type"].description.split())
    annotated = rc.annotate_yaml(rc.load_recipe("qwen_dapo").to_yaml())
    assert "type: dapo" in annotated and "# dapo: the clipped ratio with clip-higher" in annotated


def test_a_sweeps_base_recorded_in_the_old_spelling_is_the_same_base(tmp_path):
    """A sweep begun before the sections recorded its base's fields flat (manifest field base_recipe): read in the
    new spelling they equal the same base's fields now, so the sweep goes on starting runs."""
    from megatron_scalerl.sweep.manifest import check_base_recipe
    from megatron_scalerl.sweep.plan import base_fields

    recorded = json.loads((BEFORE / "sweep_base_recipe.json").read_text())["base_recipe"]
    assert recorded["algorithm.loss"] == "dapo" and "trainer.min_lr" in recorded
    now = base_fields(rc.resolve_dict("qwen_dapo", ["trainer.lr_schedule=cosine", "trainer.min_lr=1e-8"]))
    check_base_recipe({"base_recipe": recorded}, now, tmp_path / "sweep.json")
    assert respell_flat(recorded) == now
