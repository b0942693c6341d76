"""The train step on real tiny Megatron models: layout invariance, split invariance, learning, non-finite steps.

Layout and split invariance are checked to 1e-4 in fp32 (bf16 rounds differently when the sums are split
differently); learning and non-finite steps run the recipe's own precision (`auto`), the head's precision the GPU
recipe's bf16 body beside the FP32 head. The
single-rank scenarios share one spawned worker (`single_rank`).
"""

import math

import pytest
import torch

from megatron_scalerl.platform import run_local_workers
from tests.trainer_utils import BF16, FP32, rl_batch, run_scenarios, tiny_hf_checkpoint, tiny_recipe

pytestmark = pytest.mark.multiprocess


def _steps(rank, run_dir, recipe_kwargs, seeds):
    """Train on the batches `seeds`; returns this rank's (loss, grad norm) per step and, per HF weight this rank's
    pipeline stage holds, the norm of its total update (weights after - before, full tensors gathered over TP/EP)."""
    from megatron_scalerl.models import export_hf_state
    from megatron_scalerl.trainer.trainer import Trainer

    recipe = tiny_recipe(**recipe_kwargs, extra=FP32)
    trainer = Trainer(run_dir, recipe)
    before = {name: t.double().clone() for name, t in export_hf_state(trainer.model[0], recipe.model)}
    metrics = [(m["train/loss"], m["train/grad_norm"]) for m in (trainer.train_step(rl_batch(s)) for s in seeds)]
    updates = {name: float((t.double() - before[name]).norm()) for name, t in
               export_hf_state(trainer.model[0], recipe.model)}
    return metrics, updates


def _assert_same(result, reference, rtol=1e-4):
    """Same losses and grad norms step by step, and every weight moved by the same amount."""
    (metrics, updates), (ref_metrics, ref_updates) = result, reference
    for (la, ga), (lb, gb) in zip(metrics, ref_metrics, strict=True):
        assert math.isclose(la, lb, rel_tol=rtol, abs_tol=1e-7), (metrics, ref_metrics)
        assert math.isclose(ga, gb, rel_tol=rtol), (metrics, ref_metrics)
    assert updates and set(updates) <= set(ref_updates)
    for name, norm in updates.items():
        assert norm > 0 and math.isclose(norm, ref_updates[name], rel_tol=1e-3), (name, norm, ref_updates[name])


def _all_updates(per_rank) -> dict:
    """The weight updates of a multi-rank run, every pipeline stage's together."""
    return {name: norm for _, rank_updates in per_rank for name, norm in rank_updates.items()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def moe_hf_dir(tmp_path_factory):
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("hf_moe"), model="tiny_moe")


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory, hf_dir, moe_hf_dir):
    runs = tmp_path_factory.mktemp("runs")  # each scenario's run directory (nothing is resumed or checkpointed)
    scenarios = {
        "dense": (_steps, runs / "dense", dict(hf=hf_dir), [0, 1, 2]),
        "mbs4": (_steps, runs / "mbs4", dict(mbs=4, hf=hf_dir), [0, 1, 2]),
        "mbs16": (_steps, runs / "mbs16", dict(mbs=16, hf=hf_dir), [0, 1, 2]),
        "moe": (_steps, runs / "moe", dict(model="tiny_moe", hf=moe_hf_dir), [0, 1]),
        "learning": (_learning, runs / "learning"),
        "non_finite": (_non_finite, runs / "non_finite"),
        "bf16_fp32_head": (_bf16_step, runs / "fp32_head", True, hf_dir),
        "bf16_bf16_head": (_bf16_step, runs / "bf16_head", False, hf_dir),
    }
    return run_local_workers(run_scenarios, 1, scenarios, timeout_s=600)[0]


@pytest.fixture(scope="module")
def dense_reference(single_rank):
    return single_rank["dense"]


@pytest.fixture(scope="module")
def moe_reference(single_rank):
    return single_rank["moe"]


@pytest.mark.parametrize("mbs", [4, 16])
def test_micro_batch_split_does_not_change_loss_or_grad(single_rank, dense_reference, mbs):
    _assert_same(single_rank[f"mbs{mbs}"], dense_reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(dp=2), dict(dp=2, mbs=2)],
                         ids=["tp2", "pp2", "dp2", "dp2-mbs2"])
def test_dense_layouts_match_one_process(dense_reference, hf_dir, layout, tmp_path):
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    results = run_local_workers(_steps, world, tmp_path, dict(layout, hf=hf_dir), [0, 1, 2], timeout_s=400)
    updates = _all_updates(results)
    assert set(updates) == set(dense_reference[1])  # every weight of the model, across the pipeline stages
    for metrics, _ in results:  # every rank reports the step's metrics
        _assert_same((metrics, updates), dense_reference)


