"""Rollout groups -> one TrainBatch: rewards, the recipe's filters and advantages, staleness, the step's figures.

    batch, figures = build_train_batch(groups, batch_index=12, recipe=recipe)   # batch None: every sample filtered

A `RolloutGroup` is one prompt's `generations_per_prompt` finished samples with their rewards. `build_train_batch`
runs `algo.step_advantages` over the groups (zero-variance filter, truncation policy, advantage normalisation: the
paper's batch-level std is taken over exactly these groups), keeps the samples that reach the loss and packs them
into a TrainBatch (`batches.stream`). Figures are plain floats for `metrics.jsonl`.

Versions (`algo.versions`): a completion token's policy version is the trainer step whose weights sampled it
(`weight_sync.generator_link`); a token without one (NO_VERSION: the interruption phrase, forced in rather than sampled)
takes the version of the token before it, the first token the group's admission version. Prompt tokens are stored
as NO_VERSION. A group written as batch b has staleness b - (its oldest token's version), in optimizer steps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from megatron_scalerl.algo.advantages import step_advantages
from megatron_scalerl.algo.length_control import length_metrics
from megatron_scalerl.algo.versions import NO_VERSION
from megatron_scalerl.batches.train_batch import TrainBatch, pack_routes
from megatron_scalerl.orchestrator.generation import Sample
from megatron_scalerl.recipe import Recipe
from megatron_scalerl.tasks.problems import Problem
from megatron_scalerl.tasks.rewards import GRADER_TIMEOUT


@dataclass
class RolloutGroup:
    """One prompt's samples. `index`: admission order over the run (the group id in the stream); `admitted_version`:
    the generators' policy version when it was admitted (trainer steps); `rewards`, `correct`: one per sample."""

    problem: Problem
    index: int
    admitted_version: int
    samples: list[Sample] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)  # samples not correct, by kind (rewards.Grade.failure)
    reward_metrics: list[dict[str, float]] = field(default_factory=list)  # per sample: a verl-form reward's figures

    def token_versions(self, sample: Sample) -> list[int]:
        """Per completion token, the version that produced it (a token without one inherits its predecessor's)."""
        versions, last = [], self.admitted_version
        for version in sample.versions:
            last = last if version == NO_VERSION else version
            versions.append(last)
        return versions

    def oldest_version(self) -> int:
        return min((min(self.token_versions(s), default=self.admitted_version) for s in self.samples),
                   default=self.admitted_version)

    def completion_tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.samples)


def _pack(groups: list[RolloutGroup], keep: list[list[bool]], advantages: list[list[float]]) -> TrainBatch:
    """The kept samples of `groups` as one packed TrainBatch (group ids: the groups' admission indices; routes when
    the samples carry them, `batches.train_batch.pack_routes`)."""
    ids, mask, logprobs, versions, routes = [], [], [], [], []
    lengths, prompt_lengths, adv, rewards, group_ids, truncated = [], [], [], [], [], []
    for group, kept, group_adv in zip(groups, keep, advantages, strict=True):
        for sample, keep_it, advantage, reward in zip(group.samples, kept, group_adv, group.rewards, strict=True):
            if not keep_it:
                continue
            prompt = len(sample.prompt_ids)
            ids += [*sample.prompt_ids, *sample.completion_ids]
            mask += [False] * prompt + list(sample.loss_mask)
            logprobs += [0.0] * prompt + [lp if m else 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask,
                                                                               strict=True)]
            versions += [NO_VERSION] * prompt + group.token_versions(sample)
            routes.append(sample.routes)
            lengths.append(prompt + len(sample.completion_ids))
            prompt_lengths.append(prompt)
            adv.append(advantage)
            rewards.append(reward)
            group_ids.append(group.index)
            truncated.append(sample.truncated)
    return TrainBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64), loss_mask=torch.tensor(mask, dtype=torch.bool),
        gen_logprobs=torch.tensor(logprobs, dtype=torch.float32),
        weight_versions=torch.tensor(versions, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64), prompt_lengths=torch.tensor(prompt_lengths, dtype=torch.int64),
        advantages=torch.tensor(adv, dtype=torch.float32), rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor(group_ids, dtype=torch.int64), truncated=torch.tensor(truncated, dtype=torch.bool),
        routes=pack_routes(routes, lengths))


def outcome_figures(groups: list[RolloutGroup], prefix: str, domains: list[str]) -> dict[str, float]:
    """Samples not correct by kind of failure, `{prefix}/failures/<kind>` (counts), the mean of each figure a
    verl-form reward returned beside its score, `{prefix}/reward/<key>` (over the samples that have it), and for a
    recipe with several domains (`domains`: data.domains()) each domain's `{prefix}/<domain>/pass_rate` and
    `{prefix}/<domain>/samples` (a domain without samples here has neither); with samples of an environment,
    `tool_figures`."""
    failures: Counter[str] = Counter()
    reported: dict[str, list[float]] = {}
    for group in groups:
        failures.update(group.failures)
        for sample_metrics in group.reward_metrics:
            for key, value in sample_metrics.items():
                reported.setdefault(key, []).append(value)
    figures = {f"{prefix}/failures/{kind}": float(n) for kind, n in sorted(failures.items())}
    figures.update({f"{prefix}/reward/{key}": sum(v) / len(v) for key, v in sorted(reported.items())})
    if len(domains) > 1:
        for domain in domains:
            correct = [c for g in groups if g.problem.domain == domain for c in g.correct]
            if correct:
                figures[f"{prefix}/{domain}/pass_rate"] = sum(correct) / len(correct)
                figures[f"{prefix}/{domain}/samples"] = float(len(correct))
    if any(g.problem.environment is not None for g in groups):
        figures.update(tool_figures(groups, prefix))
    return figures


