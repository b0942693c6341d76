"""Rollout groups -> TrainBatch: the recipe's filter and advantages (the paper's formulas), packing, versions."""

import pytest
import torch

from megatron_scalerl.algo.versions import NO_VERSION
from megatron_scalerl.batches.stream import RolloutStream
from megatron_scalerl.orchestrator.batch_building import RolloutGroup, build_train_batch
from megatron_scalerl.orchestrator.generation import Sample
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.tasks.problems import Problem

RECIPE = load_recipe("scalerl", model_preset="tiny_moe")


def _sample(completion, versions, *, mask=None, truncated=False, interrupted=False):
    return Sample(key="k", prompt_ids=[1, 2, 3], completion_ids=list(completion),
                  logprobs=[-0.5 if m else 0.0 for m in (mask or [True] * len(completion))],
                  versions=list(versions), loss_mask=list(mask or [True] * len(completion)), finish_reason="stop",
                  interrupted=interrupted, truncated=truncated, server="s")


def _group(index, rewards, samples, admitted=0):
    correct = [r > 0 for r in rewards]
    return RolloutGroup(problem=Problem(f"p{index}", "q", "1"), index=index, admitted_version=admitted,
                        samples=samples, rewards=list(rewards), correct=correct)


def test_zero_variance_group_is_dropped_and_advantages_follow_the_paper(tmp_path):
    # group 7: rewards (+1, -1, -1): baseline mean -1/3 -> advantages (4/3, -2/3, -2/3); the batch-level std is over
    # the advantages that reach the loss (group 7's only: group 8 is all -1, zero variance, dropped).
    g7 = _group(7, [1.0, -1.0, -1.0], [_sample([10, 11], [3, 3]), _sample([12], [4]),
                                       _sample([13, 14, 15], [3, 4, 4])])
    g8 = _group(8, [-1.0, -1.0], [_sample([16], [4]), _sample([17], [4])])
    batch, figures = build_train_batch([g7, g8], batch_index=5, recipe=RECIPE)
    raw = torch.tensor([4 / 3, -2 / 3, -2 / 3])
    expected = raw / raw.std(unbiased=False)
    assert torch.allclose(batch.advantages, expected)
    assert batch.group_ids.tolist() == [7, 7, 7] and batch.rewards.tolist() == [1.0, -1.0, -1.0]
    assert batch.lengths.tolist() == [5, 4, 6] and batch.prompt_lengths.tolist() == [3, 3, 3]
    assert batch.weight_versions.tolist() == [-1, -1, -1, 3, 3, -1, -1, -1, 4, -1, -1, -1, 3, 4, 4]
    assert figures["rollout/filtered_groups"] == 1 and figures["rollout/loss_samples"] == 3
    assert figures["rollout/pass_rate"] == pytest.approx(1 / 5)
    assert figures["staleness/max"] == 2 and figures["staleness/lag_2"] == 3 and figures["staleness/lag_1"] == 3
    stream = RolloutStream(tmp_path)  # what the trainer reads back
    stream.put(batch, index=0)
    again, _ = stream.read(0, vocab_size=RECIPE.model.vocab_size)
    assert torch.equal(again.input_ids, batch.input_ids) and torch.equal(again.advantages, batch.advantages)


def test_forced_phrase_is_out_of_the_loss_and_inherits_its_predecessors_version():
    phrase_mask = [True, True, False, False, True]
    interrupted = _sample([10, 11, 90, 91, 12], [2, 2, NO_VERSION, NO_VERSION, 3], mask=phrase_mask, interrupted=True)
    g = _group(1, [1.0, -1.0], [interrupted, _sample([13], [3])], admitted=2)
    batch, figures = build_train_batch([g], batch_index=3, recipe=RECIPE)
    first = batch.sample(0)
    assert first["loss_mask"].tolist() == [False] * 3 + phrase_mask
    assert first["weight_versions"].tolist() == [-1, -1, -1, 2, 2, 2, 2, 3]
    assert first["gen_logprobs"].tolist() == [0.0] * 3 + [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert figures["rollout/interruption_rate"] == 0.5
    # loss tokens: two of version 2 (lag 1; the phrase is not counted), two of version 3 (lag 0)
    assert figures["staleness/lag_1"] == 2 and figures["staleness/lag_0"] == 2 and figures["staleness/max"] == 1


def test_a_batch_with_every_group_filtered_is_none():
    g = _group(3, [-1.0, -1.0], [_sample([10], [0]), _sample([11], [0])])
    batch, figures = build_train_batch([g], batch_index=0, recipe=RECIPE)
    assert batch is None and figures["rollout/filtered_groups"] == 1 and figures["rollout/loss_samples"] == 0
