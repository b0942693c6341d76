"""Advantages: group baseline and normalisation, computed once over the whole optimizer step (before any split).

    A_i = r_i - mean(r over the members of sample i's group)            (group baseline, paper section 2)
    batch:  A_i / std(A over the step's pool)    the pool is the samples that reach the loss (after the zero-variance
                                                 filter) when `std_after_filter`, else every sample in the batch
    prompt: A_i / std(A over the members of sample i's group)
    none:   A_i

Standard deviations are population ones (ddof 0). A zero std leaves the advantages as they are (they are all 0 in the
pool then). Advantages of samples that do not reach the loss are set to 0. The paper does not say whether the batch
std is taken before or after zero-variance filtering: `std_after_filter` (recipe: algorithm.advantage_std_after_filter)
decides; "after" keeps the dropped groups' zero advantages from shrinking the std.

Because advantages are computed on the whole step, then split with their samples, the loss stays split-invariant.
Shapes: rewards [num_samples] float, group_ids [num_samples] int64, members / masks [num_samples] bool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import torch

from megatron_scalerl.algo.filters import group_index, select_samples
from megatron_scalerl.recipe.schema import AdvantageNorm

ADVANTAGE_NORMS = get_args(AdvantageNorm)


def _group_mean(values: torch.Tensor, index: torch.Tensor, num_groups: int, members: torch.Tensor) -> torch.Tensor:
    """[S]: mean of `values` over the members of each sample's group (0 for a group without members)."""
    sums = values.new_zeros(num_groups).index_add_(0, index[members], values[members])
    sizes = values.new_zeros(num_groups).index_add_(0, index[members], torch.ones_like(values[members]))
    return (sums / sizes.clamp(min=1))[index]


def _population_std(values: torch.Tensor) -> float:
    return float(values.std(unbiased=False)) if values.numel() else 0.0


def group_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean(r over the group's members) for members, 0 for the others. [S], float64."""
    index, num_groups = group_index(group_ids)
    values = rewards.detach().double()
    return torch.where(members, values - _group_mean(values, index, num_groups, members), 0.0)


def normalise(advantages: torch.Tensor, group_ids: torch.Tensor, *, mode: str, members: torch.Tensor,
              std_pool: torch.Tensor) -> torch.Tensor:
    """Divide baseline advantages [S] by the std that `mode` names (module docstring).

    members: [S] bool, the samples of each group's statistics (prompt mode); std_pool: [S] bool (batch mode).
    """
    if mode not in ADVANTAGE_NORMS:
        raise ValueError(f"unknown advantage normalisation '{mode}' (known: {', '.join(ADVANTAGE_NORMS)})")
    if mode == "none":
        return advantages
    if mode == "batch":
        std = _population_std(advantages[std_pool])
        return advantages / std if std > 0 else advantages
    index, num_groups = group_index(group_ids)
    centred = advantages - _group_mean(advantages, index, num_groups, members)
    std = _group_mean(centred.square(), index, num_groups, members).sqrt()
    return torch.where(std > 0, advantages / std.clamp(min=torch.finfo(std.dtype).tiny), advantages)


@dataclass(frozen=True)
class StepAdvantages:
    """advantages: [S] (0 where not in the loss); in_loss: [S] bool; metrics: the filters' counts and
    advantage_std (population std of the baseline advantages over the batch-normalisation pool)."""

    advantages: torch.Tensor
    in_loss: torch.Tensor
    metrics: dict[str, float]


def step_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, truncated: torch.Tensor,
                    algorithm: Any) -> StepAdvantages:
    """Filters then advantages for one optimizer step, as the recipe's AlgorithmConfig says.

    Reads algorithm.truncated_samples, zero_variance_filter, advantage_norm, advantage_std_after_filter.
    """
    selection = select_samples(rewards, group_ids, truncated, zero_variance_filter=algorithm.zero_variance_filter,
                               truncated_samples=algorithm.truncated_samples)
    baseline = group_baseline(rewards, group_ids, selection.in_batch)
    std_pool = selection.in_loss if algorithm.advantage_std_after_filter else selection.in_batch
    normalised = normalise(baseline, group_ids, mode=algorithm.advantage_norm, members=selection.in_batch,
                           std_pool=std_pool)
    advantages = torch.where(selection.in_loss, normalised, 0.0).to(torch.promote_types(rewards.dtype, torch.float32))
    metrics: dict[str, float] = {key: float(value) for key, value in selection.counts.items()}
    metrics["advantage_std"] = _population_std(baseline[std_pool])
    return StepAdvantages(advantages=advantages, in_loss=selection.in_loss, metrics=metrics)
