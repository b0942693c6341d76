"""A recipe that explains itself: every field described with its unit, `scalerl recipe explain`, `show --explain`, and
the nearest known keys named for an unknown one."""

import json
import re
from pathlib import Path
from typing import get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from megatron_scalerl import recipe as rc
from megatron_scalerl.commands import main
from megatron_scalerl.errors import RecipeError
from megatron_scalerl.recipe import RopeScaling
from megatron_scalerl.recipe import explain as ex
from megatron_scalerl.recipe.schema import NoPositiveResamplingConfig, Recipe
from megatron_scalerl.recipe.sources import DataSource, LocalBenchmark
from megatron_scalerl.recipe.variants import Cispo, CosineSchedule, Dapo, Interruption, LengthPenalty

# A number's description names what it counts or measures in one of these words.
UNITS = ("tokens", "steps", "GPUs", "GPU-hours", "nodes", "samples", "prompts", "problems", "layers", "features",
         "count", "seconds", "minutes", "fraction", "ratio", "dimensionless", "reward", "norm", "times", "stages",
         "replicas", "MiB", "no unit")


def _held(annotation) -> set:
    """Every class an annotation holds, through Optional, unions, lists, Annotated and discriminated unions."""
    out = {annotation} if isinstance(annotation, type) else set()
    for arg in get_args(annotation):
        out |= _held(arg)
    return out


def _fields(cls: type[BaseModel], seen: set) -> list:
    """(class, name, FieldInfo) of every field of `cls` and of every section reachable from it."""
    seen.add(cls)
    out = []
    for name, info in cls.model_fields.items():
        out.append((cls, name, info))
        for held in _held(info.annotation):
            if issubclass(held, BaseModel) and held not in seen:
                out += _fields(held, seen)
    return out


def test_every_field_has_a_one_line_description_with_its_unit():
    seen: set = set()
    fields = _fields(Recipe, seen)
    assert {RopeScaling, NoPositiveResamplingConfig, Interruption, LengthPenalty, Cispo, Dapo, CosineSchedule,
            DataSource, LocalBenchmark} <= seen
    missing = [f"{cls.__name__}.{name}" for cls, name, info in fields
               if not (info.description or "").strip() or "\n" in info.description]
    assert not missing, f"fields without a one-line description: {missing}"
    numbers = [(cls, name, info) for cls, name, info in fields
               if _held(info.annotation) & {int, float} and get_origin(info.annotation) is not dict]
    unitless = [f"{cls.__name__}.{name}: {info.description}" for cls, name, info in numbers
                if not any(unit in info.description for unit in UNITS)]
    assert len(numbers) > 80 and not unitless, f"numbers whose description names no unit: {unitless}"
    # explain walks the same fields: a key per field, none left out (one key for a field the alternatives of a
    # variant section share: algorithm.loss.type, algorithm.loss.eps_max of cispo and tis_reinforce)
    keys = rc.schema_keys()
    assert {name for _, name, _ in fields} == {path.rpartition(".")[2].removesuffix("[]") for path in keys}
    assert {"algorithm.loss.type", "algorithm.loss.eps_max", "algorithm.loss.clip_high", "trainer.lr_schedule.min_lr",
            "algorithm.length_control.mode", "algorithm.length_control.penalty_max_len"} <= set(keys)
    assert keys["algorithm.loss.type"].type_text == "one of cispo, tis_reinforce, ppo_clip, dapo, gspo"


@pytest.fixture(scope="module")
def presets():
    return rc.preset_catalogue()


def test_explain_a_model_key_shows_its_presets_and_rules(presets):
    e = rc.explain_key("model.num_layers", presets)
    assert e.key.description == "transformer layers (count)" and e.key.type_text == "int > 0"
    assert e.default == 32 and e.origin.startswith("recipes/models/llama3_8b.yaml")  # scalerl.yaml's model preset
    models, runs = dict(e.models), dict(e.presets)
    assert models["qwen3_8b"] == 36 and models["tiny_dense"] == 4 and "llama3_8b" not in models
    assert runs["demo"] == 4 and runs["scalerl_r3"] == 48 and "loo_dapo_loss" not in runs
    assert any(r.target == "parallelism.pp" and "model.num_layers" in r.reads for r in e.rules)
    text = e.text()
    assert text.startswith("model.num_layers: transformer layers (count)\n  type     int > 0\n  default  32")
    assert "qwen3_8b 36" in text and "layout_problems: parallelism.pp: pp={p.pp} does not divide" in text


def test_explain_default_comes_from_scalerl_yaml_with_its_comment(presets):
    e = rc.explain_key("trainer.lr", presets)
    assert e.default == 5e-7 and e.origin.startswith("recipes/scalerl.yaml: paper: constant 5e-7")
    assert e.key.type_text == "float > 0" and dict(e.presets) == {"demo": 1e-4, "demo_length_cap": 1e-4, "demo_mix": 1e-4,
                                                                "demo_short_thinking": 1e-4, "demo_smollm2": 2e-5, "demo_tools": 1e-4,
                                                                "demo_synchronous": 1e-4}
    assert [r.function for r in e.rules] == ["_lr_range"]  # the schema's own validator reads trainer.lr
    assert rc.explain_key("trainer.keep_every", presets).origin.startswith("recipes/scalerl.yaml: e.g. 500")
    assert rc.explain_key("model.moe_router_topk", presets).origin == "the schema's default"
    assert rc.schema_keys()["rollout.top_p"].type_text == "float in (0, 1]"
    assert rc.schema_keys()["forecast.target"].type_text == "float in [0, 1] or null"


