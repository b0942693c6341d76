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
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.models.tokenizer import special_token_ids, train_tokenizer
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.recipe.variants import Interruption
from megatron_scalerl.tasks.problems import Problem, load_sources
from megatron_scalerl.tasks.prompts import PLAIN_CHAT_TEMPLATE, THINK_CLOSE, THINK_OPEN, render_prompt

PHRASE_REPEATS = 200  # copies of the interruption phrase in the corpus: enough for BPE to merge it into few tokens


def solution_text(problem: Problem, *, close_thinking: bool = True) -> str:
    """A worked completion in the format of the problem's template: thinking, the end of thinking, then the answer
    (math: the gold answer boxed; code: the reference solution, `problem.answer`, in a ```python block). Without
    `close_thinking` it stops after the thinking, so it has no answer (the grader scores it wrong)."""
    if problem.template == "code":
        thinking, answer = problem.problem.strip(), f"```python\n{problem.answer}\n```"
    else:
        thinking, answer = f"{problem.problem.strip()} gives {problem.answer}.", f"\\boxed{{{problem.answer}}}"
    return f"{thinking}\n{THINK_CLOSE}\n{answer}" if close_thinking else thinking


def interruption_of(recipe: Recipe) -> Interruption:
    """The recipe's forced interruption: the format the tiny model's tokenizer and warm start are made for (the
    demo presets the demo builds from, `demo` and `demo_mix`, have it)."""
    control = recipe.algorithm.length_control
    if not isinstance(control, Interruption):
        raise UserError(f"{recipe.name}: the demo builds and warm-starts its tiny model for forced interruption "
                        f"(algorithm.length_control.mode: interruption), not {control.mode}")
    return control


def tokenizer_corpus(recipe: Recipe) -> list[str]:
    """Every training problem's prompt (its own template) with its worked completion, and the interruption phrase."""
    problems = [p for source in load_sources(recipe.data.train, seed=recipe.data_seed) for p in source.problems]
    texts = [render_prompt(p) + solution_text(p) for p in problems]
    return texts + [interruption_of(recipe).interruption_phrase] * PHRASE_REPEATS


def build_model(recipe: Recipe, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write an HF checkpoint of `recipe.model` with random weights and the trained tokenizer (with the plain
    format's chat template); returns `out_dir`."""
    out = Path(out_dir)
    tokenizer = train_tokenizer(tokenizer_corpus(recipe), vocab_size=recipe.model.vocab_size,
                                markers=(THINK_OPEN, THINK_CLOSE))
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    save_random_hf_model(recipe.model, out, seed=seed)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.update(special_token_ids(tokenizer))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
