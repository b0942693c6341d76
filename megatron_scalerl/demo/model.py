"""The demo's model: a tiny Llama-4 MoE (the recipe's model section) with random weights, and a tokenizer trained on
the recipe's own prompts, so nothing comes from a hub.

    build_model(recipe, out_dir, seed=0)   # out_dir: config.json, model.safetensors, tokenizer files

The tokenizer's corpus is what the run will feed it: rendered prompts, answers in the recipe's format (thinking, then
`\\boxed{...}`) and the interruption phrase, which therefore becomes a handful of tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_scalerl.models.hf_io import save_random_hf_model
from megatron_scalerl.models.tokenizer import special_token_ids, train_tokenizer
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.tasks.prompts import THINK_CLOSE, THINK_OPEN, Problem, load_sources, render_prompt

PHRASE_REPEATS = 200  # copies of the interruption phrase in the corpus: enough for BPE to merge it into few tokens


def solution_text(problem: Problem, *, close_thinking: bool = True) -> str:
    """A worked completion in the recipe's format: thinking, the end of thinking, the boxed answer. Without
    `close_thinking` it stops after the thinking, so it has no answer (the grader scores it wrong)."""
    thinking = f"{problem.problem.strip()} gives {problem.answer}."
    return f"{thinking}\n{THINK_CLOSE}\n\\boxed{{{problem.answer}}}" if close_thinking else thinking


def tokenizer_corpus(recipe: Recipe) -> list[str]:
    problems = [p for problems, _ in load_sources(recipe.data.train, seed=recipe.trainer.seed) for p in problems]
    texts = [render_prompt(p.problem) + solution_text(p) for p in problems]
    return texts + [recipe.algorithm.length_control.interruption_phrase] * PHRASE_REPEATS


def build_model(recipe: Recipe, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write an HF checkpoint of `recipe.model` with random weights and the trained tokenizer; returns `out_dir`."""
    out = Path(out_dir)
    tokenizer = train_tokenizer(tokenizer_corpus(recipe), vocab_size=recipe.model.vocab_size,
                                markers=(THINK_OPEN, THINK_CLOSE))
    save_random_hf_model(recipe.model, out, seed=seed)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.update(special_token_ids(tokenizer))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