def tool_figures(groups: list[RolloutGroup], prefix: str) -> dict[str, float]:
    """The tool use of the samples whose problem has an environment: observations per sample
    (`{prefix}/tool/calls_mean`), calls that failed by timeout (`tool/timeouts`) or otherwise (`tool/errors`, a
    limit or a runtime error: counts), observation tokens per sample (`tool/observation_tokens_mean`), and the pass
    rate of the samples with n calls (`tool/pass_rate_calls_<n>`, with `tool/samples_calls_<n>`)."""
    samples = [(s, c) for g in groups if g.problem.environment is not None for s, c in zip(g.samples, g.correct,
                                                                                          strict=True)]
    failures: Counter[str] = Counter()
    by_calls: dict[int, list[bool]] = {}
    for sample, correct in samples:
        failures.update(sample.tool_failures)
        by_calls.setdefault(sample.tool_calls, []).append(correct)
    figures = {f"{prefix}/tool/calls_mean": sum(s.tool_calls for s, _ in samples) / len(samples),
               f"{prefix}/tool/timeouts": float(failures.pop("timeout", 0)),
               f"{prefix}/tool/errors": float(sum(failures.values())),
               f"{prefix}/tool/observation_tokens_mean": sum(s.observation_tokens for s, _ in samples) / len(samples)}
    for calls, correct in sorted(by_calls.items()):
        figures[f"{prefix}/tool/pass_rate_calls_{calls}"] = sum(correct) / len(correct)
        figures[f"{prefix}/tool/samples_calls_{calls}"] = float(len(correct))
    return figures


def staleness_figures(groups: list[RolloutGroup], batch_index: int, k: int) -> dict[str, float]:
    """Max staleness of the loss tokens (optimizer steps) and its histogram `staleness/lag_<d>` (token counts)."""
    lags: Counter[int] = Counter()
    for group in groups:
        for sample in group.samples:
            for version, in_loss in zip(group.token_versions(sample), sample.loss_mask, strict=True):
                if in_loss:
                    lags[batch_index - version] += 1
    figures = {"staleness/max": float(max(lags, default=0)),
               "staleness/mean": sum(lag * n for lag, n in lags.items()) / max(sum(lags.values()), 1)}
    figures.update({f"staleness/lag_{lag}": float(lags.get(lag, 0)) for lag in range(k + 1)})
    return figures


def build_train_batch(groups: list[RolloutGroup], *, batch_index: int, recipe: Recipe
                      ) -> tuple[TrainBatch | None, dict[str, float]]:
    """The TrainBatch for step `batch_index` from `groups` (None when no sample reaches the loss) and its figures."""
    algorithm = recipe.algorithm
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    group_ids = torch.tensor([g.index for g in groups for _ in g.samples], dtype=torch.int64)
    truncated = torch.tensor([s.truncated for g in groups for s in g.samples], dtype=torch.bool)
    step = step_advantages(rewards, group_ids, truncated, algorithm)
    in_loss, advantages = step.in_loss.tolist(), step.advantages.tolist()
    keep, adv, start = [], [], 0
    for group in groups:
        end = start + len(group.samples)
        keep.append(in_loss[start:end])
        adv.append(advantages[start:end])
        start = end
    lengths = torch.tensor([len(s.completion_ids) for g in groups for s in g.samples], dtype=torch.int64)
    interrupted = torch.tensor([s.interrupted for g in groups for s in g.samples], dtype=torch.bool)
    correct = [c for g in groups for c in g.correct]
    figures = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/pass_rate": sum(correct) / max(len(correct), 1),
        "rollout/groups": float(len(groups)),
        "rollout/filtered_groups": step.metrics["zero_variance_groups"] if algorithm.zero_variance_filter else 0.0,
        "rollout/loss_samples": step.metrics["loss_samples"],
        "rollout/advantage_std": step.metrics["advantage_std"],
        "rollout/grading_timeouts": float(sum(g.failures.get(GRADER_TIMEOUT, 0) for g in groups)),
        **outcome_figures(groups, "rollout", recipe.data.domains()),
        **{f"rollout/{name}": value for name, value in length_metrics(lengths, truncated, interrupted).items()},
    }
    kept_groups = [g for g, kept in zip(groups, keep, strict=True) if any(kept)]
    figures.update(staleness_figures(kept_groups, batch_index, recipe.rollout.k))
    if not any(any(kept) for kept in keep):
        return None, figures
    return _pack(groups, keep, adv), figures
