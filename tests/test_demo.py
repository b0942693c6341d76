"""The demo's pieces, small: the locally built model and tokenizer, the supervised warm start, the curve plot.
(`make demo` itself is the README's main command; its figures are in the README's performance section.)"""

import json

import pytest

from megatron_scalerl.recipe import load_recipe

RECIPE = load_recipe("demo")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_scalerl.demo.model import build_model

    return build_model(RECIPE, tmp_path_factory.mktemp("demo") / "random", seed=0)


def test_model_and_tokenizer_fit_the_recipe(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from megatron_scalerl.rollout.generation import length_control_policy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    assert len(tokenizer) <= RECIPE.model.vocab_size == config.vocab_size
    assert config.eos_token_id == tokenizer.eos_token_id
    policy = length_control_policy(RECIPE, tokenizer)  # the phrase fits its token reserve
    assert 0 < len(policy.phrase_ids) <= RECIPE.algorithm.length_control.phrase_token_reserve
    text = "Calculate 7 + 8. gives 15.\n</think>\n\\boxed{15}"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


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
