"""The demo's warm start: a short supervised stage that teaches the random tiny model the answer format, stopped as
soon as its sampled pass rate on the run's held-out prompts reaches the demo's starting band, in every domain.

    result = warm_start(recipe, hf_dir, out_dir, target=0.15)   # out_dir: the warm-started HF checkpoint

RL needs a policy that is sometimes right: from a random model every reward is -1 and every group is filtered out.
The supervised data are the recipe's training prompts (the validation holdout is excluded, as in the run), each
rendered with its source's template, with a worked completion (`model.solution_text`: a boxed answer, or the
reference solution in a ```python block) and EOS, a chosen share of them never closing the thinking block (no
answer: what RL then learns away first); the loss covers the completion only. Every `eval_every` steps the model
samples `eval_samples` completions for each of the first `eval_prompts` held-out prompts of every domain at the
recipe's temperature, graded like the run (thinking stripped, then the problem's own verifier: math-verify, or the
code verifier running the problem's tests); training stops at the first evaluation where every domain is at or
above `target`, so the run starts between the target and what RL can still improve in each. With tool traces
(`tool_fraction` of a python_tool source's completions call the tool, the observation out of the loss) the figure
is instead the share of held-out traces the model writes itself, greedily, around the tool's output: this
evaluation runs no tool. Plain PyTorch on transformers' model (CPU, fp32).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_scalerl.demo.model import interruption_of, prompt_messages, solution_text, tool_trace
from megatron_scalerl.models.hf_io import load_hf_causal_lm
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.tasks.problems import Problem, load_sources
from megatron_scalerl.tasks.prompts import render_prompt, split_validation
from megatron_scalerl.tasks.rewards import grade_here


@dataclass(frozen=True)
class WarmStart:
    steps: int  # optimizer steps taken
    pass_rate: float  # the last evaluation's sampled pass rate on the held-out prompts, all domains together
    domain_pass_rates: dict[str, float]  # the last evaluation's, per domain (the stop rule's figures)
    history: list[tuple[int, float]]  # (step, pass rate of all domains together) of every evaluation
    seconds: float


def _examples(tokenizer, problems: list[Problem], *, unclosed_fraction: float, tool_fraction: float, seed: int
              ) -> list[tuple[list[int], list[bool]]]:
    """(token ids of prompt + completion + EOS, which of them the loss covers) per problem; a seeded
    `unclosed_fraction` of the completions stop after their thinking (no answer); of a python_tool problem's, a
    seeded `tool_fraction` call the tool (`model.tool_trace`: the observation's tokens appended as the tool's are,
    out of the loss)."""
    coin = random.Random(seed)
    out = []
    for problem in problems:
        prompt = tokenizer(render_prompt(problem, tokenizer, prompt_messages(problem))).input_ids
        if problem.environment == "python_tool" and coin.random() < tool_fraction:
            reply, observation, rest = (tokenizer.encode(part, add_special_tokens=False) for part in tool_trace(problem))
            completion = [*reply, *observation, *rest, tokenizer.eos_token_id]
            learned = [True] * len(reply) + [False] * len(observation) + [True] * (len(rest) + 1)
        else:
            closed = coin.random() >= unclosed_fraction
            completion = [*tokenizer.encode(solution_text(problem, close_thinking=closed), add_special_tokens=False),
                          tokenizer.eos_token_id]
            learned = [True] * len(completion)
        out.append(([*prompt, *completion], [False] * len(prompt) + learned))
    return out


def _batch(examples: list[tuple[list[int], list[bool]]], pad_id: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids [B, T], attention mask [B, T] and labels [B, T] (-100 where the loss does not reach)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (tokens, learned) in enumerate(examples):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
        labels[row, :len(tokens)] = torch.where(torch.tensor(learned), torch.tensor(tokens), -100)
    return ids, mask, labels


def new_tokens_cap(recipe: Recipe, template: str) -> int:
    """Tokens a warm-start evaluation samples per completion of a `template` problem: the thinking budget's maximum
    (a worked math completion is under 20 tokens), plus the answer budget for code (its fenced solution alone is
    about 20)."""
    budget = interruption_of(recipe)
    return budget.think_budget_max + (budget.answer_budget if template == "code" else 0)


@torch.no_grad()
def sampled_pass_rate(model, tokenizer, problems: list[Problem], *, samples: int, temperature: float,
                      max_new_tokens: int, seed: int) -> float:
    """Mean correctness of `samples` sampled completions per problem (left-padded batch generation)."""
    tokenizer.padding_side = "left"
    asked = [p for p in problems for _ in range(samples)]  # one entry per completion
    prompts = [render_prompt(p, tokenizer) for p in asked]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    out = model.generate(**encoded, do_sample=True, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, encoded.input_ids.shape[1]:], skip_special_tokens=False)
    texts = [t.replace(tokenizer.eos_token, "").replace(tokenizer.pad_token, "") for t in texts]
    return sum(grade_here(t, p).correct for t, p in zip(texts, asked, strict=True)) / len(texts)


def trace_batch(tokenizer, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`problems`' tool traces (`model.tool_trace`, every one calling the tool) as `reproduced_traces` scores them:
    input ids, attention mask, and the token wanted after each position (-100 where none is scored: the prompt, the
    observation as the tool writes it, padding, and each trace's first trained token, the choice to call the tool at
    all, which is the warm start's `tool_fraction`, not a skill)."""
    examples = _examples(tokenizer, problems, unclosed_fraction=0.0, tool_fraction=1.0, seed=0)
    ids, mask, labels = _batch(examples, tokenizer.pad_token_id)
    wanted = labels[:, 1:].clone()
    wanted[torch.arange(len(wanted)), (wanted != -100).int().argmax(dim=1)] = -100
    return ids, mask, wanted


