"""Data, prompts and rewards as users have them (issue 51): replies without thinking, a source's own instruction and
system prompt, chat-message problems, dotted fields into nested columns, answer formats, verl-form rewards, the
model's end tokens. Oracles: the texts written out by hand, GSM8K's gold answers, verl's own reward rule."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_scalerl.errors import UserError
from megatron_scalerl.models.tokenizer import end_token_ids
from megatron_scalerl.recipe import DataSource, LocalBenchmark, load_recipe
from megatron_scalerl.tasks.answers import extract_answer, gold_answer
from megatron_scalerl.tasks.problems import Problem, load_source
from megatron_scalerl.tasks.prompts import (
    INSTRUCTIONS,
    PLAIN_CHAT_TEMPLATE,
    REPLY_INSTRUCTIONS,
    THINK_OPEN,
    render_prompt,
)
from megatron_scalerl.tasks.rewards import Grade, RewardGrader, reward_of

VERL_REWARD = "tests.verl_rewards:compute_score"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _chat_tokenizer(template: str):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                        unk_token="<unk>", eos_token="<unk>")
    tokenizer.chat_template = template
    return tokenizer


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN3_SWITCH = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n{% if enable_thinking is "
                              "defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def grader():
    with RewardGrader(num_workers=1, timeout_s=30) as g:
        yield g


# ---- prompts ----

def test_a_reply_without_thinking_opens_no_block_and_its_instruction_never_mentions_thinking():
    problem = Problem("q", " What is 2+3? ", "5", thinking=False)
    assert render_prompt(problem) == f"Problem: What is 2+3?\n\n{REPLY_INSTRUCTIONS['math']}\nSolution: "
    assert all("think" not in text.lower() for text in REPLY_INSTRUCTIONS.values())
    assert render_prompt(problem, _chat_tokenizer(CHATML)) == (
        f"<|im_start|>user\nWhat is 2+3?\n\n{REPLY_INSTRUCTIONS['math']}<|im_end|>\n<|im_start|>assistant\n")
    # a template with its own switch (Qwen3's enable_thinking) gets it set false
    assert render_prompt(problem, _chat_tokenizer(QWEN3_SWITCH)).endswith("assistant\n<think>\n\n</think>\n\n")
    assert render_prompt(Problem("q", "2+3?", "5"), _chat_tokenizer(QWEN3_SWITCH)).endswith(f"assistant\n{THINK_OPEN}\n")
    # our plain chat template (the demo's tokenizer) follows the switch too
    plain = _chat_tokenizer(PLAIN_CHAT_TEMPLATE)
    assert render_prompt(problem, plain) == render_prompt(problem)
    assert render_prompt(Problem("q", "2+3?", "5"), plain) == render_prompt(Problem("q", "2+3?", "5"))
    # a template that opens thinking whatever it is told (DeepSeek-R1's) cannot ask a reply without it
    forced = _chat_tokenizer(CHATML.replace("assistant\n{% endif %}", f"assistant\n{THINK_OPEN}\n{{% endif %}}"))
    with pytest.raises(UserError, match="opens a thinking block even with enable_thinking false"):
        render_prompt(problem, forced)


def test_a_sources_instruction_and_system_prompt_and_a_conversation_as_given():
    tokenizer = _chat_tokenizer(CHATML)
    own = Problem("q", "2+3?", "5", thinking=False, instruction="Give only the final number.",
                  system_prompt="You are terse.")
    assert render_prompt(own, tokenizer) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+3?\n\nGive only the final number."
        "<|im_end|>\n<|im_start|>assistant\n")
    assert render_prompt(own) == "You are terse.\n\nProblem: 2+3?\n\nGive only the final number.\nSolution: "
    assert render_prompt(Problem("q", "2+3?", "5", instruction="")) == f"Problem: 2+3?\nSolution: {THINK_OPEN}\n"
    chat = ({"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+3?"})
    assert render_prompt(Problem("q", "2+3?", "5", thinking=False, messages=chat), tokenizer) == (
        "<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    many = ({"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+3?"})
    with pytest.raises(UserError, match="needs the tokenizer's chat template"):
        render_prompt(Problem("q", "2+3?", "5", messages=many))
    with pytest.raises(ValueError, match="set `template` or `instruction`, not both"):
        DataSource(kind="jsonl", path="x.jsonl", template="math", instruction="Answer.")
    assert render_prompt(Problem("q", "2+3?", "5")) == f"Problem: 2+3?\n\n{INSTRUCTIONS['math']}\nSolution: {THINK_OPEN}\n"


# ---- data as users have it ----

def test_verl_parquet_rows_nested_fields_and_chat_messages(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "Natalia sold 48 clips. Then half "
             "as many. How many? Let's think step by step and output the final answer after \"####\"."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
             "extra_info": {"split": "train", "index": 0}}]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    source = DataSource(kind="parquet", path=str(path), problem_field="prompt",
                        answer_field="reward_model.ground_truth", verifier=VERL_REWARD, domain="gsm8k", thinking=False)
    (problem,) = load_source(source, seed=0)
    assert problem.answer == "72" and problem.data_source == "openai/gsm8k"
    assert problem.extra_info == {"split": "train", "index": 0}
    assert problem.messages == tuple(rows[0]["prompt"]) and problem.problem == rows[0]["prompt"][0]["content"]
    assert render_prompt(problem, _chat_tokenizer(CHATML)).count("####") == 1  # no instruction appended
    # an exact column name wins over a dotted path
    _jsonl(tmp_path / "d.jsonl", [{"a.b": "exact", "a": {"b": "nested"}, "problem": "p"}])
    (dotted,) = load_source(DataSource(kind="jsonl", path=str(tmp_path / "d.jsonl"), answer_field="a.b"), seed=0)
    assert dotted.answer == "exact"
    _jsonl(tmp_path / "e.jsonl", [{"problem": "p", "reward_model": {"style": "rule"}}])
    with pytest.raises(UserError, match=r"e.jsonl:1: no field 'reward_model.ground_truth'"):
        load_source(DataSource(kind="jsonl", path=str(tmp_path / "e.jsonl"),
                               answer_field="reward_model.ground_truth"), seed=0)
    _jsonl(tmp_path / "m.jsonl", [{"problem": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                   "answer": "1"}])
    with pytest.raises(UserError, match="m.jsonl:1: field 'problem' is a chat conversation that does not end"):
        load_source(DataSource(kind="jsonl", path=str(tmp_path / "m.jsonl")), seed=0)
    with pytest.raises(UserError, match="answer_format 'hash' is how a verifier comparing"):
        load_source(source.model_copy(update={"answer_format": "hash"}), seed=0)


def test_eval_benchmarks_take_the_same_keys_and_interruption_refuses_replies_without_thinking(tmp_path):
    bench = LocalBenchmark(name="gsm", path="g.jsonl", thinking=False, instruction="Give only the final number.",
                           answer_format="last_number", answer_field="reward_model.ground_truth")
    source = bench.source()
    assert (source.thinking, source.instruction, source.answer_format, source.answer_field) == (
        False, "Give only the final number.", "last_number", "reward_model.ground_truth")
    unthinking = "data.train=[{kind: reasoning_gym, task: basic_arithmetic, size: 40, thinking: false}]"
    with pytest.raises(UserError, match=r"interruption forces the end of a thinking block, and data.train\[0\] set"):
        load_recipe("demo", [unthinking])
    with pytest.raises(ValueError, match="regex:a.b': the pattern needs a group"):
        DataSource(kind="jsonl", path="x", answer_format="regex:a.b")
    with pytest.raises(UserError, match=r"and eval.benchmarks \(gsm\) set thinking: false"):
        load_recipe("demo", ["eval.benchmarks=[{name: gsm, path: g.jsonl, thinking: false}]"])
    penalty = ["algorithm.length_control.penalty_max_len=96", "algorithm.length_control.penalty_cache_len=32"]
    for mode in ("none", "length_penalty"):
        recipe = load_recipe("demo", [unthinking, f"algorithm.length_control.mode={mode}", *penalty])
        assert recipe.data.train[0].thinking is False


# ---- answers and rewards ----

@pytest.mark.parametrize("text, answer_format, expected", [
    (r"so \boxed{\frac{1}{2}}, not \boxed{3}", "boxed", "3"),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "hash", "72"),
    ("no marker here: 72", "hash", None),
    ("3 + 4 = 7, then 7 * 2 = 1,400.", "last_number", "1400"),
    ("It is -2.5 degrees", "last_number", "-2.5"),
    ("no digits", "last_number", None),
    ("Answer: 12. Answer: 13 apples", r"regex:Answer:\s*(\d+)", "13"),
    ("  the whole reply  ", "math_verify", "the whole reply"),
])
def test_answer_formats(text, answer_format, expected):
    assert extract_answer(text, answer_format) == expected


def test_answer_formats_grade_against_the_gold_read_the_same_way(grader):
    gsm8k_gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert gold_answer(gsm8k_gold, "hash") == "72"
    hashed = Problem("g", "How many?", gsm8k_gold, answer_format="hash", thinking=False)
    last = Problem("n", "How many?", "72", answer_format="last_number", thinking=False)
    boxed = Problem("b", "How many?", "72", answer_format="boxed")
    grades = grader.grade_many([("48 + 24 = 72\n#### 72", hashed), ("#### 71", hashed), ("72 clips", hashed),
                                ("First 24, then 72.", last), ("reasoning</think> \\boxed{72}", boxed),
                                ("reasoning</think> 72", boxed)])
    assert [g.correct for g in grades] == [True, False, False, True, True, False]
    assert [g.failure for g in grades] == [None, "wrong_answer", "no_answer", None, None, "no_answer"]


def test_a_verl_reward_is_called_by_keyword_and_its_score_is_the_way_from_fail_to_pass(grader):
    gsm = Problem("g", "How many?", "72", verifier=VERL_REWARD, thinking=False, data_source="openai/gsm8k",
                  extra_info={"split": "test"})
    right, wrong, none = grader.grade_many([("so #### 72", gsm), ("so #### 70", gsm), ("72", gsm)])
    assert (right.correct, right.score, wrong.correct, wrong.score, none.score) == (True, 1.0, False, 0.1, 0.0)
    assert right.metrics == {"formatted": 1.0, "split_is_test": 1.0, "source_is_gsm8k": 1.0}
    assert none.metrics["formatted"] == 0.0
    assert reward_of(wrong, 1.0, -1.0) == pytest.approx(-0.8)  # a format score of 0.1: a tenth of the way
    assert reward_of(right, 1.0, -1.0) == 1.0 and reward_of(none, 1.0, -1.0) == -1.0
    assert reward_of(Grade(correct=False, error="boom"), 1.0, -1.0) == -1.0
    # thinking on: the reward sees the answer part only
    (thinking,) = grader.grade_many([("#### 70 first guess</think> #### 72", Problem(
        "t", "q", "72", verifier=VERL_REWARD))])
    assert thinking.score == 1.0
    (plain,) = grader.grade_many([("x" * 250, Problem("l", "q", "1", verifier="tests.verl_rewards:length_score",
                                                      domain="len", thinking=False))])
    assert plain.score == 2.5 and plain.correct


# ---- end tokens and the grade command ----

def test_end_tokens_are_the_tokenizers_and_its_generation_configs(tmp_path):
    tokenizer = _chat_tokenizer(CHATML)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>", "<|eot|>"]})
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert end_token_ids(loaded) == {0, 1, 2}
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(UserError, match="generation_config.json: not a generation config"):
        end_token_ids(loaded)


def test_scalerl_grade_without_thinking_and_with_an_answer_format(tmp_path):
    problems = _jsonl(tmp_path / "p.jsonl", [{"id": "a", "reward_model": {"ground_truth": "Sold 72.\n#### 72"},
                                              "question": "How many?"}])
    completions = _jsonl(tmp_path / "c.jsonl", [{"id": "a", "completion": "It is 72.\n#### 72"},
                                                {"id": "a", "completion": "#### 7"}])
    out = subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", "grade", "--verifier", "math",
                          "--problems", problems, "--completions", completions, "--no-thinking", "--json",
                          "--problem-field", "question", "--answer-field", "reward_model.ground_truth",
                          "--answer-format", "hash", "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["correct"] for line in out.stdout.splitlines()] == [True, False]
