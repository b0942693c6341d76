"""Which samples of a step enter the group statistics and which reach the loss.

Two settings of the recipe (algorithm.zero_variance_filter, algorithm.truncated_samples) decide it:

- truncated samples (completions that hit the hard length cap, never ended on their own):
    keep  they stay, with the reward they got (usually the incorrect reward: no final answer);
    mask  they count in their group's mean and in the zero-variance test, but their tokens are out of the loss;
    drop  they are removed before anything else, as if never generated (their group is smaller).
- zero-variance groups (every remaining sample of the prompt got the same reward, so every advantage is 0): with the
  filter on they are dropped from the loss (no refill, as in the paper); with it off they stay and dilute the
  aggregation denominators with zero-advantage tokens.

Shapes: rewards [num_samples] float, group_ids [num_samples] int64 (generation groups), truncated [num_samples] bool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch

from megatron_scalerl.recipe.schema import TruncatedPolicy

TRUNCATED_POLICIES = get_args(TruncatedPolicy)


@dataclass(frozen=True)
class SampleSelection:
    """in_batch: [S] bool, samples in the group statistics (advantage baseline); in_loss: [S] bool, samples whose
    tokens reach the loss (in_loss implies in_batch). counts: plain ints for the step's metrics."""

    in_batch: torch.Tensor
    in_loss: torch.Tensor
    counts: dict[str, int]


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(index of each sample's group in 0..num_groups-1 [S] int64, num_groups)."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, len(unique)


def zero_variance_samples(rewards: torch.Tensor, group_ids: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """[S] bool: member samples whose group's member rewards are all equal (a single member is zero-variance)."""
    index, num_groups = group_index(group_ids)
    big = torch.finfo(torch.float64).max
    values = rewards.detach().double()
    group_max = values.new_full((num_groups,), -big).scatter_reduce_(
        0, index[members], values[members], reduce="amax")
    group_min = values.new_full((num_groups,), big).scatter_reduce_(
        0, index[members], values[members], reduce="amin")
    return members & (group_max[index] == group_min[index])


def select_samples(rewards: torch.Tensor, group_ids: torch.Tensor, truncated: torch.Tensor, *,
                   zero_variance_filter: bool, truncated_samples: str) -> SampleSelection:
    """Apply the truncation policy, then the zero-variance filter (see the module docstring)."""
    if truncated_samples not in TRUNCATED_POLICIES:
        raise ValueError(f"unknown truncated_samples '{truncated_samples}' (known: {', '.join(TRUNCATED_POLICIES)})")
    if not (rewards.shape == group_ids.shape == truncated.shape) or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)}, group_ids {tuple(group_ids.shape)} and truncated "
                         f"{tuple(truncated.shape)} must all be [num_samples]")
    truncated = truncated.bool()
    in_batch = ~truncated if truncated_samples == "drop" else torch.ones_like(truncated)
    zero_variance = zero_variance_samples(rewards, group_ids, in_batch)
    in_loss = in_batch & ~zero_variance if zero_variance_filter else in_batch.clone()
    if truncated_samples == "mask":
        in_loss &= ~truncated
    index, num_groups = group_index(group_ids)
    counts = {
        "samples": int(rewards.numel()),
        "groups": num_groups,
        "truncated": int(truncated.sum()),
        "truncated_dropped": int(truncated.sum()) if truncated_samples == "drop" else 0,
        "truncated_masked": int(truncated.sum()) if truncated_samples == "mask" else 0,
        "zero_variance_groups": int(index[zero_variance].unique().numel()),
        "zero_variance_samples": int(zero_variance.sum()),
        "filtered_samples": int(zero_variance.sum()) if zero_variance_filter else 0,
        "loss_samples": int(in_loss.sum()),
    }
    return SampleSelection(in_batch=in_batch, in_loss=in_loss, counts=counts)
