"""The README is a manual users follow: short enough to read, and every command it shows exists.

1. README.md is at most `MAX_README_CHARS` characters (measurements live in docs/benchmarks.md, history in
   CHANGELOG.md).
2. Every `scalerl` command the README shows, in fenced code blocks and in inline code, names real (sub)commands of
   `megatron_scalerl.commands.build_parser()`, and every `--flag` after it exists on that subcommand's parser; every
   `make` target it names is a target of the Makefile; no Python one-liner (`python -c`) stands in for a command.
3. No file of the repository cites the development notes kept beside the checkout (`OUTSIDE_NOTES`): users do not
   have them.
4. The status table's tests exist: every `test_...` name or pattern in its Tests column matches a file of tests/, and
   every `make` target there is the Makefile's.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_scalerl.commands import build_parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_CHARS = 25_000

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")"}
REDIRECTS = {">", ">>", "<", "2>", "2>&1", "&>"}
WRAPPERS = {"sudo", "time", "exec", "nohup", "env"}  # words that run the command after them
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# The cited paths are spelled in pieces so that this file does not cite them itself.
OUTSIDE_NOTES = ("../" + "shared", "shared" + "/docs")


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def code_snippets(text: str) -> list[tuple[str, str]]:
    """(where, shell text) of every fenced code block line and every inline code span outside the blocks; a line
    continued with a backslash is joined with the next."""
    snippets = []
    for block in FENCE.finditer(text):
        line_no = text.count("\n", 0, block.start()) + 2
        body = re.sub(r"\\\n", " ", block.group(1))
        snippets += [(f"README.md code block at line {line_no}", line) for line in body.splitlines() if line.strip()]
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in INLINE.finditer(prose):
        line_no = prose.count("\n", 0, span.start()) + 1
        snippets.append((f"README.md line {line_no} (inline)", span.group(2).replace("\n", " ")))
    return snippets


def tokens(line: str) -> list[str]:
    """Shell words of `line`, operators (`|`, `&&`, `;`, redirections) as words of their own, comments dropped.
    Placeholders such as `[--tp N]` or `<jobid>` are words too; a line shlex cannot read (an unbalanced quote in
    prose) falls back to splitting on white space."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:
        return line.split("#", 1)[0].split()


def commands(words: list[str]) -> list[list[str]]:
    """The simple commands of a tokenised line: split at `|`, `&&`, `;` ..., each cut at its first redirection."""
    out, current = [], []
    for word in [*words, ";"]:
        if word in SEPARATORS:
            if current:
                out.append(current)
            current = []
        else:
            current.append(word)
    cut = []
    for command in out:
        for i, word in enumerate(command):
            if word in REDIRECTS or word.startswith((">", "<")):
                command = command[:i]
                break
        cut.append(command)
    return [c for c in cut if c]


def command_word(command: list[str]) -> tuple[str, list[str]]:
    """(the program's name, its arguments): leading `VAR=value` assignments and wrappers such as `sudo` skipped, a
    path such as `.venv/bin/scalerl` reduced to its name."""
    i = 0
    while i < len(command) and (ENV_ASSIGNMENT.match(command[i]) or command[i] in WRAPPERS):
        i += 1
    if i == len(command):
        return "", []
    return command[i].rsplit("/", 1)[-1], command[i + 1:]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def clean(word: str) -> str:
    """A word without the brackets, braces and punctuation that placeholders and prose put around it."""
    return word.strip("[](){},.:'\"")


def scalerl_problems(args: list[str], root: argparse.ArgumentParser) -> list[str]:
    """What is wrong with `scalerl ARGS`: an unknown (sub)command, or a flag its parser does not have."""
    parser, path = root, ["scalerl"]
    rest = list(args)
    while rest:
        choices = subcommands(parser)
        word = clean(rest[0])
        if not choices or word.startswith("-") or word in ("", "...", "…"):
            break
        if word not in choices:
            return [f"`{' '.join(path)} {word}`: no such subcommand (known: {', '.join(sorted(choices))})"]
        parser = choices[word]
        path.append(word)
        rest.pop(0)
    problems = []
    for raw in rest:
        word = clean(raw)
        if word == "--":  # what follows goes to another program (`scalerl serve ... -- vLLM flags`)
            break
        if not word.startswith("-") or word in ("-", "--") or re.fullmatch(r"-[\d.]+", word) or word.startswith("-..."):
            continue
        flag = word.split("=", 1)[0]
        if flag not in parser._option_string_actions:
            known = sorted(s for s in parser._option_string_actions if s.startswith("--"))
            problems.append(f"`{' '.join(path)}` has no flag {flag} (its flags: {', '.join(known)})")
    return problems


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", text, re.MULTILINE)}


