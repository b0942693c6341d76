"""The mixed demo (`scalerl demo --mix`, the `demo_mix` recipe): math and code in one run. Its pieces small (worked
completions that pass their own verifier, budgets that fit them, a warm start that evaluates every domain, the
end-of-run verdict per domain and the plot), then a short real run on processes: per-domain validation in
RUN/metrics.jsonl and the mixture's shares in the batches. (The measured demo itself: docs/benchmarks.md.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_scalerl.batches.stream import RolloutStream
from megatron_scalerl.fileio import dump_yaml
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.directory import read_finished
from megatron_scalerl.run.metrics_log import read_metrics
from megatron_scalerl.tasks.problems import load_sources
from megatron_scalerl.tasks.rewards import grade_here, strip_thinking

RECIPE = load_recipe("demo_mix")
SCALERL = Path(sys.executable).with_name("scalerl")


@pytest.fixture(scope="module")
def problems():
    """The first 50 problems of each domain of the recipe."""
    return {source.config.domain_name: source.problems[:50]
            for source in load_sources(RECIPE.data.train, seed=RECIPE.trainer.seed)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_scalerl.demo.model import build_model

    return build_model(RECIPE, tmp_path_factory.mktemp("demo_mix") / "random", seed=0)


def test_the_recipe_mixes_math_and_code_half_and_half():
    math_source, code_source = RECIPE.data.train
    assert RECIPE.data.domains() == ["math", "code"]
    assert (code_source.kind, code_source.task, code_source.verifier) == ("synthetic", "code_functions", "code")
    assert math_source.share == code_source.share == 0.5
    assert math_source.validation_holdout == code_source.validation_holdout == 32


def test_worked_completions_pass_their_own_verifier(problems):
    """What the warm start teaches is right by the run's grading: the boxed answer, the fenced reference solution."""
    from megatron_scalerl.demo.model import solution_text

    code = problems["code"][0]
    assert solution_text(code).endswith(f"</think>\n```python\n{code.answer}\n```")
    for domain in ("math", "code"):
        for problem in problems[domain][:5]:
            assert grade_here(solution_text(problem), problem).correct, problem
            assert strip_thinking(solution_text(problem, close_thinking=False)) == ""  # no answer


def test_worked_completions_fit_the_recipes_token_budgets(model_dir, problems):
    """With the demo's tokenizer: prompts within rollout.max_prompt_tokens; thinking under the smallest thinking
    budget (a worked completion is never interrupted); the answer, fences included, within the answer budget."""
    from transformers import AutoTokenizer

    from megatron_scalerl.demo.model import solution_text
    from megatron_scalerl.tasks.prompts import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    budget = RECIPE.algorithm.length_control

    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    for problem in problems["math"] + problems["code"]:
        assert length(render_prompt(problem, tokenizer)) <= RECIPE.rollout.max_prompt_tokens
        thinking = length(solution_text(problem, close_thinking=False))
        assert thinking < budget.think_budget_min
        assert length(solution_text(problem)) - thinking <= budget.answer_budget
    assert budget.think_budget_max + budget.phrase_token_reserve + budget.answer_budget <= RECIPE.rollout.max_new_tokens


def test_the_warm_start_evaluates_and_reports_every_domain(model_dir, tmp_path, capsys):
    from megatron_scalerl.demo.sft import warm_start

    result = warm_start(RECIPE, model_dir, tmp_path / "warm", target=2.0, max_steps=2, batch_size=4, eval_every=2,
                        eval_prompts=2, eval_samples=1)
    assert result.steps == 2 and list(result.domain_pass_rates) == ["math", "code"]
    assert all(0.0 <= rate <= 1.0 for rate in result.domain_pass_rates.values())
    assert result.pass_rate == pytest.approx(sum(result.domain_pass_rates.values()) / 2)  # 2 prompts each
    assert ", math " in capsys.readouterr().out


