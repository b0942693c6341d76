"""Aggregation modes on unequal lengths, and split invariance of the loss with step-wide LossNormalizers."""

from __future__ import annotations

import pytest
import torch

from megatron_scalerl.algo.aggregation import LossNormalizers
from megatron_scalerl.algo.losses import LOSSES, policy_loss
from tests.test_algo_losses import PARAMS


def test_aggregation_modes_differ_exactly_as_their_formulas_on_unequal_lengths():
    # On-policy CISPO with log pi = -1 everywhere: every token objective is -A_i, so the loss is
    #   token:  sum_i n_i A_i / N;   sample: mean_i A_i;   prompt: mean_g (sum_{i in g} n_i A_i / T_g).
    lengths = torch.tensor([1, 3, 2, 6])
    groups = torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5], dtype=torch.float64)
    mask = torch.arange(6) < lengths[:, None]
    lp = torch.full((4, 6), -1.0, dtype=torch.float64)
    expected = {
        "token": (1 * 1 - 3 * 1 + 2 * 2 - 6 * 0.5) / 12,
        "sample": (1 - 1 + 2 - 0.5) / 4,
        "prompt": ((1 * 1 - 3 * 1) / 4 + (2 * 2 - 6 * 0.5) / 8) / 2,
    }
    losses = {}
    for aggregation, value in expected.items():
        loss, _ = policy_loss("cispo", logprobs=lp, gen_logprobs=lp, advantages=adv, mask=mask, group_ids=groups,
                              aggregation=aggregation, eps_max=4.0)
        losses[aggregation] = float(loss)
        assert float(loss) == pytest.approx(value, rel=1e-12)
    assert len(set(losses.values())) == 3
    # With equal lengths the three coincide (every weight is 1 / (number of samples * length)).
    equal = torch.ones(4, 6, dtype=torch.bool)
    values = [float(policy_loss("cispo", logprobs=lp, gen_logprobs=lp, advantages=adv, mask=equal, group_ids=groups,
                                aggregation=a, eps_max=4.0)[0]) for a in expected]
    assert values == pytest.approx([values[0]] * 3, rel=1e-12)


def test_samples_without_loss_tokens_count_nowhere():
    lp = torch.full((3, 4), -1.0, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, 5.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 1, 2])
    for aggregation in ("prompt", "sample", "token"):
        with_empty, _ = policy_loss("cispo", logprobs=lp, gen_logprobs=lp, advantages=adv, mask=mask,
                                    group_ids=groups, aggregation=aggregation, eps_max=4.0)
        keep = torch.tensor([0, 2])
        without, _ = policy_loss("cispo", logprobs=lp[keep], gen_logprobs=lp[keep], advantages=adv[keep],
                                 mask=mask[keep], group_ids=groups[keep], aggregation=aggregation, eps_max=4.0)
        assert float(with_empty) == pytest.approx(float(without), rel=1e-12)
    normalizers = LossNormalizers.from_batch(mask, groups)
    assert (normalizers.num_tokens, normalizers.num_samples, normalizers.num_prompts) == (6, 2, 2)


def step_batch(seed: int = 0, samples: int = 24, seq_len: int = 11):
    rng = torch.Generator().manual_seed(seed)
    lp = -torch.rand(samples, seq_len, generator=rng, dtype=torch.float64) * 2 - 0.05
    gen = lp + 0.4 * torch.randn(samples, seq_len, generator=rng, dtype=torch.float64)
    old = lp + 0.3 * torch.randn(samples, seq_len, generator=rng, dtype=torch.float64)
    lengths = torch.randint(0, seq_len + 1, (samples,), generator=rng)  # some samples have no loss token
    mask = torch.arange(seq_len) < lengths[:, None]
    adv = torch.randn(samples, generator=rng, dtype=torch.float64)
    groups = torch.arange(samples) // 4 * 7 + 3  # 6 prompts of 4 samples, ids not contiguous from 0
    return lp, gen, old, adv, mask, groups


