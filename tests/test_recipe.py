"""Recipe presets, composition, overrides and validation errors."""

import pytest

from megatron_scalerl import recipe as rc
from megatron_scalerl.errors import RecipeError, UserError

ALL_PRESETS = rc.preset_names()
LOO = [n for n in ALL_PRESETS if n.startswith("loo_")]


def test_expected_presets_exist():
    assert {"scalerl", "deepseek_grpo", "qwen_dapo", "magistral", "minimax_m1"} <= set(ALL_PRESETS)
    assert len(LOO) == 8
    assert set(rc.model_preset_names()) == {"llama3_8b", "llama4_scout_17b_16e", "tiny_dense", "tiny_moe", "tiny_qwen3",
                                            "tiny_qwen3_moe", "qwen3_8b", "qwen3_30b_a3b", "qwen3_235b_a22b",
                                            "tiny_deepseek_v3", "moonlight_16b_a3b", "deepseek_v3_671b"}


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_every_run_preset_validates(name):
    recipe = rc.load_recipe(name)
    assert recipe.name == name
    assert recipe.parallelism.dp is not None


@pytest.mark.parametrize("model", rc.model_preset_names())
@pytest.mark.parametrize("name", ["scalerl", "deepseek_grpo", "qwen_dapo", "magistral", "minimax_m1"])
def test_every_model_preset_composes_with_every_recipe(name, model):
    recipe = rc.load_recipe(name, model_preset=model)
    assert recipe.name == f"{name}+{model}"


def test_scalerl_holds_the_papers_values():
    r = rc.load_recipe("scalerl")
    assert r.algorithm.loss.type == "cispo" and r.algorithm.loss.eps_max == 4.0
    assert r.rollout.off_policy == "pipeline" and r.rollout.k == 8
    assert (r.rollout.prompts_per_step, r.rollout.generations_per_prompt) == (48, 16)
    assert r.samples_per_step == 768
    assert r.trainer.fp32_lm_head is True
    assert r.algorithm.advantage_norm == "batch"
    assert r.algorithm.aggregation == "prompt"
    assert r.algorithm.zero_variance_filter is True
    assert r.algorithm.no_positive_resampling.enabled and r.algorithm.no_positive_resampling.threshold == 0.9
    assert r.trainer.lr == 5e-7 and r.trainer.warmup_steps == 100 and r.trainer.lr_schedule.type == "constant"
    assert r.trainer.adam_eps == 1e-15 and r.trainer.weight_decay == 0.01
    lc = r.algorithm.length_control
    assert lc.mode == "interruption"
    assert 10_000 <= lc.think_budget_min <= lc.think_budget_max <= 12_000
    assert (lc.think_budget_min, lc.think_budget_max) == (10_000, 12_000)
    assert lc.answer_budget == 2000
    assert lc.interruption_phrase.startswith("Okay, time is up.") and lc.interruption_phrase.endswith("</think>")
    assert (r.algorithm.reward_correct, r.algorithm.reward_incorrect) == (1.0, -1.0)
    assert r.cluster.total_gpus == 80 and r.cluster.trainer_gpus == 16


def test_baselines_follow_the_papers_table():
    ds = rc.load_recipe("deepseek_grpo")
    assert (ds.algorithm.loss.type, ds.rollout.off_policy, ds.rollout.k, ds.algorithm.aggregation) == (
        "ppo_clip", "ppo", 8, "sample")
    assert (ds.algorithm.loss.clip_low, ds.algorithm.loss.clip_high, ds.samples_per_step) == (0.2, 0.2, 768)
    dapo = rc.load_recipe("qwen_dapo")
    assert (dapo.algorithm.loss.type, dapo.algorithm.loss.clip_high, dapo.samples_per_step) == ("dapo", 0.26, 1280)
    assert dapo.algorithm.zero_variance_filter and dapo.algorithm.aggregation == "prompt"
    mag = rc.load_recipe("magistral")
    assert mag.algorithm.loss.type == "dapo" and mag.rollout.off_policy == "pipeline"
    mm = rc.load_recipe("minimax_m1")
    assert mm.algorithm.loss.type == "cispo" and mm.trainer.fp32_lm_head and mm.rollout.off_policy == "ppo"
    assert mm.samples_per_step == 1280 and mm.algorithm.zero_variance_filter


