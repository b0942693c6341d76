"""Evaluation metrics (pass@k, mean@K, cons@K, answer extraction and normalization) against independent oracles,
and the real grader (math-verify in worker processes) on the answer formats an AIME evaluation meets."""

import itertools
import math
from fractions import Fraction
from types import SimpleNamespace

import pytest

from megatron_scalerl.evaluation.pass_at_k import (
    ks_up_to,
    majority_answer,
    normalize_answer,
    pass_at_k,
    summarize,
)
from megatron_scalerl.tasks.answers import extract_boxed
from megatron_scalerl.tasks.rewards import RewardGrader

# ---- pass@k ----


def _pass_at_k_enumerated(n: int, c: int, k: int) -> Fraction:
    """Oracle: the fraction of all k-subsets of n samples (the first c correct) that hold a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration_over_all_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            expected = _pass_at_k_enumerated(n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_where_binomials_are_huge():
    # C(1000, 500) has ~300 digits: exact integers via math.comb as the oracle, the product form must agree
    for n, c, k in [(1000, 10, 100), (1000, 1, 500), (1000, 999, 1), (2000, 3, 7), (600, 300, 299)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


def test_pass_at_k_boundaries():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 0, 5) == 0.0  # nothing correct: never passes
    assert pass_at_k(5, 5, 1) == 1.0  # everything correct
    assert pass_at_k(5, 1, 5) == 1.0  # k = n: the one correct sample is always drawn
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k = 3: every 3-subset holds a correct one
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    assert pass_at_k(16, 4, 1) == pytest.approx(4 / 16)  # pass@1 is the fraction correct
    assert pass_at_k(8, 2, 2) == pytest.approx(1 - 15 / 28)  # C(6,2)/C(8,2) = 15/28


@pytest.mark.parametrize("n,c,k", [(4, 1, 5), (4, 1, 0), (4, 5, 2), (-1, 0, 1), (4, -1, 1), (4, 1, -1), (0, 0, 0)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_ks_up_to():
    assert ks_up_to(1) == [1]
    assert ks_up_to(2) == [1, 2]
    assert ks_up_to(6) == [1, 2, 4, 6]
    assert ks_up_to(8) == [1, 2, 4, 8]
    assert ks_up_to(9) == [1, 2, 4, 8, 9]
    assert ks_up_to(64) == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(ValueError):
        ks_up_to(0)


# ---- answers ----


def test_extract_boxed():
    assert extract_boxed(r"so \boxed{25}.") == "25"
    assert extract_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"  # nested braces
    assert extract_boxed(r"\boxed{\sqrt{\frac{a}{b^{2}}}} done") == r"\sqrt{\frac{a}{b^{2}}}"
    assert extract_boxed(r"first \boxed{7}, then \boxed{25}") == "25"  # the last box wins
    assert extract_boxed(r"\boxed{7} and \fbox{9}") == "9"  # \fbox counts as a box
    assert extract_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"  # escaped braces are content
    assert extract_boxed(r"$\boxed{ 33 }$") == "33"
    assert extract_boxed("The answer is 25.") is None  # no box
    assert extract_boxed("") is None
    assert extract_boxed(r"\boxed{\frac{1}{2}") is None  # unbalanced: cut off mid-answer
    assert extract_boxed(r"\boxed{1} then \boxed{2") is None  # the last box is the answer, and it never closes


def test_normalize_answer():
    cases = {
        "025": "25", "-0": "0", "+7": "7", " $25$ ": "25", "25.": "25", "2.50": "2.5", "3.0": "3", "-0.00": "0",
        ".5": "0.5", r"204^\circ": "204", r"204^{\circ}": "204", r"\text{25}": "25", r"25 \text{ cm}": "25cm",
        r"\left( 1, 2 \right)": "(1,2)", r"1\,000": "1000", r"3\!\cdot\!5": r"3\cdot5", r"\dfrac{1}{2}": r"\frac{1}{2}",
        r"\$5": "5",
    }
    for raw, key in cases.items():
        assert normalize_answer(raw) == key, raw
    # only spelling is unified: equal values written differently stay different keys (the grader decides correctness)
    assert normalize_answer("1/2") != normalize_answer(r"\frac{1}{2}")
    assert normalize_answer(r"\rightarrow") == r"\rightarrow"  # \right is removed only as a whole command


def test_majority_answer():
    assert majority_answer(["25", "025", "7", None]) == "25"  # 25 and 025 vote together
    assert majority_answer(["7", "25", "25", "7"]) == "7"  # a tie goes to the answer that appears first
    assert majority_answer([None, "25", "7", "7", "25"]) == "25"
    assert majority_answer([None, "3", "4", "4"]) == "4"
    assert majority_answer([None, None]) is None
    assert majority_answer([]) is None
    assert majority_answer([r"\text{5}", "5.0", "6", "6"]) == "5"  # normalized form is returned


# ---- summarize ----

# Three problems, K = 4 samples each.
#   problem 0: 2 of 4 correct. Answers 25, 24, 025, 24: normalized 25 x2 and 24 x2, a tie that goes to 25 (first
#              seen); the first sample answering 25 (sample 0) is correct -> the vote is right.
#   problem 1: 1 of 4 correct (sample 3, answer 12). Answers 7, 7.0, None, 12: the vote is 7 (7 and 7.0 together),
#              first carried by sample 0, which is wrong -> the vote is wrong. Sample 1's grading timed out.
#   problem 2: 1 of 4 correct, but no sample has a boxed answer (all None; the grader still accepted sample 1's plain
#              text) -> no vote -> wrong. Sample 3's grading timed out.
# mean@4 = (2/4 + 1/4 + 1/4) / 3 = 1/3 = pass@1.
# pass@2: c=2: 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6; c=1: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2;
#         mean (5/6 + 1/2 + 1/2) / 3 = 11/18.
# pass@4: every problem has a correct sample -> 1.
# cons@4 = 1/3 (problem 0 only).
# lengths: (100+200+300+400) + (50+50+1000+100) + (10+20+30+40) = 1000 + 1200 + 100 = 2300 tokens over 12 samples.
# truncated: problem 0 sample 3 and problem 1 sample 2 -> 2/12 = 1/6. grader time-outs: 2.
T, F = True, False
EXAMPLE = [
    {"correct": [T, F, T, F], "answers": ["25", "24", "025", "24"], "tokens": [100, 200, 300, 400],
     "truncated": [F, F, F, T], "timed_out": [F, F, F, F]},
    {"correct": [F, F, F, T], "answers": ["7", "7.0", None, "12"], "tokens": [50, 50, 1000, 100],
     "truncated": [F, F, T, F], "timed_out": [F, T, F, F]},
    {"correct": [F, T, F, F], "answers": [None, None, None, None], "tokens": [10, 20, 30, 40],
     "truncated": [F, F, F, F], "timed_out": [F, F, F, T]},
]


def test_summarize_hand_computed_example():
    summary = summarize(EXAMPLE)
    assert set(summary) == {"problems", "samples_per_problem", "mean_at_k", "pass_at_k", "cons_at_k",
                            "response_length_mean", "truncation_rate", "grader_timeouts"}
    assert summary["problems"] == 3 and summary["samples_per_problem"] == 4
    assert summary["mean_at_k"] == pytest.approx(1 / 3)
    assert list(summary["pass_at_k"]) == ["1", "2", "4"]
    assert summary["pass_at_k"]["1"] == pytest.approx(1 / 3)
    assert summary["pass_at_k"]["2"] == pytest.approx(11 / 18)
    assert summary["pass_at_k"]["4"] == pytest.approx(1.0)
    assert summary["cons_at_k"] == pytest.approx(1 / 3)
    assert summary["response_length_mean"] == pytest.approx(2300 / 12)
    assert summary["truncation_rate"] == pytest.approx(1 / 6)
    assert summary["grader_timeouts"] == 2 and isinstance(summary["grader_timeouts"], int)


def test_summarize_accepts_objects():
    assert summarize([SimpleNamespace(**r) for r in EXAMPLE]) == summarize(EXAMPLE)


def test_summarize_vote_correctness_is_the_first_carrier():
    # the vote is 25 (samples 1 and 2); sample 1 is graded wrong, sample 2 right: the first carrier decides
    one = {"correct": [T, F, T], "answers": ["3", "25", "025"], "tokens": [1, 1, 1], "truncated": [F] * 3,
           "timed_out": [F] * 3}
    assert summarize([one])["cons_at_k"] == 0.0
    assert summarize([{**one, "correct": [F, T, F]}])["cons_at_k"] == 1.0


def test_summarize_rejects_inconsistent_results():
    short = {name: values[:3] for name, values in EXAMPLE[1].items()}
    with pytest.raises(ValueError, match=r"problem 1\b"):
        summarize([EXAMPLE[0], short, EXAMPLE[2]])  # K = 3 where problem 0 has 4
    ragged = {**EXAMPLE[2], "tokens": [10, 20, 30]}
    with pytest.raises(ValueError, match=r"problem 2\b"):
        summarize([EXAMPLE[0], EXAMPLE[1], ragged])  # lists of one problem differ in length
    missing = {k: v for k, v in EXAMPLE[0].items() if k != "timed_out"}
    with pytest.raises(ValueError, match=r"problem 0\b"):
        summarize([missing])
    with pytest.raises(ValueError):
        summarize([])


# ---- the real grader (math-verify in worker processes) on AIME answer formats ----

GOLD_CASES = [
    # (completion, gold, what math-verify decides) -- every outcome below was observed with math-verify 0.9.0
    ("Let me compute... </think> The answer is \\boxed{25}.", "25", True),
    ("... </think> The answer is \\boxed{025}.", "25", True),  # leading zeros
    ("... </think> \\boxed{\\frac{1}{2}}", "1/2", True),
    ("... </think> \\boxed{\\frac{1}{2}}", "0.5", True),
    ("... </think> \\boxed{0.5}", "1/2", True),
    ("... </think> So, after all of the above, the final answer is $\\boxed{33}$. Done!", "33", True),  # text around
    ("... </think> \\boxed{204^\\circ}", "204", True),  # degrees
    ("... </think> \\boxed{204^{\\circ}}", "204", True),
    ("... </think> \\boxed{\\text{25}}", "25", True),
    ("... </think> The answer is \\boxed{24}.", "25", False),  # wrong
    ("... </think> The answer is twenty five.", "25", False),  # no answer at all
    # Surprise: with no box at all math-verify falls back to the last number in the text, so a bare "25" passes
    # (extract_boxed finds no answer here, so such a sample counts as correct but casts no vote).
    ("... </think> The answer is 25.", "25", True),
    # Thinking never closed: the grader sees no answer part at all, even with a correct box inside the thinking.
    ("Thinking... so \\boxed{25} and I keep going", "25", False),
    # Only the part after the last </think> is graded: a box inside the thinking does not count.
    ("\\boxed{7} hmm, no. </think> \\boxed{25}", "25", True),
    ("\\boxed{25} hmm, no. </think> \\boxed{7}", "25", False),
    # Surprise: two boxes in the answer part parse as the set {7, 25}, which equals neither gold, whichever box comes
    # last -- unlike extract_boxed, which takes the last box for the vote.
    ("... </think> \\boxed{7}, or rather \\boxed{25}", "25", False),
    ("... </think> \\boxed{25}, or rather \\boxed{7}", "25", False),
    # Surprise: math-verify does not read \fbox (extract_boxed does), so a correct \fbox answer is graded wrong.
    ("... </think> \\fbox{25}", "25", False),
]


@pytest.fixture(scope="module")
def grades():
    with RewardGrader(num_workers=2, timeout_s=20.0) as grader:
        return grader.grade_many([(completion, gold) for completion, gold, _ in GOLD_CASES])


@pytest.mark.parametrize("index", range(len(GOLD_CASES)), ids=[f"{c[0][-28:]!r}-vs-{c[1]}" for c in GOLD_CASES])
def test_grader_on_answer_formats(grades, index):
    completion, gold, expected = GOLD_CASES[index]
    grade = grades[index]
    assert grade.error is None and not grade.timed_out, grade
    assert grade.correct is expected, (completion, gold, grade)


def test_unclosed_thinking_is_never_sent_to_the_verifier(grades):
    index = next(i for i, c in enumerate(GOLD_CASES) if "</think>" not in c[0])
    assert grades[index].seconds == 0.0 and not grades[index].correct


def test_summarize_real_grades_of_one_problem(grades):
    # four samples of the "25" problem: correct 25, correct 025, wrong 24, no answer
    picks = [0, 1, GOLD_CASES.index(("... </think> The answer is \\boxed{24}.", "25", False)),
             GOLD_CASES.index(("... </think> The answer is twenty five.", "25", False))]
    completions = [GOLD_CASES[i][0] for i in picks]
    answers = [extract_boxed(c.rsplit("</think>", 1)[1]) for c in completions]
    assert answers == ["25", "025", "24", None]
    summary = summarize([{"correct": [grades[i].correct for i in picks], "answers": answers,
                          "tokens": [10, 20, 30, 40], "truncated": [F] * 4,
                          "timed_out": [grades[i].timed_out for i in picks]}])
    assert summary["mean_at_k"] == pytest.approx(0.5)  # 2 of 4
    assert summary["pass_at_k"]["2"] == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert summary["cons_at_k"] == 1.0  # 25 and 025 outvote 24
    assert summary["grader_timeouts"] == 0
