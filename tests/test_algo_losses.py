"""policy_loss: hand-computed values, gradients against autograd of the written formulas, CISPO vs REINFORCE."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_scalerl.algo import losses
from megatron_scalerl.algo.aggregation import LossNormalizers
from megatron_scalerl.algo.losses import LOSSES, merge_metrics, policy_loss
from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import load_recipe

PARAMS = {
    "cispo": {"eps_max": 1.3},
    "tis_reinforce": {"eps_max": 1.3},
    "ppo_clip": {"clip_low": 0.2, "clip_high": 0.2},
    "dapo": {"clip_low": 0.1, "clip_high": 0.28},
    "gspo": {"clip_low": 0.03, "clip_high": 0.04},
}


def written_objective(name: str, lp, gen, old, adv, **p):
    """The per-token objective of one sample's loss tokens [n], exactly as losses.py's docstring writes it."""
    if name == "cispo":
        return torch.clamp(torch.exp(lp - gen), max=p["eps_max"]).detach() * adv * lp
    if name == "tis_reinforce":
        return torch.clamp(torch.exp(old - gen), max=p["eps_max"]).detach() * adv * lp
    if name in ("ppo_clip", "dapo"):
        ratio = torch.exp(lp - old)
        return torch.minimum(ratio * adv, torch.clamp(ratio, 1 - p["clip_low"], 1 + p["clip_high"]) * adv)
    seq_ratio = torch.exp((lp - old).mean())
    token_ratio = seq_ratio.detach() * torch.exp(lp - lp.detach())  # GSPO-token: value s, gradient s * dlog pi_t
    return torch.minimum(token_ratio * adv, torch.clamp(token_ratio, 1 - p["clip_low"], 1 + p["clip_high"]) * adv)


def written_loss(name, lp, gen, old, adv, mask, groups, aggregation, **p):
    """-J with a Python loop over samples and prompts (the aggregation formulas of the paper, section 2)."""
    per_sample = [written_objective(name, lp[i][mask[i]], gen[i][mask[i]], old[i][mask[i]], adv[i], **p)
                  for i in range(lp.shape[0])]
    kept = [i for i, obj in enumerate(per_sample) if obj.numel()]
    if aggregation == "token":
        return -sum(per_sample[i].sum() for i in kept) / sum(per_sample[i].numel() for i in kept)
    if aggregation == "sample":
        return -sum(per_sample[i].mean() for i in kept) / len(kept)
    prompts = sorted({int(groups[i]) for i in kept})
    per_prompt = []
    for g in prompts:
        members = [i for i in kept if int(groups[i]) == g]
        per_prompt.append(sum(per_sample[i].sum() for i in members) / sum(per_sample[i].numel() for i in members))
    return -sum(per_prompt) / len(prompts)


def random_batch(seed: int, samples: int = 8, seq_len: int = 9):
    gen_rng = torch.Generator().manual_seed(seed)
    lp = -torch.rand(samples, seq_len, generator=gen_rng, dtype=torch.float64) * 2 - 0.05
    gen = lp + 0.4 * torch.randn(samples, seq_len, generator=gen_rng, dtype=torch.float64)
    old = lp + 0.3 * torch.randn(samples, seq_len, generator=gen_rng, dtype=torch.float64)
    lengths = torch.randint(1, seq_len + 1, (samples,), generator=gen_rng)
    mask = torch.arange(seq_len) < lengths[:, None]
    adv = torch.randn(samples, generator=gen_rng, dtype=torch.float64)
    groups = torch.arange(samples) // 3 + 10
    return lp, gen, old, adv, mask, groups


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
@pytest.mark.parametrize("with_old", [False, True])
@pytest.mark.parametrize("chunk_elements", [losses.CHUNK_ELEMENTS, 20])  # 20: chunks of 2 rows of 9 tokens
def test_value_and_gradient_match_autograd_of_written_formula(name, aggregation, with_old, chunk_elements,
                                                              monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", chunk_elements)
    lp, gen, old, adv, mask, groups = random_batch(seed=3)
    old_arg = old if with_old else None
    reference_lp = lp.clone().requires_grad_()
    expected = written_loss(name, reference_lp, gen, old if with_old else gen, adv, mask, groups, aggregation,
                            **PARAMS[name])
    expected.backward()
    ours_lp = lp.clone().requires_grad_()
    loss, _ = policy_loss(name, logprobs=ours_lp, gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups,
                          aggregation=aggregation, old_logprobs=old_arg, **PARAMS[name])
    loss.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_lp.grad, reference_lp.grad, rtol=1e-12, atol=1e-12)


def test_cispo_hand_computed_values_and_gradient():
    # Prompt 0: sample 0 has rho = [2, 8] (8 is capped at eps_max 4), A = +1; sample 1 has rho = [0.5], A = -1.
    # Prompt 1: sample 2 has rho = [1], A = +0.5.
    lp = torch.tensor([[math.log(0.5), math.log(0.8)], [math.log(0.4), 0.0], [math.log(0.9), 0.0]],
                      dtype=torch.float64, requires_grad=True)
    rho = torch.tensor([[2.0, 8.0], [0.5, 1.0], [1.0, 1.0]], dtype=torch.float64)
    gen = lp.detach() - rho.log()
    mask = torch.tensor([[True, True], [True, False], [True, False]])
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1])
    s0 = 2 * math.log(0.5) + 4 * math.log(0.8)
    s1 = -0.5 * math.log(0.4)
    s2 = 0.5 * math.log(0.9)
    expected = {
        "prompt": -((s0 + s1) / 3 + s2 / 1) / 2,
        "sample": -(s0 / 2 + s1 / 1 + s2 / 1) / 3,
        "token": -(s0 + s1 + s2) / 4,
    }
    for aggregation, value in expected.items():
        loss, metrics = policy_loss("cispo", logprobs=lp, gen_logprobs=gen, advantages=adv, mask=mask,
                                    group_ids=groups, aggregation=aggregation, eps_max=4.0)
        assert loss.item() == pytest.approx(value, rel=1e-12)
    # Token aggregation: d loss / d log pi = -min(rho, 4) * A / 4 on loss tokens, 0 elsewhere.
    lp.grad = None
    loss.backward()
    expected_grad = torch.tensor([[-2 / 4, -4 / 4], [0.5 / 4, 0.0], [-0.5 / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected_grad, rtol=1e-12, atol=1e-12)
    assert float(metrics["clip_fraction"]) == pytest.approx(1 / 4)
    assert float(metrics["ratio_mean"]) == pytest.approx((2 + 8 + 0.5 + 1) / 4)
    assert float(metrics["ratio_max"]) == pytest.approx(8.0)
    k3 = sum(r - 1 - math.log(r) for r in (2.0, 8.0, 0.5, 1.0)) / 4
    assert float(metrics["mismatch_k3"]) == pytest.approx(k3)
    assert int(metrics["tokens"]) == 4


def test_ppo_clip_hand_computed_values_and_zeroed_gradient():
    # One sample, A = +2, ratios r = [1.1, 1.5, 0.5] against pi_old; clip 0.2: 1.5 is clipped to 1.2 (no gradient),
    # 0.5 is below 1 - 0.2 but with A > 0 the unclipped term is the minimum (gradient kept).
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ratio = torch.tensor([[1.1, 1.5, 0.5]], dtype=torch.float64)
    old = lp.detach() - ratio.log()
    loss, metrics = policy_loss("ppo_clip", logprobs=lp, gen_logprobs=old, advantages=torch.tensor([2.0]),
                                mask=torch.ones(1, 3, dtype=torch.bool), group_ids=torch.tensor([0]),
                                aggregation="token", clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-(1.1 * 2 + 1.2 * 2 + 0.5 * 2) / 3, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.1 * 2 / 3, 0.0, -0.5 * 2 / 3]], dtype=torch.float64))
    assert float(metrics["clip_fraction"]) == pytest.approx(1 / 3)


def test_dapo_clips_higher_than_ppo():
    # r = 1.25 with A > 0: clipped by ppo_clip (0.2 / 0.2) but not by dapo (0.2 / 0.28).
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - math.log(1.25)
    common = dict(gen_logprobs=old, advantages=torch.tensor([1.0]), mask=torch.ones(1, 1, dtype=torch.bool),
                  group_ids=torch.tensor([0]), aggregation="token", clip_low=0.2)
    ppo, _ = policy_loss("ppo_clip", logprobs=lp, clip_high=0.2, **common)
    dapo, _ = policy_loss("dapo", logprobs=lp, clip_high=0.28, **common)
    assert ppo.item() == pytest.approx(-1.2) and dapo.item() == pytest.approx(-1.25)
    (grad_ppo,) = torch.autograd.grad(ppo, lp)
    (grad_dapo,) = torch.autograd.grad(dapo, lp)
    assert float(grad_ppo) == 0.0 and float(grad_dapo) == pytest.approx(-1.25)


def test_gspo_with_sample_aggregation_is_the_sequence_level_gspo_loss():
    lp, gen, old, adv, mask, groups = random_batch(seed=5)
    params = {"clip_low": 0.05, "clip_high": 0.06}
    reference_lp = lp.clone().requires_grad_()
    terms = []
    for i in range(lp.shape[0]):
        seq_ratio = torch.exp((reference_lp[i][mask[i]] - old[i][mask[i]]).mean())
        terms.append(torch.minimum(seq_ratio * adv[i], torch.clamp(seq_ratio, 0.95, 1.06) * adv[i]))
    expected = -torch.stack(terms).mean()
    expected.backward()
    ours_lp = lp.clone().requires_grad_()
    loss, metrics = policy_loss("gspo", logprobs=ours_lp, gen_logprobs=gen, old_logprobs=old, advantages=adv,
                                mask=mask, group_ids=groups, aggregation="sample", **params)
    loss.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_lp.grad, reference_lp.grad, rtol=1e-12, atol=1e-12)
    assert 0 < float(metrics["clip_fraction"]) < 1  # the data exercise both branches


def test_cispo_gradient_is_reinforce_below_the_cap_and_capped_above():
    lp, gen, _, adv, mask, groups = random_batch(seed=11, samples=12, seq_len=16)
    eps_max = 1.3
    rho = torch.exp(lp - gen)
    assert bool((rho[mask] > eps_max).any()) and bool((rho[mask] < eps_max).any())
    cispo_lp = lp.clone().requires_grad_()
    loss, _ = policy_loss("cispo", logprobs=cispo_lp, gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups,
                          aggregation="token", eps_max=eps_max)
    loss.backward()
    # Importance-weighted REINFORCE: -(1/N) sum sg(rho) * A * log pi.
    reinforce_lp = lp.clone().requires_grad_()
    weights = torch.exp(reinforce_lp - gen).detach()
    (-(weights * adv[:, None] * reinforce_lp)[mask].sum() / mask.sum()).backward()
    below, above = mask & (rho < eps_max), mask & (rho > eps_max)
    torch.testing.assert_close(cispo_lp.grad[below], reinforce_lp.grad[below], rtol=1e-12, atol=0)
    capped = -eps_max * adv[:, None].expand_as(lp)[above] / mask.sum()
    torch.testing.assert_close(cispo_lp.grad[above], capped, rtol=1e-12, atol=0)
    assert bool((cispo_lp.grad[above].abs() < reinforce_lp.grad[above].abs()).all())
    assert bool((cispo_lp.grad[above] != 0).all())  # truncated, never zeroed (unlike a PPO clip)
    # On-policy (pi_gen = pi_train), CISPO is plain REINFORCE: -A / N on every loss token.
    on_policy_lp = lp.clone().requires_grad_()
    loss, _ = policy_loss("cispo", logprobs=on_policy_lp, gen_logprobs=lp, advantages=adv, mask=mask,
                          group_ids=groups, aggregation="token", eps_max=eps_max)
    loss.backward()
    plain = torch.where(mask, -adv[:, None] / mask.sum(), 0.0)
    torch.testing.assert_close(on_policy_lp.grad, plain, rtol=1e-12, atol=1e-15)


def test_tis_reinforce_bounds():
    lp, gen, _, adv, mask, groups = random_batch(seed=2)
    common = dict(gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups, aggregation="prompt", eps_max=1.3)
    # old = gen: weight 1, plain REINFORCE; old = logprobs (one step per batch): identical to CISPO.
    a = lp.clone().requires_grad_()
    tis, metrics = policy_loss("tis_reinforce", logprobs=a, **common)
    tis.backward()
    assert float(metrics["ratio_max"]) == 1.0
    b = lp.clone().requires_grad_()
    plain, _ = policy_loss("cispo", logprobs=b, **{**common, "gen_logprobs": lp})
    plain.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-15)
    c, d = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    tis, _ = policy_loss("tis_reinforce", logprobs=c, old_logprobs=lp, **common)
    cispo, _ = policy_loss("cispo", logprobs=d, **common)
    (tis + cispo).backward()
    torch.testing.assert_close(tis, cispo, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(c.grad, d.grad, rtol=1e-12, atol=1e-15)


def test_values_outside_the_mask_are_ignored():
    lp, gen, old, adv, mask, groups = random_batch(seed=7)
    clean, _ = policy_loss("dapo", logprobs=lp, gen_logprobs=gen, old_logprobs=old, advantages=adv, mask=mask,
                           group_ids=groups, aggregation="prompt", **PARAMS["dapo"])
    noisy = {k: t.masked_fill(~mask, v) for (k, t), v in zip({"lp": lp, "gen": gen, "old": old}.items(),
                                                             (float("nan"), float("inf"), -float("inf")), strict=True)}
    dirty_lp = noisy["lp"].requires_grad_()
    dirty, metrics = policy_loss("dapo", logprobs=dirty_lp, gen_logprobs=noisy["gen"], old_logprobs=noisy["old"],
                                 advantages=adv, mask=mask, group_ids=groups, aggregation="prompt", **PARAMS["dapo"])
    dirty.backward()
    torch.testing.assert_close(dirty, clean)
    assert bool(torch.isfinite(dirty_lp.grad).all()) and bool((dirty_lp.grad[~mask] == 0).all())
    assert all(bool(torch.isfinite(v)) for v in metrics.values())


def test_float32_inputs_give_float32_loss_and_gradient():
    lp, gen, _, adv, mask, groups = random_batch(seed=1)
    lp32 = lp.float().requires_grad_()
    loss, _ = policy_loss("cispo", logprobs=lp32, gen_logprobs=gen.float(), advantages=adv.float(), mask=mask,
                          group_ids=groups, aggregation="prompt", eps_max=4.0)
    loss.backward()
    assert loss.dtype == torch.float32 and lp32.grad.dtype == torch.float32
    reference, _ = policy_loss("cispo", logprobs=lp, gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups,
                               aggregation="prompt", eps_max=4.0)
    assert loss.item() == pytest.approx(float(reference), rel=1e-5)


def test_bad_names_and_parameters_are_user_errors():
    lp, gen, _, adv, mask, groups = random_batch(seed=0)
    common = dict(logprobs=lp, gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups)
    with pytest.raises(UserError, match="unknown loss 'reinforce'.*cispo"):
        policy_loss("reinforce", aggregation="token", eps_max=4.0, **common)
    with pytest.raises(UserError, match="cispo takes parameters eps_max; got clip_low"):
        policy_loss("cispo", aggregation="token", clip_low=0.2, **common)
    with pytest.raises(UserError, match="unknown aggregation 'group'"):
        policy_loss("cispo", aggregation="group", eps_max=4.0, **common)
    with pytest.raises(UserError, match="symmetric.*use loss dapo"):
        policy_loss("ppo_clip", aggregation="token", clip_low=0.2, clip_high=0.26, **common)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\), expected \[num_samples\] = \[8\]"):
        policy_loss("cispo", aggregation="token", eps_max=4.0, **{**common, "advantages": adv[:3]})


def test_loss_parameters_are_the_fields_of_the_recipes_loss_section():
    cispo = load_recipe("scalerl").algorithm.loss
    assert (cispo.tag(), cispo.params()) == ("cispo", {"eps_max": 4.0})
    dapo = load_recipe("loo_dapo_loss").algorithm.loss
    assert (dapo.tag(), dapo.params()) == ("dapo", {"clip_low": 0.2, "clip_high": 0.26})
    # the loss the trainer names takes exactly its section's fields (policy_loss refuses any other set)
    lp, gen, _, adv, mask, groups = random_batch(seed=0)
    for loss in (cispo, dapo):
        policy_loss(loss.tag(), logprobs=lp, gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups,
                    aggregation="token", **loss.params())


def test_merge_metrics_is_the_metrics_of_one_call():
    lp, gen, _, adv, mask, groups = random_batch(seed=4, samples=9)
    common = dict(aggregation="token", eps_max=1.3)
    _, whole = policy_loss("cispo", logprobs=lp, gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups,
                           **common)
    parts = [policy_loss("cispo", logprobs=lp[s], gen_logprobs=gen[s], advantages=adv[s], mask=mask[s],
                         group_ids=groups[s], **common)[1] for s in (slice(0, 2), slice(2, 7), slice(7, 9))]
    merged = merge_metrics(parts)
    for key, value in whole.items():
        assert merged[key] == pytest.approx(float(value), rel=1e-12), key


def test_backward_runs_once_and_hands_over_its_buffer():
    lp, gen, _, adv, mask, groups = random_batch(seed=6)
    lp = lp.requires_grad_()
    loss, _ = policy_loss("cispo", logprobs=lp, gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups,
                          aggregation="prompt", eps_max=4.0)
    (2 * loss).backward(retain_graph=True)
    first = lp.grad.clone()
    with pytest.raises(RuntimeError, match="one backward pass per call"):
        loss.backward()
    lp.grad = None
    again, _ = policy_loss("cispo", logprobs=lp, gen_logprobs=gen, advantages=adv, mask=mask, group_ids=groups,
                           aggregation="prompt", eps_max=4.0)
    again.backward()
    torch.testing.assert_close(first, 2 * lp.grad)  # the upstream gradient scales the buffer


def test_a_part_without_samples_contributes_nothing():
    lp, gen, _, adv, mask, groups = random_batch(seed=8)
    normalizers = LossNormalizers.from_batch(mask, groups)
    empty = lp[:0].clone().requires_grad_()
    loss, metrics = policy_loss("gspo", logprobs=empty, gen_logprobs=gen[:0], advantages=adv[:0], mask=mask[:0],
                                group_ids=groups[:0], aggregation="prompt", normalizers=normalizers,
                                clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert loss.item() == 0.0 and empty.grad.shape == (0, lp.shape[1]) and int(metrics["tokens"]) == 0
