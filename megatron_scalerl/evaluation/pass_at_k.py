"""Evaluation metrics over K graded samples per problem: mean@K, pass@k, cons@K (majority vote), lengths.

Pure math, no I/O. The per-sample verdicts come from the grader (`tasks.rewards.RewardGrader`, math-verify); this
module only counts them. The answer helper here (`normalize_answer`) serves the majority vote over what samples
answered (`tasks.answers.extract_boxed`); it never decides correctness.

    mean@K      average over problems of (correct samples / K): the expected pass@1, estimated from K samples.
    pass@k      average over problems of the unbiased estimator of Chen et al. 2021 from (K samples, c correct).
    cons@K      fraction of problems whose most frequent (normalized) answer among the K samples is correct.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_scalerl.tasks.answers import closing_brace


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate of one problem (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code", HumanEval): the probability that at least one of k samples drawn without replacement from the n generated
    ones is correct, when c of the n are correct.

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

    computed in the product form, which stays accurate where the binomials would overflow a float. `n`: samples
    generated, `c`: correct ones among them, `k`: the budget; all counts (ints). Returns a probability in [0, 1];
    exactly 1.0 when n - c < k (every k-subset holds a correct sample). Raises ValueError for negative counts,
    k < 1, k > n or c > n.
    """
    n, c, k = (operator.index(v) for v in (n, c, k))
    if n < 0 or c < 0 or k < 0:
        raise ValueError(f"pass_at_k: counts must be non-negative (n={n}, c={c}, k={k})")
    if k < 1:
        raise ValueError(f"pass_at_k: k must be at least 1 (got k={k})")
    if k > n:
        raise ValueError(f"pass_at_k: k={k} exceeds the number of samples n={n}")
    if c > n:
        raise ValueError(f"pass_at_k: c={c} correct exceeds the number of samples n={n}")
    if n - c < k:
        return 1.0
    miss = 1.0  # probability that k samples drawn without replacement are all wrong
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def ks_up_to(K: int) -> list[int]:
    """The budgets k reported for K samples per problem: the powers of two below K, then K itself.

    ks_up_to(8) == [1, 2, 4, 8]; ks_up_to(6) == [1, 2, 4, 6]; ks_up_to(1) == [1]. Raises ValueError for K < 1.
    """
    K = operator.index(K)
    if K < 1:
        raise ValueError(f"ks_up_to: K must be at least 1 (got {K})")
    ks, k = [], 1
    while k < K:
        ks.append(k)
        k *= 2
    return [*ks, K]


# ---- answers ----

_UNWRAP = ("text", "textbf", "textrm", "mathrm", "mbox")
_UNWRAP_RE = re.compile(r"\\(?:" + "|".join(_UNWRAP) + r")\s*\{")
_SIZING = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_THIN_SPACES = re.compile(r"\\[!,;: ]")
_DEGREES = re.compile(r"\^\{?\\circ\}?")
_INTEGER = re.compile(r"[+-]?\d+")
_DECIMAL = re.compile(r"([+-]?)(\d*)\.(\d+)")


def _unwrap(text: str) -> str:
    """`\\text{cm}` -> `cm` (also \\textbf, \\textrm, \\mathrm, \\mbox), nested ones too; an unclosed one is kept."""
    while True:
        for m in _UNWRAP_RE.finditer(text):
            end = closing_brace(text, m.end())
            if end is not None:
                text = text[:m.start()] + text[m.end():end] + text[end + 1:]
                break
        else:
            return text


def _canonical_number(text: str) -> str:
    """Integers and plain decimals written canonically: "025" -> "25", "-0" -> "0", "+7" -> "7", "2.50" -> "2.5",
    "3.0" -> "3", ".5" -> "0.5"; anything else is returned as is."""
    if _INTEGER.fullmatch(text):
        return str(int(text))
    m = _DECIMAL.fullmatch(text)
    if m is None:
        return text
    sign, whole, frac = m.groups()
    whole, frac = str(int(whole or "0")), frac.rstrip("0")
    if whole == "0" and not frac:
        return "0"
    return f"{'-' if sign == '-' else ''}{whole}{'.' + frac if frac else ''}"


