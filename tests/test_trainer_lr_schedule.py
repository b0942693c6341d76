"""The learning-rate schedule (`trainer.lr_at`) against its formulas (linear warm-up, then constant, the paper's, or a
cosine from lr to min_lr at max_steps) and against megatron-core's own `OptimizerParamScheduler` as an independent
implementation of the same schedules."""

import itertools
import math
from types import SimpleNamespace

import pytest

from megatron_scalerl.errors import UserError
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.trainer.step import lr_at


def _trainer(schedule: str, **values):
    settings = {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 5, "max_steps": 65, **values}
    return load_recipe("demo", [f"trainer.lr_schedule={schedule}", *(f"trainer.{k}={v}" for k, v in settings.items())]
                       ).trainer


def test_warm_up_is_linear_then_constant_for_the_papers_schedule():
    t = _trainer("constant")
    assert [lr_at(u, t) for u in range(5)] == pytest.approx([2e-5, 4e-5, 6e-5, 8e-5, 1e-4])
    assert {lr_at(u, t) for u in (5, 30, 64, 500)} == {1e-4}


def test_cosine_decays_from_lr_to_min_lr_at_max_steps_and_stays_there():
    t = _trainer("cosine")
    assert lr_at(3, t) == pytest.approx(8e-5)  # warm-up as before
    assert lr_at(4, t) == pytest.approx(1e-4)  # the last warm-up update runs at the peak
    assert lr_at(34, t) == pytest.approx(1e-5 + 9e-5 * 0.5 * (1 + math.cos(math.pi * 30 / 60)))  # half way: the mean
    assert lr_at(34, t) == pytest.approx(5.5e-5)
    assert lr_at(64, t) == pytest.approx(1e-5) and lr_at(200, t) == pytest.approx(1e-5)
    lrs = [lr_at(u, t) for u in range(4, 65)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_no_warm_up_starts_at_the_peak():
    assert lr_at(0, _trainer("cosine", warmup_steps=0)) == pytest.approx(1e-4)


def test_a_cosine_that_would_rise_is_refused():
    with pytest.raises(UserError, match="min_lr"):
        _trainer("cosine", min_lr=1e-3)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_every_update_matches_megatron_cores_scheduler(schedule):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = _trainer(schedule)
    megatron = OptimizerParamScheduler(SimpleNamespace(param_groups=[{}]), init_lr=0.0, max_lr=t.lr,
                                       min_lr=t.lr_schedule.min_lr if schedule == "cosine" else 0.0,
                                       lr_warmup_steps=t.warmup_steps, lr_decay_steps=t.max_steps,
                                       lr_decay_style=schedule, start_wd=0.0, end_wd=0.0, wd_incr_steps=t.max_steps,
                                       wd_incr_style="constant")
    for updates in range(t.max_steps + 10):
        megatron.num_steps = updates + 1  # megatron counts the update being made
        assert lr_at(updates, t) == pytest.approx(megatron.get_lr({}), rel=1e-12), updates