def _metrics(path: Path, math: list[float], code: list[float], samples: int = 128) -> None:
    rows = [{"step": 10 * i, "role": "orchestrator", "gpu_hours": 0.01 * (i + 1), "val/pass_rate": (m + c) / 2,
             "val/math/pass_rate": m, "val/code/pass_rate": c, "val/math/samples": samples,
             "val/code/samples": samples} for i, (m, c) in enumerate(zip(math, code, strict=True))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_end_of_run_verdict_names_the_domain_that_did_not_rise(tmp_path):
    from megatron_scalerl.demo.run import domain_verdicts

    _metrics(tmp_path / "metrics.jsonl", math=[0.2, 0.3, 0.4, 0.45, 0.5], code=[0.4, 0.45, 0.38, 0.42, 0.41])
    math, code, summary = domain_verdicts(tmp_path, ["math", "code"])
    assert math.startswith("math: 0.200 -> 0.450 (+0.250;") and math.endswith(": rose")
    assert code.startswith("code: 0.400 -> 0.403 (+0.003;") and code.endswith(": did NOT rise")
    assert summary == "code did not rise above the validation's noise"
    _metrics(tmp_path / "metrics.jsonl", math=[0.2, 0.5], code=[0.3, 0.6])
    assert domain_verdicts(tmp_path, ["math", "code"])[-1] == "every domain's validation rose"


def test_the_plot_draws_every_domains_curve_beside_the_combined_one(tmp_path, monkeypatch):
    from megatron_scalerl.demo import run
    from megatron_scalerl.errors import UserError
    from megatron_scalerl.forecast import plots

    drawn = []
    monkeypatch.setattr(plots, "curve_png", lambda *curves: drawn.append([c.metric for c in curves]) or b"png")
    _metrics(tmp_path / "metrics.jsonl", math=[0.2, 0.3], code=[0.4, 0.5])
    run.plot_validation(tmp_path, ["math", "code"])
    run.plot_validation(tmp_path, ["math"])  # one domain: the combined curve alone, as the plain demo
    assert drawn == [["val/pass_rate", "val/math/pass_rate", "val/code/pass_rate"], ["val/pass_rate"]]
    with pytest.raises(UserError, match="val/sql/pass_rate"):
        run.plot_validation(tmp_path, ["math", "sql"])


# ---- a short real run ----

STEPS, PROMPTS = 3, 4  # RL steps; prompts per batch (even: two of each domain)
SHORT_RUN = {  # the demo_mix recipe, cut to a few steps on a random model
    "base": "demo_mix",
    "trainer": {"max_steps": STEPS, "checkpoint_interval": 1, "keep_checkpoints": STEPS},  # keeps batches 1 on
    "algorithm": {"zero_variance_filter": False},  # random weights: every reward is -1, no group would pass
    "rollout": {"prompts_per_step": PROMPTS, "generations_per_prompt": 2},
    "data": {"train": [{**source.model_dump(mode="json", exclude_none=True), "size": 200, "validation_holdout": 4}
                       for source in RECIPE.data.train],
             "validation_interval": 1, "validation_generations": 1},
    "logging": {"wandb_mode": "disabled"},
    "forecast": {"live": False},
}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_a_short_mixed_run_validates_each_domain_and_mixes_its_batches(model_dir, tmp_path):
    """`scalerl train` on the demo_mix recipe for a few steps. Asserted: `val/math/pass_rate` and
    `val/code/pass_rate` in every validation row beside `val/pass_rate`, from the first validation (step 0) to the
    last; `rollout/<domain>/pass_rate` of the domains each batch held, both domains over the run; and the batches'
    "domains" metadata: one domain per group,
    and the sampler's alternation (math first) seen through the group indices (group g is math when g is even), so
    the run's groups are half math, half code. (The filter is off here, so no group is dropped; with it on, the
    shares hold for the prompts drawn, not for the groups that reach the loss.)"""
    recipe_file = tmp_path / "demo_mix_short.yaml"
    recipe_file.write_text(dump_yaml(SHORT_RUN))
    run_dir = tmp_path / "run"
    command = [str(SCALERL), "train", "--recipe", str(recipe_file), "--run-dir", str(run_dir),
               "--set", f"trainer.init_from={model_dir}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert read_finished(run_dir)["reason"] == "max_steps"
    rows = read_metrics(run_dir, role="orchestrator")
    validations = [r for r in rows if "val/pass_rate" in r]
    assert validations[0]["step"] == 0 and max(r["step"] for r in validations) == STEPS
    for row in validations:
        assert {"val/math/pass_rate", "val/code/pass_rate"} <= set(row), sorted(row)
        assert row["val/math/samples"] == row["val/code/samples"] == 4  # each source's own holdout x 1 sample
    batch_rows = [r for r in rows if "rollout/reward_mean" in r]
    assert len(batch_rows) == STEPS
    # a batch takes groups as they finish (PipelineRL): code, graded in the sandbox, may finish after a batch's worth
    # of math, so a batch may hold one domain; each row names what it held, and both domains are trained on
    per_domain = {"rollout/math/pass_rate", "rollout/code/pass_rate"}
    assert all(per_domain & set(r) for r in batch_rows) and per_domain <= {k for r in batch_rows for k in r}
    stream = RolloutStream(run_dir)
    groups: dict[int, str] = {}
    kept = [index for index in range(STEPS) if stream.ready(index)]  # the trainer prunes behind its oldest checkpoint
    for index in kept:
        _, meta = stream.read(index)
        assert len(meta["domains"]) == len(meta["groups"]) == PROMPTS
        groups.update(zip(meta["groups"], meta["domains"], strict=True))
    assert len(kept) >= STEPS - 1 and len(groups) == len(kept) * PROMPTS, groups
    assert all(domain == ("math" if index % 2 == 0 else "code") for index, domain in groups.items()), groups
