"""The demo's model: a tiny Llama-4 MoE (the recipe's model section) with random weights, and a tokenizer trained on
the recipe's own prompts, so nothing comes from a hub.

    build_model(recipe, out_dir, seed=0)   # out_dir: config.json, model.safetensors, tokenizer files

The tokenizer's corpus is what the run will feed it: each problem rendered with its own source's template, a worked
completion in its domain's format (`solution_text`: thinking, then `\\boxed{...}` or a ```python block) and the
interruption phrase, which therefore becomes a handful of tokens. The tokenizer's chat template is that format's
(`prompts.PLAIN_CHAT_TEMPLATE`): a chat client of `scalerl serve` (the OpenAI chat route) sends the model the text the
run trains on, and `render_prompt` renders the same prompts with it as without it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.models.tokenizer import special_token_ids, train_tokenizer
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.recipe.variants import Interruption
from megatron_scalerl.tasks.environments import observation_text, tool_output, with_tool_note
from megatron_scalerl.tasks.problems import Problem, load_sources
from megatron_scalerl.tasks.prompts import PLAIN_CHAT_TEMPLATE, THINK_CLOSE, THINK_OPEN, conversation, render_prompt
from megatron_scalerl.tasks.sandbox import RunResult

PHRASE_REPEATS = 200  # copies of the interruption phrase in the corpus: enough for BPE to merge it into few tokens
ARITHMETIC = re.compile(r"[\d\s+\-*/().]*\d")  # an arithmetic expression in a problem's text (`tool_trace`)


def solution_text(problem: Problem, *, close_thinking: bool = True) -> str:
    """A worked completion in the format of the problem's template: thinking, the end of thinking, then the answer
    (math: the gold answer boxed; code: the reference solution, `problem.answer`, in a ```python block). Without
    `close_thinking` it stops after the thinking, so it has no answer (the grader scores it wrong)."""
    if problem.template == "code":
        thinking, answer = problem.problem.strip(), f"```python\n{problem.answer}\n```"
    else:
        thinking, answer = f"{problem.problem.strip()} gives {problem.answer}.", f"\\boxed{{{problem.answer}}}"
    return f"{thinking}\n{THINK_CLOSE}\n{answer}" if close_thinking else thinking


def tool_trace(problem: Problem) -> tuple[str, str, str]:
    """A worked completion that calls python_tool (tasks/environments.py) for an arithmetic problem, in its three
    parts: the model's reply up to its closed block (thinking, then ```python print(EXPRESSION)```), the observation
    the tool answers with (the gold answer in an ```output block, as the tool writes it), and the rest (the end of
    thinking, the boxed answer). Training needs the parts apart: the observation is not the model's to learn, and
    the tool's tokens are appended, not merged with the model's."""
    expressions = [e.strip() for e in ARITHMETIC.findall(problem.problem) if any(op in e for op in "+-*/")]
    if not expressions:
        raise UserError(f"{problem.key}: no arithmetic expression in {problem.problem!r} for a tool trace")
    reply = f"```python\nprint({max(expressions, key=len)})\n```"
    observation = observation_text(reply, tool_output(RunResult(f"{problem.answer}\n", "", 0, 0.0, None)))
    return reply, observation, f"{THINK_CLOSE}\n\\boxed{{{problem.answer}}}"


def interruption_of(recipe: Recipe) -> Interruption:
    """The recipe's forced interruption: the format the tiny model's tokenizer and warm start are made for (the
    demo presets the demo builds from, `demo` and `demo_mix`, have it)."""
    control = recipe.algorithm.length_control
    if not isinstance(control, Interruption):
        raise UserError(f"{recipe.name}: the demo builds and warm-starts its tiny model for forced interruption "
                        f"(algorithm.length_control.mode: interruption), not {control.mode}")
    return control


def tokenizer_corpus(recipe: Recipe) -> list[str]:
    """Every training problem's prompt (its own template; python_tool's note for a source with the tool) with its
    worked completion (and its tool trace, with the tool), and the interruption phrase."""
    problems = [p for source in load_sources(recipe.data.train, seed=recipe.data_seed) for p in source.problems]
    texts = [render_prompt(p, messages=prompt_messages(p)) + solution_text(p) for p in problems]
    texts += ["".join(tool_trace(p)) for p in problems if p.environment == "python_tool"]
    return texts + [interruption_of(recipe).interruption_phrase] * PHRASE_REPEATS


def prompt_messages(problem: Problem) -> list[dict[str, str]]:
    """The chat messages of `problem`'s prompt as its run renders them: python_tool adds its note; the demo knows no
    other environment."""
    if problem.environment not in (None, "python_tool"):
        raise UserError(f"{problem.key}: the demo's model is built for python_tool, not environment "
                        f"{problem.environment!r}")
    messages = conversation(problem)
    return with_tool_note(messages) if problem.environment == "python_tool" else messages


def build_model(recipe: Recipe, out_dir: str | Path, *, seed: int = 0, digit_groups: bool = False) -> Path:
    """Write an HF checkpoint of `recipe.model` with random weights and the trained tokenizer (with the plain
    format's chat template; `digit_groups`: numbers tokenized alike wherever written, `train_tokenizer`); returns `out_dir`."""
    out = Path(out_dir)
    tokenizer = train_tokenizer(tokenizer_corpus(recipe), vocab_size=recipe.model.vocab_size,
                                markers=(THINK_OPEN, THINK_CLOSE), digit_groups=digit_groups)
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    save_random_hf_model(recipe.model, out, seed=seed)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.update(special_token_ids(tokenizer))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
