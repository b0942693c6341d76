"""The demo's pieces, small: the locally built model and tokenizer, the supervised warm start, the curve plot.
(`make demo` itself is the README's main command; its figures are in the README's performance section.)"""

import json

import numpy as np
import pytest

from megatron_scalerl.recipe import load_recipe

RECIPE = load_recipe("demo")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_scalerl.demo.model import build_model

    return build_model(RECIPE, tmp_path_factory.mktemp("demo") / "random", seed=0)


def test_model_and_tokenizer_fit_the_recipe(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from megatron_scalerl.algo.length_control import InterruptionPolicy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    assert len(tokenizer) <= RECIPE.model.vocab_size == config.vocab_size
    assert config.eos_token_id == tokenizer.eos_token_id
    policy = InterruptionPolicy.from_recipe(RECIPE, tokenizer)  # the phrase fits its token reserve
    assert 0 < len(policy.phrase_ids) <= RECIPE.algorithm.length_control.phrase_token_reserve
    text = "Calculate 7 + 8. gives 15.\n</think>\n\\boxed{15}"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


def test_the_chat_template_renders_every_demo_prompt_as_the_demo_trains_on_it(model_dir):
    """The demo tokenizer's chat template (saved with it) is the plain format's: every training prompt of the demo
    and demo_mix sources (math and code templates) renders through it to the text and token ids the run trains on
    without it. A system message comes first; an assistant turn continues the opened thinking and ends with EOS;
    other roles are refused."""
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    from megatron_scalerl.tasks.problems import load_sources
    from megatron_scalerl.tasks.prompts import PLAIN_CHAT_TEMPLATE, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template == PLAIN_CHAT_TEMPLATE
    problems = [p for recipe in (RECIPE, load_recipe("demo_mix"))
                for source in load_sources(recipe.data.train, seed=recipe.trainer.seed) for p in source.problems]
    assert {p.template for p in problems} == {"math", "code"}
    for problem in problems:
        text = render_prompt(problem, tokenizer)
        assert text == render_prompt(problem, None)
        assert tokenizer(text).input_ids == tokenizer(render_prompt(problem)).input_ids
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "one and one\n</think>\n\\boxed{2}"}, {"role": "user", "content": "2+2?"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "Be brief.\n\nProblem: 1+1?\nSolution: <think>\none and one\n</think>\n\\boxed{2}<|end_of_text|>"
        "Problem: 2+2?\nSolution: <think>\n")
    with pytest.raises(TemplateError, match="not tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "4"}], tokenize=False)


def test_the_length_cap_variant_has_room_for_every_answer_but_the_negative_ones(model_dir):
    """`demo_length_cap`'s claim (`make ablation`'s ceiling change): a worked answer cut at its 16 tokens is still
    graded correct when the answer is a non-negative number, never when it is negative (about a fifth of the problems)."""
    from transformers import AutoTokenizer

    from megatron_scalerl.demo.model import solution_text
    from megatron_scalerl.tasks.problems import load_sources
    from megatron_scalerl.tasks.rewards import grade_here

    capped = load_recipe("demo_length_cap")
    cap = capped.rollout.max_new_tokens
    assert capped.algorithm.length_control.mode == "none" and capped.eval.max_new_tokens == cap
    assert capped.model_dump(exclude={"name", "rollout", "algorithm", "eval"}) == RECIPE.model_dump(
        exclude={"name", "rollout", "algorithm", "eval"})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = [p for source in load_sources(capped.data.train, seed=capped.data_seed) for p in source.problems]
    negative = 0
    for problem in problems[:400]:
        ids = tokenizer(solution_text(problem), add_special_tokens=False).input_ids
        cut = tokenizer.decode(ids[:cap])
        below_zero = float(problem.answer) < 0
        negative += below_zero
        assert grade_here(cut, problem).correct is not below_zero, (problem.problem, cut)
    assert 0.15 <= negative / 400 <= 0.3

def test_warm_start_trains_evaluates_and_writes_a_checkpoint(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_scalerl.demo.sft import warm_start

    result = warm_start(RECIPE, model_dir, tmp_path / "warm", target=2.0, max_steps=4, batch_size=4, eval_every=2,
                        eval_prompts=2, eval_samples=1)
    assert result.steps == 4 and [step for step, _ in result.history] == [2, 4]
    assert all(0.0 <= rate <= 1.0 for _, rate in result.history)
    AutoModelForCausalLM.from_pretrained(tmp_path / "warm")


def test_validation_curve_is_plotted_from_the_runs_metrics(tmp_path):
    from megatron_scalerl.demo.run import plot_validation
    from megatron_scalerl.errors import UserError

    with pytest.raises(UserError, match="no metrics.jsonl"):
        plot_validation(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "role": "trainer", "gpu_hours": 0.1}) + "\n")
    with pytest.raises(UserError, match="no row has the metric column 'val/pass_rate'"):
        plot_validation(tmp_path)
    rows = [{"step": s, "role": "orchestrator", "gpu_hours": 0.01 * (s + 1), "val/pass_rate": 0.2 + 0.02 * s}
            for s in (0, 10, 20)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_validation(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_end_of_run_forecast_uses_the_recipes_settings(tmp_path, capsys):
    """`print_forecast` (the demo's last step) on a demo-sized curve: the report printed and in RUN/forecast/, with
    the demo recipe's budgets and target."""
    from megatron_scalerl.demo.run import print_forecast

    compute = np.linspace(0.01, 0.16, 16)  # GPU-h, as the demo's 16 validations
    reward = 0.27 + 0.29 / (1 + (0.045 / compute) ** 2) + np.random.default_rng(0).normal(0, 0.02, 16)
    rows = [{"step": 10 * i, "role": "orchestrator", "gpu_hours": c, "val/pass_rate": r}
            for i, (c, r) in enumerate(zip(compute, reward, strict=True))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print_forecast(tmp_path, RECIPE)
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "forecast" / "forecast.json").read_text())
    assert [p["gpu_hours"] for p in report["predictions"]] == RECIPE.forecast.budgets
    assert [t["reward"] for t in report["targets"]] == [RECIPE.forecast.target]
    assert "wrote " in out and (tmp_path / "forecast" / "report.md").is_file()


def test_a_run_too_short_to_forecast_says_so(tmp_path, capsys):
    """`scalerl demo --steps 30`: four validations, one short of a fit; the demo says why there is no forecast and
    writes none, rather than failing after the run trained."""
    from megatron_scalerl.demo.run import print_forecast

    rows = [{"step": 10 * i, "role": "orchestrator", "gpu_hours": 0.01 * (i + 1), "val/pass_rate": 0.2 + 0.05 * i}
            for i in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print_forecast(tmp_path, RECIPE)
    out = capsys.readouterr().out
    assert "demo: no forecast: " in out and "the fit needs at least 5" in out
    assert not (tmp_path / "forecast").exists()


def test_init_only_builds_a_tiny_hf_checkpoint_with_its_tokenizer(tmp_path, capsys):
    """`scalerl demo --init-only DIR` (the README's SLURM walk): a model any run can start from (`--model hf:DIR`)."""
    from transformers import AutoConfig, AutoTokenizer

    from megatron_scalerl.commands import main

    assert main(["demo", "--init-only", str(tmp_path / "moe")]) == 0
    assert f"--model hf:{tmp_path / 'moe'}" in capsys.readouterr().out
    assert main(["demo", "--init-only", str(tmp_path / "dense"), "--model", "tiny_dense", "--seed", "3"]) == 0
    assert main(["demo", "--init-only", str(tmp_path / "qwen3_moe"), "--model", "tiny_qwen3_moe"]) == 0
    assert AutoConfig.from_pretrained(tmp_path / "moe").model_type == "llama4_text"
    assert AutoConfig.from_pretrained(tmp_path / "dense").model_type == "llama"
    assert AutoConfig.from_pretrained(tmp_path / "qwen3_moe").model_type == "qwen3_moe"
    assert len(AutoTokenizer.from_pretrained(tmp_path / "dense")) <= RECIPE.model.vocab_size
    from_dir = load_recipe("demo", model_preset=f"hf:{tmp_path / 'moe'}")
    assert from_dir.model == RECIPE.model and from_dir.trainer.init_from == str((tmp_path / "moe").resolve())
    assert main(["demo", "--init-only", str(tmp_path / "moe")]) == 2  # never over an existing model
    assert "is not an empty directory" in capsys.readouterr().err
    assert main(["demo", "--seed", "3"]) == 2
    (tmp_path / "file").write_text("x")
    assert main(["demo", "--init-only", str(tmp_path / "file")]) == 2  # a file is no model directory
    assert main(["demo", "--init-only", str(tmp_path / "new"), "--steps", "3"]) == 2


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_dense", "tiny_qwen3", "tiny_qwen3_moe", "tiny_deepseek_v3"])
def test_the_demo_recipe_on_each_tiny_model_changes_the_model_only(model):
    """`scalerl demo --model M`: the demo's own settings on M's model section (a dense model: no expert parallelism,
    the trainer processes data-parallel instead); the default is the demo recipe itself; the model cache keys on it."""
    from megatron_scalerl.demo.run import TINY_MODELS, build_settings, demo_recipe
    from megatron_scalerl.recipe import diff

    recipe = demo_recipe("demo", model)
    assert recipe.model == load_recipe("scalerl", model_preset=model).model
    changed = {path.split(".")[0] if path.startswith("model.") else path for path, _, _ in diff(RECIPE, recipe)}
    assert changed <= {"model", "parallelism.ep"}
    assert (recipe.parallelism.ep == 1) == (not recipe.model.is_moe)
    assert recipe.name == ("demo" if model == TINY_MODELS[0] else f"demo+{model}")
    assert (build_settings(recipe) == build_settings(RECIPE)) == (model == TINY_MODELS[0])
    assert demo_recipe("demo", model, ["trainer.max_steps=3"]).trainer.max_steps == 3


def test_a_cached_demo_model_is_reused_only_when_built_from_the_same_settings(tmp_path):
    from megatron_scalerl.demo.run import BUILD_RECORD, build_settings, cached_model_verdict

    settings = build_settings(RECIPE, warm_start_target=0.2)
    assert cached_model_verdict(tmp_path, settings) == (False, None)  # nothing there: build
    (tmp_path / "warm_start").mkdir()
    (tmp_path / "warm_start" / "config.json").write_text("{}")
    reuse, why = cached_model_verdict(tmp_path, settings)
    assert not reuse and "holds no record of the settings" in why
    old = build_settings(load_recipe("demo", ["model.rope_scaling.high_freq_factor=1.0"]), warm_start_target=0.2)
    (tmp_path / BUILD_RECORD).write_text(json.dumps(old))
    reuse, why = cached_model_verdict(tmp_path, settings)
    assert not reuse and "other settings (model.rope_scaling.high_freq_factor)" in why
    before_chat = {key: value for key, value in settings.items() if key != "chat_template"}
    (tmp_path / BUILD_RECORD).write_text(json.dumps(before_chat))  # a tokenizer without a chat template: rebuilt
    reuse, why = cached_model_verdict(tmp_path, settings)
    assert not reuse and "other settings (chat_template)" in why
    (tmp_path / BUILD_RECORD).write_text(json.dumps(settings)[:20])  # cut short
    reuse, why = cached_model_verdict(tmp_path, settings)
    assert not reuse and "build.json is unreadable" in why
    (tmp_path / BUILD_RECORD).write_text(json.dumps(settings))
    assert cached_model_verdict(tmp_path, settings) == (True, f"reusing the warm-started model in "
                                                              f"{tmp_path / 'warm_start'} (built from the same settings)")


def test_the_demo_ends_with_the_runs_train_inference_mismatch(tmp_path, capsys):
    """`mismatch_summary` over the trainer's steps, with routing agreement when the run captured routes; `--routing`
    maps to the recipe keys it names (and, as `--set`, belongs to the RL run, not `--init-only`)."""
    from megatron_scalerl.commands import main
    from megatron_scalerl.demo.run import ROUTING, mismatch_summary

    assert mismatch_summary(tmp_path) == "train/inference mismatch: no trainer step logged"
    rows = [{"step": s, "role": "trainer", "train/mismatch_k3": k3, "train/ratio_max": ratio}
            for s, k3, ratio in ((1, 0.002, 3.5), (2, 0.004, 12.25))]
    rows.append({"step": 2, "role": "orchestrator", "train/mismatch_k3": 9.0})  # not a trainer step
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert mismatch_summary(tmp_path) == ("train/inference mismatch over 2 steps: mismatch_k3 mean 0.0030 max 0.0040, "
                                          "largest importance ratio 12.25")
    for row, agreement in zip(rows, (0.98, 0.96), strict=False):
        row["train/routing_agreement"] = agreement
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert mismatch_summary(tmp_path).endswith(", routing agreement mean 0.9700 min 0.9600")
    assert load_recipe("demo", ROUTING["measure"]).captures_routes
    replay = load_recipe("demo", ROUTING["replay"])
    assert replay.algorithm.routing_replay and replay.captures_routes and not load_recipe("demo").captures_routes
    assert main(["demo", "--init-only", str(tmp_path / "m"), "--routing", "replay"]) == 2
    assert "--routing and --set are the demo's RL run" in capsys.readouterr().err