@pytest.mark.parametrize("name", LOO)
def test_each_leave_one_out_variant_reverts_exactly_one_part(name):
    rows = rc.diff(rc.load_recipe("scalerl"), rc.load_recipe(name))
    parts = {path.split(".")[1] if path.startswith("algorithm.") else path.split(".")[0] + "." + path.split(".")[1]
             for path, _, _ in rows}
    assert rows, f"{name} equals scalerl"
    # one recipe component changes (a loss change: the loss section, its type and its parameters)
    assert len(parts) <= 1 or name == "loo_ppo_off_policy", rows


def test_model_presets_have_real_dimensions():
    scout = rc.load_recipe("scalerl", model_preset="llama4_scout_17b_16e").model
    assert (scout.num_layers, scout.hidden_size, scout.num_experts, scout.moe_router_topk) == (48, 5120, 16, 1)
    assert (scout.attention_chunk_size, scout.nope_layer_interval, scout.use_qk_norm) == (8192, 4, True)
    dense = rc.load_recipe("scalerl").model
    assert (dense.num_layers, dense.hidden_size, dense.ffn_hidden_size, dense.vocab_size) == (32, 4096, 14336, 128256)
    for tiny in ("tiny_dense", "tiny_moe"):
        m = rc.load_recipe("scalerl", model_preset=tiny).model
        assert m.head_dim >= 32
        if m.attention_chunk_size:
            assert m.attention_chunk_size % 32 == 0


def test_overrides_apply_last_and_parse_numbers():
    r = rc.load_recipe("scalerl", ["trainer.lr=1e-6", "rollout.k=4", "algorithm.zero_variance_filter=false"])
    assert r.trainer.lr == 1e-6 and r.rollout.k == 4 and r.algorithm.zero_variance_filter is False


