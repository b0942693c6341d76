"""The tools demo (`scalerl demo --tools`, the `demo_tools` recipe, demo/tools.py): its pieces small (numbers the same
tokens wherever written, tool traces within the recipe's budgets, the run with the tool off), then the demo itself on
processes at a few steps: both runs, RUN/tools_comparison.json and its plot. (The measured demo: docs/benchmarks.md.)"""

import json

import pytest

from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.tasks.problems import load_sources

RECIPE = load_recipe("demo_tools")


@pytest.fixture(scope="module")
def problems():
    return load_sources(RECIPE.data.train, seed=RECIPE.trainer.seed)[0].problems[:50]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_scalerl.demo.model import build_model

    return AutoTokenizer.from_pretrained(build_model(RECIPE, tmp_path_factory.mktemp("demo_tools") / "random",
                                                     digit_groups=True))


def test_the_recipe_asks_products_of_up_to_three_digits_with_the_python_tool(problems):
    [source] = RECIPE.data.train
    assert (source.environment, source.max_tool_calls, source.options["operators"]) == ("python_tool", 2, "*")
    assert all(p.environment == "python_tool" and p.max_tool_calls == 2 for p in problems)
    terms = [term for p in problems for term in p.problem.rstrip(".").split()[1::2]]
    assert all(term.isdigit() and len(term) <= 3 for term in terms) and sum(len(t) == 3 for t in terms) > 0.8 * len(terms)


def test_a_number_is_the_same_tokens_in_the_prompt_the_program_the_output_and_the_answer(tokenizer, problems):
    """With `digit_groups` the model copies tokens, not text: the operands of the prompt are the program's, the
    output's digits the boxed answer's (a byte-level BPE alone tokenizes " 952" and "(952" apart)."""
    from megatron_scalerl.demo.model import tool_trace

    def tokens(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def contains(whole: list[int], part: list[int]) -> bool:
        return any(whole[i:i + len(part)] == part for i in range(len(whole) - len(part) + 1))

    for problem in problems[:20]:
        reply, observation, rest = tool_trace(problem)
        for operand in problem.problem.rstrip(".").split()[1::2]:
            assert contains(tokens(problem.problem), tokens(operand)) and contains(tokens(reply), tokens(operand))
        assert contains(tokens(observation), tokens(problem.answer)) and contains(tokens(rest), tokens(problem.answer))


def test_tool_traces_fit_the_recipes_budgets(tokenizer, problems):
    """A traced completion is never interrupted (the reply under the smallest thinking budget), its answer within the
    answer budget, the whole with its observation within rollout.max_new_tokens; prompts, with the tool's note,
    within rollout.max_prompt_tokens."""
    from megatron_scalerl.demo.model import prompt_messages, tool_trace
    from megatron_scalerl.tasks.environments import TOOL_NOTE
    from megatron_scalerl.tasks.prompts import render_prompt

    budget = RECIPE.algorithm.length_control
    for problem in problems:
        prompt = render_prompt(problem, tokenizer, prompt_messages(problem))
        assert TOOL_NOTE in prompt and len(tokenizer(prompt).input_ids) <= RECIPE.rollout.max_prompt_tokens
        reply, observation, rest = (len(tokenizer.encode(part, add_special_tokens=False))
                                    for part in tool_trace(problem))
        assert reply < budget.think_budget_min and rest <= budget.answer_budget
        assert reply + observation + rest + 1 <= RECIPE.rollout.max_new_tokens


def test_the_warm_start_is_measured_on_the_tool_traces_it_reproduces(tokenizer, problems, tmp_path):
    """`reproduced_traces`: none by the random model; every one of a trace the model was trained on until it wrote it
    (the observation given, never trained on: the same model is not asked to predict it)."""
    import torch

    from megatron_scalerl.demo.sft import _batch, _examples, reproduced_traces, trace_batch
    from megatron_scalerl.models.hf_io import load_hf_causal_lm

    torch.manual_seed(0)
    model = load_hf_causal_lm(tokenizer.name_or_path, dtype=torch.float32)
    assert reproduced_traces(model, trace_batch(tokenizer, problems[:4])) == 0.0
    ids, mask, labels = _batch(_examples(tokenizer, problems[:1], unclosed_fraction=0.0, tool_fraction=1.0, seed=0),
                               tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    model.eval()
    assert reproduced_traces(model, trace_batch(tokenizer, problems[:1])) == 1.0


def test_the_run_without_the_tool_differs_by_the_environment_alone():
    from megatron_scalerl.demo.tools import tool_off
    from megatron_scalerl.recipe import changed_fields

    off = tool_off(RECIPE)
    assert off.data.train[0].environment is None and off.name == "demo_tools+no_tool"
    assert changed_fields(RECIPE.to_dict(), off.to_dict()) == ["data.train", "name"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_the_demo_runs_both_and_compares_their_validations(tmp_path, monkeypatch, capsys):
    """`scalerl demo --tools` at a few warm-start and RL steps with small batches: both runs finish, the comparison
    holds each run's curve from step 0 and the mean of its last LAST_VALIDATIONS validations, their difference, the
    tool figures of the run with the tool (the run without has none), and the plot is a PNG."""
    from megatron_scalerl.commands import main
    from megatron_scalerl.demo import tools
    from megatron_scalerl.run.directory import read_finished
    from megatron_scalerl.run.metrics_log import read_metrics

    monkeypatch.setattr(tools, "WARM_START_STEPS", 2)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "demo_tools"
    small = ["rollout.prompts_per_step=4", "rollout.generations_per_prompt=2", "data.validation_interval=1",
             "data.validation_holdout=8", "data.validation_generations=1", "forecast.live=false"]
    assert main(["demo", "--tools", "--run-dir", str(run_dir), "--steps", "2",
                 *(arg for override in small for arg in ("--set", override))]) == 0
    assert "demo: held-out pass rate (mean of the last 3 validations): with the tool" in capsys.readouterr().out
    comparison = json.loads((run_dir / "tools_comparison.json").read_text())
    for name in tools.RUNS:
        assert read_finished(run_dir / name)["reason"] == "max_steps"
        curve = comparison["curves"][name]
        assert curve["steps"] == [0, 1, 2] and all(0.0 <= rate <= 1.0 for rate in curve["pass_rate"])
        assert comparison[name] == pytest.approx(sum(curve["pass_rate"]) / 3)
    assert comparison["gain"] == pytest.approx(comparison["with_tool"] - comparison["without_tool"])
    assert {"val/tool/calls_mean", "val/tool/observation_tokens_mean"} <= set(comparison["with_tool_figures"])
    assert not any(k.startswith("val/tool/") for r in read_metrics(run_dir / "without_tool", "orchestrator") for k in r)
    assert (run_dir / "tools_comparison.png").read_bytes().startswith(b"\x89PNG")
    assert json.loads((tmp_path / "demo_tools_model" / "build.json").read_text())["digit_groups"] is True