def test_list_items_and_sections(presets):
    e = rc.explain_key("data.train.kind", presets)  # = data.train[].kind = data.train[0].kind
    assert e.key.path == "data.train[].kind" and rc.explain_key("data.train[0].kind", presets).key == e.key
    assert e.default == "jsonl" and dict(e.presets)["demo_mix"] == ["reasoning_gym", "synthetic"]
    assert {r.target for r in e.rules} == {"data.train[]"}  # DataSource's validator: kind needs path / task
    section = rc.explain_key("algorithm.length_control", presets)
    assert [k.path.rsplit(".", 1)[1] for k in section.inside][:3] == ["mode", "think_budget_min", "think_budget_max"]
    assert "loo_length_penalty" in dict(section.presets)
    assert "algorithm.length_control.mode" in section.text()
    union = rc.explain_key("eval.benchmarks.name", presets)  # a discriminated union's section member
    assert union.key.path == "eval.benchmarks[].name" and union.rules


@pytest.mark.parametrize("override, flagged, explained", [
    ("parallelism.tp=3", "parallelism.tp", "parallelism.tp"),
    ("rollout.max_new_tokens=1000", "algorithm.length_control.think_budget_max", "rollout.max_new_tokens"),
    ("algorithm.reward_correct=-2", "algorithm.reward_correct", "algorithm.reward_incorrect"),
    ("cluster.generator_nodes=3", "parallelism.generator_tp", "cluster.gpus_per_node"),
])
def test_the_rule_a_recipe_breaks_is_among_those_its_keys_explain(presets, override, flagged, explained):
    """The rules are read from rules.py's source: the one that refuses a recipe must be among the rules
    `explain` lists for the keys it reads."""
    base = ["parallelism.generator_tp=16"] if override.startswith("cluster.") else []
    with pytest.raises(RecipeError) as err:
        rc.load_recipe("scalerl", [*base, override])
    assert err.value.path == flagged
    assert flagged in {r.target for r in rc.explain_key(explained, presets).rules}


def test_every_rule_names_and_reads_schema_keys():
    keys = rc.schema_keys()
    rules = ex.recipe_rules()
    source = Path(rc.loading.cross_field_problems.__code__.co_filename).read_text()
    assert sum(r.where.startswith("recipe/rules.py") for r in rules) == source.count("out.append((")
    for rule in rules:
        assert rule.target in keys or rule.target.removesuffix("[]") in keys, rule
        assert rule.reads and rule.reads <= set(keys), rule


def test_cli_explain(capsys):
    assert main(["recipe", "explain", "parallelism.tp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("parallelism.tp: trainer tensor parallelism (GPUs per tensor-parallel group)\n")
    assert "rules    recipe/rules.py:" in out and "qwen3_235b_a22b 4" in out
    assert main(["recipe", "explain", "trainer.lr", "rollout.k", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [k["key"] for k in data["keys"]] == ["trainer.lr", "rollout.k"] and data["keys"][1]["default"] == 8
    assert main(["recipe", "explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(rc.schema_keys()) and lines[0].split()[0] == "name"
    assert main(["recipe", "explain", "trainer.lrr"]) == 2
    assert capsys.readouterr().err == "error: trainer.lrr: unknown key; did you mean trainer.lr?\n"


KEY_LINE = re.compile(r"^\s*(?:- )?([A-Za-z0-9_]+):")


def test_show_explain_annotates_every_key_line(capsys):
    descriptions: dict[str, set] = {}
    for _, name, info in _fields(Recipe, set()):
        descriptions.setdefault(name, set()).add(info.description)
    assert main(["recipe", "show", "scalerl"]) == 0
    plain = capsys.readouterr().out.splitlines()
    assert main(["recipe", "show", "scalerl", "--explain"]) == 0
    annotated = capsys.readouterr().out
    assert yaml.safe_load(annotated) == yaml.safe_load("\n".join(plain))
    lines = annotated.splitlines()
    assert len(lines) == len(plain)
    for before, after in zip(plain, lines, strict=True):
        assert after.startswith(before)
        match = KEY_LINE.match(before)
        if match:  # the comment is the description of a field of that name
            assert after.split("  # ", 1)[1] in descriptions[match.group(1)], after
        else:  # list items that are plain values (eval.benchmarks)
            assert after == before and before.lstrip().startswith("- ")
    assert "    kind: jsonl" in annotated and "# jsonl or parquet file" in annotated
    assert main(["recipe", "show", "demo", "--explain", "--json"]) == 2


def test_unknown_yaml_keys_name_the_nearest(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("base: scalerl\ntrainer:\n  lrr: 1.0e-6\n")
    with pytest.raises(RecipeError, match=r"trainer\.lrr: unknown key; did you mean trainer\.lr\?$"):
        rc.load_recipe(str(bad))
    bad.write_text("base: scalerl\ndata:\n  train:\n    - kind: jsonl\n      pathh: x.jsonl\n")
    with pytest.raises(RecipeError, match=r"data\.train\[0\]\.pathh: unknown key; did you mean data\.train\[0\]\.path\?"):
        rc.load_recipe(str(bad))


@pytest.mark.parametrize("override, message", [
    ("rollout.temprature=0.7", "rollout.temprature: unknown key; did you mean rollout.temperature?"),
    ("trainer.temperature=0.7", "trainer.temperature: unknown key; did you mean rollout.temperature, "
                                "eval.temperature?"),
    ("traner.lr=1e-6", "traner: unknown key; did you mean trainer.lr, trainer?"),
    ("zzz=1", "zzz: unknown key"),
])
def test_unknown_override_names_the_nearest(capsys, override, message):
    assert main(["recipe", "show", "scalerl", "--set", override]) == 2
    assert capsys.readouterr().err == f"error: scalerl: {message}\n"
