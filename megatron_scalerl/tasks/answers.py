"""Answers: the part of a reply that a verifier comparing with the gold answer reads, by a source's `answer_format`.

    extract_answer(r"... so \\boxed{42}.", "boxed") == "42"
    extract_answer("3 + 4 = 7, then 7 * 2 = 14", "last_number") == "14"
    gold_answer("Natalia sold 48 + 24 = 72 clips.\\n#### 72", "hash") == "72"

Formats (recipe: a source's `answer_format`):
  math_verify    the whole answer part, as it is: math-verify finds the answer in it (the default)
  boxed          the content of the last `\\boxed{...}` (braces balanced; `\\fbox` too)
  hash           the text after the last `####`, as GSM8K writes its gold answers (the gold is read so too)
  last_number    the last number: an optional minus, digits with optional thousands commas, an optional decimal part
  regex:PATTERN  group 1 of the pattern's last match

`extract_answer` returns None when the reply holds no answer of that form (graded "no_answer"). Pure text functions:
grader workers call them (a user's pattern runs under the grader's per-answer timeout).
"""

from __future__ import annotations

import re

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
HASH = "####"


def closing_brace(text: str, start: int) -> int | None:
    """The index of the `}` that closes the group whose `{` is text[start - 1]; None when it never closes.
    A backslash escapes the next character, so `\\{` and `\\}` (literal braces) do not count."""
    depth, i = 1, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, with balanced braces, stripped of
    surrounding whitespace: `... \\boxed{\\frac{1}{2}}.` -> `\\frac{1}{2}`. None when there is no box, or when the
    last box's braces never close (a completion cut off mid-answer). Escaped braces (`\\{`, `\\}`) are content.
    """
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    end = closing_brace(text, start)
    return None if end is None else text[start:end].strip()


def _after_hash(text: str) -> str | None:
    """The first line of text after the last `####`; None without one (or with nothing after it)."""
    if HASH not in text:
        return None
    lines = text.rsplit(HASH, 1)[1].strip().splitlines()
    return lines[0].strip() if lines else None


def extract_answer(text: str, answer_format: str = "math_verify") -> str | None:
    """The answer `text` gives in `answer_format` (module docstring); None when it gives none."""
    if answer_format == "math_verify":
        return text.strip() or None
    if answer_format == "boxed":
        found = extract_boxed(text)
    elif answer_format == "hash":
        found = _after_hash(text)
    elif answer_format == "last_number":
        numbers = _NUMBER.findall(text)
        found = numbers[-1].replace(",", "") if numbers else None
    elif answer_format.startswith("regex:"):
        matches = list(re.finditer(answer_format.removeprefix("regex:"), text))
        found = matches[-1].group(1) if matches and matches[-1].group(1) is not None else None
    else:
        raise ValueError(f"unknown answer format {answer_format!r}")
    return (found.strip() or None) if found is not None else None


def gold_answer(gold: str, answer_format: str = "math_verify") -> str:
    """The gold answer to compare with: under `hash`, the text after a `####` in it (GSM8K's golds end so), else
    the gold as given."""
    if answer_format == "hash":
        return _after_hash(gold) or gold.strip()
    return gold