def reproduced_traces(model, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
    """Share of the traces of `batch` (`trace_batch`) whose every scored token the model predicts greedily from the
    trace before it."""
    ids, mask, wanted = batch
    with torch.no_grad():
        predicted = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
    return ((predicted == wanted) | (wanted == -100)).all(dim=1).float().mean().item()


def held_out_by_domain(validation: list[Problem], count: int) -> dict[str, list[Problem]]:
    """The first `count` held-out problems of each domain, domains in order of first appearance."""
    domains: dict[str, list[Problem]] = {}
    for problem in validation:
        domains.setdefault(problem.domain, [])
        if len(domains[problem.domain]) < count:
            domains[problem.domain].append(problem)
    return domains


@contextlib.contextmanager
def _every_core():
    """torch on all cores for a while (the supervised stage runs alone; the run's roles share the cores later)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def warm_start(recipe: Recipe, hf_dir: str | Path, out_dir: str | Path, *, target: float = 0.15,
               max_steps: int = 600, batch_size: int = 32, lr: float = 2e-3, eval_every: int = 25,
               eval_prompts: int = 32, eval_samples: int = 2, unclosed_fraction: float = 0.0,
               tool_fraction: float = 0.0) -> WarmStart:
    """Supervised steps on `hf_dir`'s model until the held-out figure of every domain reaches `target` (or
    `max_steps`); writes the model and tokenizer to `out_dir`. The figure: the sampled pass rate, or with
    `tool_fraction` (the share of a python_tool source's completions that call the tool) the share of held-out tool
    traces the model reproduces (`reproduced_traces`, their batches built once: this evaluation runs no tool, and a model that needs its tool
    is never right without it). `eval_prompts`: held-out prompts per domain. `unclosed_fraction`: share of the
    supervised completions that never close their thinking (so have no answer), like a base model that follows the
    answer format only some of the time."""
    from transformers import AutoTokenizer  # deferred: transformers loads in seconds

    start = time.monotonic()
    seed = recipe.trainer.seed
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    model = load_hf_causal_lm(hf_dir, dtype=torch.float32)
    train, validation = split_validation(load_sources(recipe.data.train, seed=recipe.data_seed),
                                         recipe.data.validation_holdout, seed=recipe.data_seed)
    examples = _examples(tokenizer, [p for source in train for p in source.problems],
                         unclosed_fraction=unclosed_fraction, tool_fraction=tool_fraction, seed=seed)
    held_out = held_out_by_domain(validation, eval_prompts)
    traces = {domain: trace_batch(tokenizer, problems) for domain, problems in held_out.items()} if tool_fraction else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    order = random.Random(seed)
    history: list[tuple[int, float]] = []
    step, rate, rates = 0, 0.0, dict.fromkeys(held_out, 0.0)
    with _every_core():
        while step < max_steps:
            model.train()
            ids, mask, labels = _batch(order.sample(examples, batch_size), tokenizer.pad_token_id)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if step % eval_every and step != max_steps:
                continue
            model.eval()
            rates = {domain: reproduced_traces(model, traces[domain]) if tool_fraction else sampled_pass_rate(
                model, tokenizer, problems, samples=eval_samples, temperature=recipe.rollout.temperature,
                max_new_tokens=max(new_tokens_cap(recipe, p.template) for p in problems), seed=step + index)
                for index, (domain, problems) in enumerate(held_out.items())}
            counts = {domain: len(problems) for domain, problems in held_out.items()}
            rate = sum(rates[d] * counts[d] for d in rates) / sum(counts.values())
            history.append((step, rate))
            per_domain = "".join(f", {d} {r:.3f}" for d, r in rates.items()) if len(rates) > 1 else ""
            figure = "held-out tool traces reproduced" if tool_fraction else "held-out pass rate"
            print(f"warm start step {step}: loss {loss.item():.3f}, {figure} {rate:.3f}{per_domain}", flush=True)
            if min(rates.values()) >= target:
                break
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return WarmStart(steps=step, pass_rate=rate, domain_pass_rates=rates, history=history,
                     seconds=time.monotonic() - start)