def test_recipe_file_composes_base_model_and_own_keys(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: qwen_dapo\nmodel_preset: tiny_moe\ntrainer:\n  lr: 3e-5\n")
    r = rc.load_recipe(path, ["trainer.warmup_steps=7"])
    assert r.name == "mine" and r.algorithm.loss.type == "dapo" and r.model.arch == "llama4"
    assert r.trainer.lr == 3e-5 and r.trainer.warmup_steps == 7
    assert r.rollout.prompts_per_step == 4  # the tiny model preset's value overrides the base's 80


def test_resolved_recipe_round_trips_without_base(tmp_path):
    r = rc.load_recipe("scalerl", model_preset="tiny_moe")
    path = tmp_path / "recipe.yaml"
    path.write_text(r.to_yaml())
    assert rc.load_recipe(path) == r


@pytest.mark.parametrize(
    "overrides, path, fragment",
    [
        (["trainer.lrr=1"], "trainer.lrr", "unknown key"),
        (["trainer.lr=abc"], "trainer.lr", "valid number"),
        (["trainer.lr=-1"], "trainer.lr", "greater than 0"),
        (["rollout.k=0"], "rollout.k", "greater than or equal to 1"),
        (["algorithm.loss=ppo"], "algorithm.loss", "cispo"),
        (["parallelism.tp=3"], "parallelism.tp", "does not divide model.num_attention_heads"),
        (["parallelism.tp=16", "cluster.trainer_nodes=2"], "parallelism.tp", "num_query_groups"),
        (["algorithm.length_control.think_budget_max=13000"], "algorithm.length_control.think_budget_max", "exceeds"),
        (["algorithm.length_control.think_budget_min=12500"], "algorithm.length_control.think_budget_min", ">"),
        (["parallelism.ep=2"], "parallelism.ep", "needs an MoE model"),
        (["parallelism.dp=3"], "parallelism.dp", "trainer GPUs"),
        (["parallelism.generator_tp=3", "cluster.generator_nodes=3"], "parallelism.generator_tp",
         "neither divides cluster.gpus_per_node=8"),
        (["parallelism.generator_tp=12", "cluster.generator_nodes=3"], "parallelism.generator_tp",
         "nor is a multiple of it"),
        (["algorithm.loss=ppo_clip", "algorithm.clip_high=0.26"], "algorithm.loss.clip_high", "symmetric clip"),
    ],
)
def test_validation_errors_name_the_path(overrides, path, fragment):
    with pytest.raises(RecipeError) as info:
        rc.load_recipe("scalerl", overrides)
    assert info.value.path == path, str(info.value)
    assert fragment in str(info.value)


def test_moe_rules():
    with pytest.raises(RecipeError, match="parallelism.ep: ep=3 does not divide model.num_experts=4"):
        rc.load_recipe("scalerl", ["parallelism.ep=3", "cluster.gpus_per_node=3"], model_preset="tiny_moe")
    with pytest.raises(RecipeError, match="sequence_parallel"):
        rc.load_recipe("scalerl", ["parallelism.tp=2", "cluster.gpus_per_node=2"], model_preset="tiny_moe")
    r = rc.load_recipe("scalerl", ["parallelism.tp=2", "parallelism.ep=2", "parallelism.sequence_parallel=true",
                                   "cluster.gpus_per_node=4"], model_preset="tiny_moe")
    assert (r.parallelism.tp, r.parallelism.ep, r.parallelism.dp) == (2, 2, 2)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(UserError, match="bad.yaml: invalid YAML"):
        rc.load_recipe(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(RecipeError, match="top level must be a mapping"):
        rc.load_recipe(lst)
    cyc = tmp_path / "cyc.yaml"
    cyc.write_text("base: nosuch\n")
    with pytest.raises(RecipeError, match="unknown base preset 'nosuch'"):
        rc.load_recipe(cyc)
    with pytest.raises(RecipeError, match="recipe file not found"):
        rc.load_recipe(tmp_path / "missing.yaml")
    incomplete = tmp_path / "incomplete.yaml"
    incomplete.write_text("name: x\n")
    with pytest.raises(RecipeError, match="missing required key"):
        rc.load_recipe(incomplete)


def test_a_runs_recipe_has_one_loader_naming_the_run_directory_and_the_file(tmp_path):
    from megatron_scalerl.run.directory import RECIPE_FILE

    with pytest.raises(UserError, match=f"^{tmp_path}: no recipe.yaml, not a run directory"):
        rc.load_run_recipe(tmp_path, RECIPE_FILE)
    assert rc.load_run_recipe(tmp_path, RECIPE_FILE, missing_ok=True) is None
    written = rc.load_recipe("demo")
    (tmp_path / RECIPE_FILE).write_text(written.to_yaml())
    assert rc.load_run_recipe(tmp_path, RECIPE_FILE) == written
    assert rc.load_run_recipe(tmp_path, RECIPE_FILE, ["trainer.lr=0.5"]).trainer.lr == 0.5  # a trainer's --set
    (tmp_path / RECIPE_FILE).write_text(written.to_yaml().replace("  lr: ", "  lr: -"))
    with pytest.raises(RecipeError, match=f"^{tmp_path / RECIPE_FILE}: trainer.lr: "):
        rc.load_run_recipe(tmp_path, RECIPE_FILE)


@pytest.mark.parametrize("model", rc.model_preset_names())
def test_an_hf_init_is_checked_against_the_model_section_field_by_field(tmp_path, model):
    """Every model preset's own config.json (as `scalerl convert` and the demo write it) passes; one that differs
    in two fields is refused naming the file and both, each with the recipe's value and config.json's."""
    import json

    from megatron_scalerl import families

    recipe = rc.load_recipe("scalerl", [f"trainer.init_from={tmp_path}"], model_preset=model)
    rc.require_init_from_matches(recipe)  # a directory without config.json (a Megatron checkpoint): not this check
    config = families.hf_config_dict(recipe.model)
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc.require_init_from_matches(recipe)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "rms_norm_eps": 0.5}))
    with pytest.raises(UserError, match=rf"^trainer.init_from: {tmp_path / 'config.json'} describes another model "
                       rf"than the recipe's model section \(2 field\(s\) differ\): model.norm_eps: "
                       rf"{recipe.model.norm_eps!r} in the recipe, 0.5 in config.json; model.num_layers: "
                       rf"{recipe.model.num_layers} in the recipe, 2 in config.json; "):
        rc.require_init_from_matches(recipe)