def splits(samples: int):
    """Lists of index tensors covering 0..samples-1 exactly once."""
    shuffled = torch.randperm(samples, generator=torch.Generator().manual_seed(1))
    return {
        "dp2": [torch.arange(0, samples // 2), torch.arange(samples // 2, samples)],
        # 4 DP ranks x 3 micro-batches, each rank owning an interleaved (strided) share: groups cut across ranks.
        "dp4_micro3": [torch.arange(rank, samples, 4)[m::3] for rank in range(4) for m in range(3)],
        "uneven_random": list(torch.split(shuffled, [1, 6, 2, 9, 6])),
        "one_sample_each": [torch.tensor([i]) for i in range(samples)],
    }


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_summed_loss_and_gradient_over_any_split_equal_the_full_batch(name, aggregation):
    lp, gen, old, adv, mask, groups = step_batch()
    full_lp = lp.clone().requires_grad_()
    full, _ = policy_loss(name, logprobs=full_lp, gen_logprobs=gen, old_logprobs=old, advantages=adv, mask=mask,
                          group_ids=groups, aggregation=aggregation, **PARAMS[name])
    full.backward()
    for split_name, parts in splits(lp.shape[0]).items():
        # Each part knows only its own samples; the step's normalizers come from combining the parts' counts
        # (what a DP all-gather of per-rank counts gives) and must equal those of the full batch.
        part_counts = [LossNormalizers.from_batch(mask[idx], groups[idx]) for idx in parts]
        normalizers = LossNormalizers.combine(part_counts)
        reference = LossNormalizers.from_batch(mask, groups)
        assert (normalizers.num_tokens, normalizers.num_samples, normalizers.num_prompts) == (
            reference.num_tokens, reference.num_samples, reference.num_prompts)
        assert torch.equal(normalizers.prompt_ids, reference.prompt_ids)
        assert torch.equal(normalizers.prompt_tokens, reference.prompt_tokens)
        split_lp = lp.clone().requires_grad_()
        total = sum(policy_loss(name, logprobs=split_lp[idx], gen_logprobs=gen[idx], old_logprobs=old[idx],
                                advantages=adv[idx], mask=mask[idx], group_ids=groups[idx], aggregation=aggregation,
                                normalizers=normalizers, **PARAMS[name])[0] for idx in parts)
        total.backward()
        torch.testing.assert_close(total, full.detach(), rtol=1e-12, atol=1e-14, msg=split_name)
        torch.testing.assert_close(split_lp.grad, full_lp.grad, rtol=1e-12, atol=1e-14, msg=split_name)


@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_per_part_normalisation_would_not_be_split_invariant(aggregation):
    lp, gen, _, adv, mask, groups = step_batch(seed=2)
    full, _ = policy_loss("cispo", logprobs=lp, gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups,
                          aggregation=aggregation, eps_max=1.3)
    parts = splits(lp.shape[0])["uneven_random"]
    local = sum(policy_loss("cispo", logprobs=lp[idx], gen_logprobs=gen[idx], advantages=adv[idx], mask=mask[idx],
                            group_ids=groups[idx], aggregation=aggregation, eps_max=1.3)[0] for idx in parts)
    assert abs(float(local) - float(full)) > 1e-3


def test_normalizers_of_another_step_are_rejected():
    lp, gen, _, adv, mask, groups = step_batch()
    small = LossNormalizers.from_batch(mask[:4], groups[:4])
    with pytest.raises(ValueError, match="different step"):
        policy_loss("cispo", logprobs=lp, gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups,
                    aggregation="token", normalizers=small, eps_max=4.0)
    other_ids = LossNormalizers.from_batch(mask, groups + 1000)
    with pytest.raises(ValueError, match="group id 3 has more loss tokens"):
        policy_loss("cispo", logprobs=lp, gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups,
                    aggregation="prompt", normalizers=other_ids, eps_max=4.0)


def test_normalizers_from_sample_tokens_and_hand_counts():
    normalizers = LossNormalizers.from_sample_tokens(torch.tensor([3, 0, 5, 2]), torch.tensor([9, 9, 4, 9]))
    assert (normalizers.num_tokens, normalizers.num_samples, normalizers.num_prompts) == (10, 3, 2)
    assert normalizers.prompt_ids.tolist() == [4, 9]
    assert normalizers.prompt_tokens.tolist() == [5, 5]
    weights = normalizers.sample_weights("prompt", torch.tensor([3, 0, 5, 2]), torch.tensor([9, 9, 4, 9]))
    assert weights.tolist() == pytest.approx([1 / (2 * 5), 0.0, 1 / (2 * 5), 1 / (2 * 5)])
    weights = normalizers.sample_weights("sample", torch.tensor([3, 0, 5, 2]), torch.tensor([9, 9, 4, 9]))
    assert weights.tolist() == pytest.approx([1 / 9, 0.0, 1 / 15, 1 / 6])