def make_problems(args: list[str], targets: set[str]) -> list[str]:
    named = [clean(a) for a in args if not a.startswith("-") and "=" not in a]
    return [f"`make {t}`: no such target in the Makefile (targets: {', '.join(sorted(targets))})"
            for t in named if t and t not in targets and t not in ("...", "…")]


def readme_command_problems(text: str) -> list[str]:
    root, targets = build_parser(), makefile_targets()
    problems = []
    for where, snippet in code_snippets(text):
        for command in commands(tokens(snippet)):
            name, args = command_word(command)
            if name == "scalerl":
                problems += [f"{where}: {p}" for p in scalerl_problems(args, root)]
            elif name == "make":
                problems += [f"{where}: {p}" for p in make_problems(args, targets)]
    return problems


# ---- the checker itself ----


def test_the_checker_finds_commands_and_flags_in_blocks_and_inline_code():
    text = ("Run `scalerl forecast fit RUN --budgets 16k --no-such-flag` or:\n\n```bash\n"
            "OMP_NUM_THREADS=1 .venv/bin/scalerl recipe show scalerl \\\n    --model tiny_moe --plan  # a comment --bogus\n"
            "scalerl recipe frobnicate x && make no-such-target\n"
            "scalerl serve --model DIR [--tp N] -- --load-format dummy | tee log\n```\n"
            "`scalerl eval` alone, `--resume` alone and `make demo` are fine.\n")
    problems = readme_command_problems(text)
    assert len(problems) == 3, problems
    assert "`scalerl forecast fit` has no flag --no-such-flag" in problems[2]
    assert "`scalerl recipe frobnicate`: no such subcommand" in problems[0]
    assert "`make no-such-target`: no such target" in problems[1]


# ---- the README ----


def test_readme_is_at_most_25000_characters():
    size = len(readme_text())
    assert size <= MAX_README_CHARS, f"README.md is {size} characters; at most {MAX_README_CHARS}"


def test_every_scalerl_command_and_flag_and_make_target_in_the_readme_exists():
    problems = readme_command_problems(readme_text())
    assert not problems, "README.md shows commands the CLI or Makefile lacks:\n" + "\n".join(problems)


def test_the_readme_shows_commands_not_python_one_liners():
    lines = [f"line {i}: {line.strip()}" for i, line in enumerate(readme_text().splitlines(), 1)
             if re.search(r"\bpython[\d.]*\s+-c\b", line)]
    assert not lines, "README.md uses Python one-liners instead of commands:\n" + "\n".join(lines)


def status_rows(text: str) -> list[tuple[str, list[str]]]:
    """(capability, the backticked names of its Tests column) of every row of the README's status table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| Capability |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[2])))
    return rows


def test_every_capability_rows_named_tests_exist():
    rows = status_rows(readme_text())
    assert len(rows) >= 20 and sum(len(names) for _, names in rows) >= 30  # the table was found and read
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))
    missing = []
    for capability, names in rows:
        for name in names:
            if name.startswith("make "):
                found = name.split()[1] in targets
            elif name.startswith("test_"):
                found = bool(list((REPO / "tests").rglob(f"{name}.py")) or list((REPO / "tests").rglob(f"{name}")))
            else:
                found = False
            if not found:
                missing.append(f"{capability!r}: {name}")
    assert not missing, "README.md's status table names tests that do not exist:\n" + "\n".join(missing)


# ---- no citation of notes users do not have ----


def repository_files() -> list[Path]:
    """Tracked files, plus new files not yet added that git does not ignore."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode()
    return [REPO / name for name in sorted(set(listed.split("\0"))) if name and (REPO / name).is_file()]


def test_no_file_cites_notes_outside_the_repository():
    cited = []
    for path in repository_files():
        lines = [i for i, line in enumerate(path.read_bytes().split(b"\n"), 1)
                 if any(needle.encode() in line for needle in OUTSIDE_NOTES)]
        if lines:
            cited.append(f"{path.relative_to(REPO)}: line {', '.join(map(str, lines))}")
    assert not cited, "files cite notes users do not have:\n" + "\n".join(cited)