def _learning(rank, run_dir):
    from megatron_scalerl.trainer.trainer import Trainer

    trainer = Trainer(run_dir, tiny_recipe(extra=["trainer.lr=3e-3"]))
    batch = rl_batch(7)
    weight = torch.repeat_interleave(batch.advantages, batch.lengths) * batch.loss_mask

    def objective():  # advantage-weighted log-likelihood of the batch: what policy gradient increases
        return float((trainer.forward_backward.logprobs(batch) * weight).sum())

    before = objective()
    losses = [trainer.train_step(batch)["train/loss"] for _ in range(4)]
    return before, objective(), losses, trainer.state.updates


def test_cispo_steps_on_a_fixed_batch_improve_the_policy(single_rank):
    before, after, losses, version = single_rank["learning"]
    assert after > before + 1.0, (before, after)
    assert version == 4 and all(math.isfinite(x) for x in losses)


def _non_finite(rank, run_dir):
    import dataclasses

    from megatron_scalerl.trainer.step import NonFiniteError
    from megatron_scalerl.trainer.trainer import Trainer

    trainer = Trainer(run_dir, tiny_recipe(extra=["trainer.max_consecutive_nonfinite=2"]))
    good = rl_batch(0)
    bad = dataclasses.replace(good, advantages=torch.full_like(good.advantages, float("inf")))
    weights = [p.detach().clone() for p in trainer.model[0].parameters()]
    m = trainer.train_step(bad)
    unchanged = all(torch.equal(a, b) for a, b in zip(weights, trainer.model[0].parameters(), strict=True))
    trainer.train_step(good)
    trainer.train_step(bad)
    try:
        trainer.train_step(bad)
    except NonFiniteError as exc:
        return m["train/skipped"], unchanged, trainer.state.updates, trainer.state.skipped_steps, str(exc)
    return None


def test_non_finite_steps_are_skipped_then_abort_naming_the_step(single_rank):
    skipped, unchanged, version, skipped_steps, message = single_rank["non_finite"]
    assert skipped == 1.0 and unchanged
    assert version == 1 and skipped_steps == [0, 2, 3]
    assert message.startswith("step 3: non-finite loss") and "2 steps in a row" in message


def test_moe_trains(moe_reference):
    metrics, updates = moe_reference
    assert all(math.isfinite(loss) and grad > 0 for loss, grad in metrics)
    assert any(".experts." in name for name in updates) and all(norm > 0 for norm in updates.values())


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(dp=2, ep=2), dict(tp=2, dp=2, ep=2)], ids=["ep2", "tp2xep2"])
def test_moe_layouts_match_one_process(moe_reference, moe_hf_dir, layout, tmp_path):
    world = layout.get("tp", 1) * layout.get("dp", 1)
    results = run_local_workers(_steps, world, tmp_path, dict(layout, model="tiny_moe", hf=moe_hf_dir), [0, 1],
                                timeout_s=500)
    updates = _all_updates(results)
    assert set(updates) == set(moe_reference[1])
    for metrics, _ in results:
        _assert_same((metrics, updates), moe_reference)


def _bf16_step(rank, run_dir, fp32_lm_head, hf):
    from megatron_scalerl.trainer.setup import head_weight
    from megatron_scalerl.trainer.trainer import Trainer

    trainer = Trainer(run_dir, tiny_recipe(hf=hf, extra=[*BF16, f"trainer.fp32_lm_head={str(fp32_lm_head).lower()}"]))
    metrics = trainer.train_step(rl_batch(0))
    return metrics["train/loss"], metrics["train/grad_norm"], head_weight(trainer.model[0]).dtype, \
        trainer.forward_backward.logits_dtype


@pytest.mark.parametrize("fp32_lm_head", [True, False])
def test_bf16_training_keeps_the_head_in_fp32_only_when_asked(single_rank, dense_reference, fp32_lm_head):
    loss, grad_norm, head_dtype, logits_dtype = single_rank["bf16_fp32_head" if fp32_lm_head else "bf16_bf16_head"]
    expected = torch.float32 if fp32_lm_head else torch.bfloat16
    assert head_dtype == expected and logits_dtype == expected
    fp32_loss, fp32_grad = dense_reference[0][0]
    assert math.isclose(loss, fp32_loss, rel_tol=0.1, abs_tol=2e-3) and math.isclose(grad_norm, fp32_grad, rel_tol=0.1)
