"""Prompt data: loading (JSONL, parquet, reasoning-gym) with row-level errors, the validation split, weighted seeded
epochs, No-Positive-Resampling skips, a resumed sampler, the prompt template."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from megatron_scalerl.algo.resampling import NoPositiveResampling
from megatron_scalerl.errors import RecipeError, UserError
from megatron_scalerl.recipe import DataSource, load_recipe
from megatron_scalerl.tasks.problems import Problem, Source, load_source, load_sources
from megatron_scalerl.tasks.prompts import (
    INSTRUCTIONS,
    THINK_OPEN,
    PromptSampler,
    epoch_order,
    render_prompt,
    split_validation,
)

INSTRUCTION = INSTRUCTIONS["math"]


def _jsonl(path, rows) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def _problems(n: int, prefix: str = "p") -> list[Problem]:
    return [Problem(f"{prefix}#{i}", f"question {i}", str(i)) for i in range(n)]


def _source(problems: list[Problem], weight: float = 1.0, **config) -> Source:
    """A loaded source of `problems` (its config names a file it never reads)."""
    return Source(DataSource(kind="jsonl", path=problems[0].key.split("#")[0], weight=weight, **config), problems)


def _npr(enabled: bool = True) -> NoPositiveResampling:
    return NoPositiveResampling(threshold=0.9, history="latest", ema_decay=0.5, enabled=enabled)


def test_jsonl_with_own_field_names_and_numeric_answers(tmp_path):
    path = _jsonl(tmp_path / "train.jsonl", [{"q": "1+1?", "a": 2}, "", {"q": " x? ", "a": "\\frac{1}{2}"}])
    problems = load_source(DataSource(kind="jsonl", path=path, problem_field="q", answer_field="a"), seed=0)
    assert problems == [Problem(f"{path}#1", "1+1?", "2"), Problem(f"{path}#3", "x?", "\\frac{1}{2}")]


@pytest.mark.parametrize("row, message", [
    ('{"problem": "a", "answer": ', r"train.jsonl:2: invalid JSON"),
    ({"problem": "a"}, r"train.jsonl:2: no field 'answer' \(fields: problem\)"),
    ({"problem": "a", "answer": None}, r"train.jsonl:2: field 'answer' must be a string or a number, got null"),
    ({"problem": " ", "answer": 1}, r"train.jsonl:2: field 'problem' is empty"),
    ([1, 2], r"train.jsonl:2: expected an object with 'problem' and 'answer', got list"),
])
def test_bad_jsonl_row_is_named_by_file_and_line(tmp_path, row, message):
    path = _jsonl(tmp_path / "train.jsonl", [{"problem": "fine", "answer": 1}, row])
    with pytest.raises(UserError, match=message):
        load_source(DataSource(kind="jsonl", path=path), seed=0)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(UserError, match="jsonl file .*nope.jsonl does not exist"):
        load_source(DataSource(kind="jsonl", path=str(tmp_path / "nope.jsonl")), seed=0)
    with pytest.raises(UserError, match="empty.jsonl has no problems"):
        load_source(DataSource(kind="jsonl", path=_jsonl(tmp_path / "empty.jsonl", [])), seed=0)


def test_parquet_rows_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"problem": ["a?", "b?"], "answer": ["1", "2"]}), path)
    assert load_source(DataSource(kind="parquet", path=str(path)), seed=0) == [
        Problem(f"{path}#0", "a?", "1"), Problem(f"{path}#1", "b?", "2")]
    with pytest.raises(UserError, match=r"train.parquet: no column 'solution' \(columns: answer, problem\)"):
        load_source(DataSource(kind="parquet", path=str(path), answer_field="solution"), seed=0)
    pq.write_table(pa.table({"problem": ["a?", None], "answer": ["1", "2"]}), path)
    with pytest.raises(UserError, match="train.parquet: row 1: field 'problem' must be a string or a number"):
        load_source(DataSource(kind="parquet", path=str(path)), seed=0)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="junk.parquet: not a readable parquet file"):
        load_source(DataSource(kind="parquet", path=str(tmp_path / "junk.parquet")), seed=0)


def test_reasoning_gym_is_seeded_and_keyed():
    source = DataSource(kind="reasoning_gym", task="basic_arithmetic", size=20)
    first, again, other = (load_source(source, seed=s) for s in (1, 1, 2))
    assert first == again and first != other and len(first) == 20
    assert first[3].key == "reasoning_gym/basic_arithmetic#3" and first[3].answer.lstrip("-").isdigit()
    with pytest.raises(UserError, match="reasoning_gym task 'no_such_task'"):
        load_source(DataSource(kind="reasoning_gym", task="no_such_task", size=2), seed=0)


def test_reasoning_gym_options_configure_the_task():
    easy = DataSource(kind="reasoning_gym", task="basic_arithmetic", size=50,
                      options={"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": "+-"})
    problems = load_source(easy, seed=0)
    assert all(p.problem.count(" + ") + p.problem.count(" - ") == 1 for p in problems)
    with pytest.raises(UserError, match="reasoning_gym task 'basic_arithmetic'"):
        load_source(DataSource(kind="reasoning_gym", task="basic_arithmetic", size=2, options={"bogus": 1}), seed=0)


def test_the_tiny_presets_data_loads_and_splits():
    recipe = load_recipe("scalerl", model_preset="tiny_moe")
    sources = load_sources(recipe.data.train, seed=recipe.trainer.seed)
    train, validation = split_validation(sources, recipe.data.validation_holdout, seed=recipe.trainer.seed)
    assert len(validation) == recipe.data.validation_holdout
    assert sum(len(s.problems) for s in train) + len(validation) == recipe.data.train[0].size


def test_validation_split_is_seeded_and_disjoint():
    sources = [_source(_problems(50, "a"), 1.0), _source(_problems(30, "b"), 2.0)]
    train, validation = split_validation(sources, 20, seed=7)
    assert split_validation(sources, 20, seed=7) == (train, validation)
    assert split_validation(sources, 20, seed=8)[1] != validation
    held = {p.key for p in validation}
    assert len(held) == 20 and not held & {p.key for s in train for p in s.problems}
    assert [s.config.weight for s in train] == [1.0, 2.0] and sum(len(s.problems) for s in train) == 60
    with pytest.raises(UserError, match="validation_holdout: 80 held-out prompts leave none of the 80"):
        split_validation(sources, 80, seed=7)


def test_epoch_weights_repeat_or_subsample():
    whole, double, half = _problems(10, "w"), _problems(10, "d"), _problems(10, "h")
    sources = [_source(whole, 1.0), _source(double, 2.0), _source(half, 0.5)]
    orders = [epoch_order(sources, seed=3, epoch=e) for e in range(2)]
    for order in orders:
        counts = Counter(p.key.split("#")[0] for p in order)
        assert counts == {"w": 10, "d": 20, "h": 5}
        assert all(n == 2 for key, n in Counter(p.key for p in order).items() if key.startswith("d#"))
    halves = [{p.key for p in order if p.key.startswith("h#")} for order in orders]
    assert halves[0] != halves[1]  # a different half each epoch
    assert orders[0] == epoch_order(sources, seed=3, epoch=0) != epoch_order(sources, seed=4, epoch=0)


def test_sampler_skips_retired_prompts_and_resumes_exactly():
    sources = [_source(_problems(6), 1.0)]
    npr = _npr()
    sampler = PromptSampler(sources, seed=1, resampling=npr)
    drawn = [sampler.next() for _ in range(6)]
    assert sorted(p.key for p in drawn) == sorted(p.key for p in sources[0].problems) and sampler.epoch == 0
    npr.record(drawn[0].key, 4, 4)  # solved every time: retired
    state = sampler.state_dict()
    later = [sampler.next() for _ in range(10)]  # two epochs of the 5 left
    assert drawn[0].key not in {p.key for p in later} and sampler.epoch == 2
    resumed = PromptSampler(sources, seed=1, resampling=npr)
    resumed.load_state_dict(state)
    assert [resumed.next() for _ in range(10)] == later


def test_sampler_refuses_when_every_prompt_is_retired():
    sources = [_source(_problems(2), 1.0)]
    npr = _npr()
    sampler = PromptSampler(sources, seed=1, resampling=npr)
    for problem in sources[0].problems:
        npr.record(problem.key, 1, 1)
    with pytest.raises(UserError, match="every one of the 2 training prompts is retired"):
        sampler.next()
    with pytest.raises(UserError, match="position 9 is outside epoch 0's 2 prompts"):
        sampler.load_state_dict({"epoch": 0, "position": 9})


def test_prompt_template_plain_and_chat(tmp_path):
    plain = render_prompt(Problem("q", "  What is 2+3?  ", ""))
    assert plain == f"Problem: What is 2+3?\n\n{INSTRUCTION}\nSolution: {THINK_OPEN}\n"

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                        unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert render_prompt(Problem("q", "What is 2+3?", ""), tokenizer) == (
        f"<|user|>What is 2+3?\n\n{INSTRUCTION}<|end|><|assistant|>{THINK_OPEN}\n")
    tokenizer.chat_template = tokenizer.chat_template.replace("<|assistant|>", f"<|assistant|>{THINK_OPEN}\n")
    assert render_prompt(Problem("q", "What is 2+3?", ""), tokenizer) == (  # a generation prompt that opens the thinking (DeepSeek-R1's)
        f"<|user|>What is 2+3?\n\n{INSTRUCTION}<|end|><|assistant|>{THINK_OPEN}\n")  # is not opened twice


def test_mixture_draws_follow_the_shares_and_resume_exactly():
    math_source = _source(_problems(30, "m"), share=3.0, domain="arith")
    code_source = _source(_problems(7, "c"), share=1.0, verifier="code")
    npr = _npr()
    sampler = PromptSampler([math_source, code_source], seed=5, resampling=npr)
    drawn = [sampler.next() for _ in range(40)]
    domains = ["m" if p.key.startswith("m#") else "c" for p in drawn]
    for start in range(0, 40, 4):  # any 4 consecutive draws from the start hold the 3:1 shares exactly
        assert domains[start:start + 4].count("c") == 1
    assert Counter(p.key for p in drawn if p.key.startswith("c#")).most_common(1)[0][1] == 2  # its own 2nd epoch
    state = sampler.state_dict()
    assert [s["draws"] for s in state["sources"]] == [30, 10]
    later = [sampler.next() for _ in range(12)]
    resumed = PromptSampler([math_source, code_source], seed=5, resampling=npr)
    resumed.load_state_dict(state)
    assert [resumed.next() for _ in range(12)] == later
    with pytest.raises(UserError, match="prompt sampler state: malformed or not this recipe's"):
        resumed.load_state_dict({"epoch": 0, "position": 3})  # an unmixed run's state


def test_mixture_goes_on_without_a_source_whose_prompts_are_all_retired(capsys):
    a, b = _source(_problems(4, "a"), share=1.0), _source(_problems(2, "b"), share=1.0)
    npr = _npr()
    sampler = PromptSampler([a, b], seed=0, resampling=npr)
    for problem in b.problems:
        npr.record(problem.key, 2, 2)
    assert all(sampler.next().key.startswith("a#") for _ in range(8))
    assert "every prompt of b is retired" in capsys.readouterr().out
    for problem in a.problems:
        npr.record(problem.key, 2, 2)
    with pytest.raises(UserError, match="every one of the 6 training prompts is retired"):
        sampler.next()


def test_a_sources_own_validation_holdout_leaves_the_shared_draw_as_it_was():
    a, b, c = _source(_problems(40, "a")), _source(_problems(20, "b")), _source(_problems(30, "c"))
    _, plain = split_validation([a, b], 10, seed=3)
    own = _source(c.problems, validation_holdout=6)
    train, validation = split_validation([a, b, own], 10, seed=3)
    assert validation[:10] == plain  # adding a source with its own hold-out does not move the others' split
    assert len(validation) == 16 and all(p.key.startswith("c#") for p in validation[10:])
    assert [len(s.problems) for s in train][2] == 24
    with pytest.raises(UserError, match=r"data.train \(c\).validation_holdout: 30 held-out prompts leave none"):
        split_validation([a, _source(c.problems, validation_holdout=30)], 10, seed=3)


def test_shares_on_some_sources_only_and_bad_domains_are_errors():
    with pytest.raises(RecipeError, match=r"data: .*`share` is set on some sources but not on train\[1\]"):
        load_recipe("demo", ["data.train=[{kind: jsonl, path: a.jsonl, share: 1}, {kind: jsonl, path: b.jsonl}]"])
    with pytest.raises(RecipeError, match=r"data.train\[0\]: .*domain 'a b': use letters, digits"):
        load_recipe("demo", ["data.train=[{kind: jsonl, path: a.jsonl, domain: 'a b'}]"])
    with pytest.raises(RecipeError, match=r"data.train\[0\]: .*give the source a `domain`"):
        load_recipe("demo", ["data.train=[{kind: jsonl, path: a.jsonl, verifier: 'my.module:check'}]"])


def test_synthetic_code_source_carries_its_tests_domain_and_template():
    problems = load_source(DataSource(kind="synthetic", task="code_functions", size=5, verifier="code"), seed=0)
    assert [p.key for p in problems] == [f"synthetic/code_functions#{i}" for i in range(5)]
    first = problems[0]
    assert (first.domain, first.verifier, first.template) == ("code", "code", "code")
    assert first.tests["asserts"] and first.answer.startswith("def f(x):")
    assert problems == load_source(DataSource(kind="synthetic", task="code_functions", size=5, verifier="code"),
                                   seed=0)
    with pytest.raises(UserError, match="synthetic task 'nope': unknown task; known: code_functions"):
        load_source(DataSource(kind="synthetic", task="nope", size=1), seed=0)


def test_code_rows_tests_as_json_strings_and_bad_rows_by_line(tmp_path):
    asserts = {"asserts": ["assert f(1) == 2"]}
    path = _jsonl(tmp_path / "code.jsonl", [{"problem": "f", "tests": json.dumps(asserts), "setup": "import math"},
                                            {"problem": "g", "tests": asserts}])
    first, second = load_source(DataSource(kind="jsonl", path=path, verifier="code"), seed=0)
    assert first.tests == {**asserts, "setup": "import math"} and second.tests == asserts  # as some datasets ship them
    assert first.answer == "" and first.template == "code"  # a code row needs no gold answer
    for row, message in [({"problem": "f", "tests": "[1, 2"}, "code.jsonl:1: field 'tests' is a string but not JSON"),
                         ({"problem": "f"}, r"code.jsonl:1: tests: missing .*\(verifier 'code'\)"),
                         ({"problem": "f", "tests": {"inputs": ["1"]}}, "code.jsonl:1: tests: has 'inputs' but not")]:
        _jsonl(tmp_path / "code.jsonl", [row])
        with pytest.raises(UserError, match=message):
            load_source(DataSource(kind="jsonl", path=path, verifier="code"), seed=0)


def test_code_template_asks_for_one_fenced_block():
    text = render_prompt(Problem("q", "Write f.", "", template="code"))
    assert text == f"Problem: Write f.\n\n{INSTRUCTIONS['code']}\nSolution: {THINK_OPEN}\n"
    assert "```python" in INSTRUCTIONS["code"]
