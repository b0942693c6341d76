"""Advantages (group baseline, batch / prompt / no normalisation) and the sample filters, on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_scalerl.algo.advantages import group_baseline, normalise, step_advantages
from megatron_scalerl.algo.filters import select_samples
from megatron_scalerl.recipe import load_recipe

ALGORITHM = load_recipe("scalerl").algorithm


def with_settings(**changes):
    return ALGORITHM.model_copy(update=changes)


def test_group_baseline_subtracts_the_group_mean():
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0])
    groups = torch.tensor([5, 5, 5, 5, 2, 2])
    members = torch.ones(6, dtype=torch.bool)
    assert group_baseline(rewards, groups, members).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.0, 0.0])
    # A non-member neither gets an advantage nor moves its group's mean.
    members[3] = False
    assert group_baseline(rewards, groups, members).tolist() == pytest.approx([4 / 3, -2 / 3, -2 / 3, 0, 0, 0])


def test_prompt_normalisation_divides_by_each_groups_std():
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    members = torch.ones(8, dtype=torch.bool)
    baseline = group_baseline(rewards, groups, members)
    out = normalise(baseline, groups, mode="prompt", members=members, std_pool=members)
    std0 = math.sqrt((1.5**2 + 3 * 0.5**2) / 4)  # population std of group 0's rewards
    std1 = math.sqrt((3 * 0.5**2 + 1.5**2) / 4)
    expected = [1.5 / std0, -0.5 / std0, -0.5 / std0, -0.5 / std0, 0.5 / std1, -1.5 / std1, 0.5 / std1, 0.5 / std1]
    assert out.tolist() == pytest.approx(expected, rel=1e-12)
    assert normalise(baseline, groups, mode="none", members=members, std_pool=members).tolist() == baseline.tolist()


def test_batch_std_before_or_after_the_zero_variance_filter():
    # Group 0: rewards [1, -1] -> A = [1, -1]. Group 1: all 1 -> zero variance, A = [0, 0].
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    truncated = torch.zeros(4, dtype=torch.bool)
    after = step_advantages(rewards, groups, truncated, with_settings(advantage_std_after_filter=True))
    before = step_advantages(rewards, groups, truncated, with_settings(advantage_std_after_filter=False))
    # After: std over [1, -1] = 1. Before: std over [1, -1, 0, 0] = sqrt(1/2), so the advantages grow by sqrt(2).
    assert after.advantages.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])
    assert before.advantages.tolist() == pytest.approx([math.sqrt(2), -math.sqrt(2), 0.0, 0.0])
    assert after.metrics["advantage_std"] == pytest.approx(1.0)
    assert before.metrics["advantage_std"] == pytest.approx(math.sqrt(0.5))
    assert after.in_loss.tolist() == [True, True, False, False]
    assert after.metrics["zero_variance_groups"] == 1 and after.metrics["filtered_samples"] == 2


def test_without_the_filter_zero_variance_groups_stay_with_zero_advantage():
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    out = step_advantages(rewards, groups, torch.zeros(4, dtype=torch.bool), with_settings(zero_variance_filter=False))
    assert out.in_loss.tolist() == [True] * 4
    assert out.advantages.tolist() == pytest.approx([math.sqrt(2), -math.sqrt(2), 0.0, 0.0])
    assert out.metrics["zero_variance_groups"] == 1 and out.metrics["filtered_samples"] == 0


@pytest.mark.parametrize("policy, in_batch, in_loss, baseline", [
    # Group: rewards [1, -1, -1], the last one truncated (hit the hard cap).
    ("keep", [True, True, True], [True, True, True], [4 / 3, -2 / 3, -2 / 3]),
    ("mask", [True, True, True], [True, True, False], [4 / 3, -2 / 3, 0.0]),
    ("drop", [True, True, False], [True, True, False], [1.0, -1.0, 0.0]),
])
def test_truncated_samples_keep_mask_drop(policy, in_batch, in_loss, baseline):
    rewards = torch.tensor([1.0, -1.0, -1.0])
    groups = torch.tensor([0, 0, 0])
    truncated = torch.tensor([False, False, True])
    selection = select_samples(rewards, groups, truncated, zero_variance_filter=True, truncated_samples=policy)
    assert selection.in_batch.tolist() == in_batch and selection.in_loss.tolist() == in_loss
    assert selection.counts["truncated"] == 1
    assert selection.counts["truncated_dropped"] == (1 if policy == "drop" else 0)
    assert selection.counts["truncated_masked"] == (1 if policy == "mask" else 0)
    out = step_advantages(rewards, groups, truncated, with_settings(truncated_samples=policy, advantage_norm="none"))
    assert out.advantages.tolist() == pytest.approx(baseline)


def test_dropping_truncated_samples_can_make_a_group_zero_variance():
    rewards = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    truncated = torch.tensor([False, False, True, False, False])
    drop = select_samples(rewards, groups, truncated, zero_variance_filter=True, truncated_samples="drop")
    assert drop.in_loss.tolist() == [False, False, False, True, True]
    assert drop.counts["zero_variance_groups"] == 1
    mask = select_samples(rewards, groups, truncated, zero_variance_filter=True, truncated_samples="mask")
    assert mask.in_loss.tolist() == [True, True, False, True, True]
    assert mask.counts["zero_variance_groups"] == 0


def test_scalerl_defaults_end_to_end():
    # 3 prompts x 4 samples: one all-correct (filtered), two mixed; batch std after the filter.
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0])
    groups = torch.repeat_interleave(torch.tensor([0, 1, 2]), 4)
    out = step_advantages(rewards, groups, torch.zeros(12, dtype=torch.bool), ALGORITHM)
    baseline = torch.tensor([0, 0, 0, 0, 1.5, -0.5, -0.5, -0.5, 0.5, 0.5, 0.5, -1.5], dtype=torch.float64)
    std = baseline[4:].std(unbiased=False)
    assert out.advantages.tolist() == pytest.approx((baseline / std).tolist(), rel=1e-6)
    assert out.advantages.dtype == torch.float32
    assert out.metrics["loss_samples"] == 8 and out.metrics["groups"] == 3


def test_bad_settings_are_named():
    rewards, groups, truncated = torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown truncated_samples 'cut'"):
        select_samples(rewards, groups, truncated, zero_variance_filter=True, truncated_samples="cut")
    with pytest.raises(ValueError, match="unknown advantage normalisation 'group'"):
        normalise(rewards.double(), groups, mode="group", members=truncated, std_pool=truncated)
    with pytest.raises(ValueError, match="must all be"):
        select_samples(rewards, groups[:1], truncated, zero_variance_filter=True, truncated_samples="keep")
