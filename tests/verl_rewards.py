"""A reward module written the way verl's examples write one (verl/utils/reward_score/gsm8k.py and the docs' custom
reward function): `compute_score(data_source, solution_str, ground_truth, extra_info=None)`. The tests name it as a
verifier, `tests.verl_rewards:compute_score`, exactly as a user's recipe names their own file's function."""

import re

_SOLUTION_CLIP_CHARS = 300


def extract_solution(solution_str, method="strict"):
    assert method in ["strict", "flexible"]
    # Optimization: regular expression matching on very long strings can be slow.
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        if len(solutions) == 0:
            final_answer = None
        else:
            final_answer = solutions[-1].replace(",", "").replace("$", "")
    else:
        answer = re.findall("(\\-?[0-9\\.\\,]+)", solution_str)
        final_answer = None
        if len(answer) == 0:
            pass
        else:
            invalid_str = ["", "."]
            for final_answer in reversed(answer):
                if final_answer not in invalid_str:
                    break
    return final_answer


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """GSM8K's rule: 1.0 for the right `#### N`, a format score of 0.1 for a `#### N` that is wrong, 0 without one.
    Returns verl's dict form: the score and what else to log."""
    answer = extract_solution(solution_str=solution_str, method="strict")
    if answer is None:
        score = 0.0
    elif answer == ground_truth:
        score = 1.0
    else:
        score = 0.1
    return {"score": score, "formatted": float(answer is not None),
            "split_is_test": float((extra_info or {}).get("split") == "test"), "source_is_gsm8k": float(
                data_source == "openai/gsm8k")}


def length_score(data_source, solution_str, ground_truth):
    """The docs' shortest example (no extra_info parameter): a plain float."""
    return len(solution_str) / 100