def normalize_answer(answer: str) -> str:
    """A key that groups answers written differently but identically meant, for the majority vote (cons@K).

    Removes surrounding whitespace and all `$` (also `\\$`), keeps the content of `\\text{...}` wrappers (and of
    \\textbf, \\textrm, \\mathrm, \\mbox), drops `\\left` / `\\right`, thin spaces (`\\!`, `\\,`, `\\;`, `\\:`,
    `\\ `), all whitespace, degree marks (`^\\circ`, `^{\\circ}`) and one trailing period; reads `\\dfrac` and
    `\\tfrac` as `\\frac`; writes integers and plain decimals canonically ("025" -> "25", "-0" -> "0", "2.50" -> "2.5").

    This only decides which answers vote together: "1/2" and "\\frac{1}{2}" stay different keys. Whether an answer is
    correct is the grader's decision (math-verify against the gold answer), never this function's.
    """
    s = answer.strip().replace("\\$", "").replace("$", "")
    s = _unwrap(s)
    s = _SIZING.sub("", s)
    s = _THIN_SPACES.sub("", s)
    s = "".join(s.split())
    s = _DEGREES.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    if s.endswith("."):
        s = s[:-1]
    return _canonical_number(s)


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most frequent answer among `answers` (one per sample; None: no answer), compared by `normalize_answer`,
    and returned in that normalized form. A tie goes to the answer whose first occurrence comes first. None when no
    sample has an answer.
    """
    counts: dict[str, int] = {}  # insertion order = order of first appearance
    for a in answers:
        if a is not None:
            key = normalize_answer(a)
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None
    best = max(counts.values())
    return next(key for key, n in counts.items() if n == best)


# ---- summary over problems ----

_FIELDS = ("correct", "answers", "tokens", "truncated", "timed_out")


def _field(result: Any, name: str, index: int) -> list:
    try:
        value = result[name] if isinstance(result, Mapping) else getattr(result, name)
    except (KeyError, AttributeError) as e:
        raise ValueError(f"problem {index}: no {name!r} in its result") from e
    return list(value)


def summarize(results: Sequence[Any]) -> dict[str, Any]:
    """Figures of one evaluation from its per-problem results.

    `results`: one entry per problem, a dict or an object with, per sample (K of them, the same K for every problem):
    `correct: list[bool]` (the grader's verdicts), `answers: list[str | None]` (extracted answers, None: none),
    `tokens: list[int]` (completion tokens), `truncated: list[bool]` (hit the length cap), `timed_out: list[bool]`
    (the grader ran out of time; such a sample is also not correct).

    Returns a dict with exactly these keys:
      problems               number of problems (int)
      samples_per_problem    K (int)
      mean_at_k              mean over problems of (correct samples / K) = the average pass@1
      pass_at_k              {str(k): mean over problems of pass_at_k(K, c, k)} for k in ks_up_to(K)
      cons_at_k              fraction of problems whose majority answer (`majority_answer`) is correct: its
                             correctness is that of the first sample carrying that normalized answer; a problem where
                             no sample has an answer counts as wrong
      response_length_mean   mean completion length over all samples, in tokens
      truncation_rate        fraction of all samples truncated
      grader_timeouts        number of samples whose grading timed out (int)

    Raises ValueError, naming the problem's index, when a problem's K differs from the first problem's or its lists
    have different lengths; also for no problems or K = 0.
    """
    if not results:
        raise ValueError("summarize: no problems")
    K = None
    rows = []
    for i, result in enumerate(results):
        row = {name: _field(result, name, i) for name in _FIELDS}
        lengths = {name: len(v) for name, v in row.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"problem {i}: per-sample lists differ in length: {lengths}")
        k_here = lengths["correct"]
        if K is None:
            if k_here < 1:
                raise ValueError(f"problem {i}: no samples")
            K = k_here
        elif k_here != K:
            raise ValueError(f"problem {i}: {k_here} samples, but problem 0 has {K}")
        rows.append(row)
    assert K is not None

    n = len(rows)
    ks = ks_up_to(K)
    corrects = [sum(bool(x) for x in row["correct"]) for row in rows]
    cons = 0
    for row in rows:
        vote = majority_answer(row["answers"])
        if vote is None:
            continue
        first = next(j for j, a in enumerate(row["answers"]) if a is not None and normalize_answer(a) == vote)
        cons += bool(row["correct"][first])
    samples = n * K
    return {
        "problems": n,
        "samples_per_problem": K,
        "mean_at_k": sum(c / K for c in corrects) / n,
        "pass_at_k": {str(k): sum(pass_at_k(K, c, k) for c in corrects) / n for k in ks},
        "cons_at_k": cons / n,
        "response_length_mean": sum(float(t) for row in rows for t in row["tokens"]) / samples,
        "truncation_rate": sum(bool(x) for row in rows for x in row["truncated"]) / samples,
        "grader_timeouts": sum(bool(x) for row in rows for x in row["timed_out"]),
    }
