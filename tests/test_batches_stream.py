"""TrainBatch validation and the on-disk rollout stream."""

import dataclasses

import pytest
import torch

from megatron_scalerl.batches.stream import RolloutStream
from megatron_scalerl.batches.train_batch import BatchError, TrainBatch


def make_batch(lengths=(5, 7, 4, 6), prompt_lengths=(2, 3, 1, 2), vocab=50, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    lengths_t, prompts_t = torch.tensor(lengths), torch.tensor(prompt_lengths)
    total = int(lengths_t.sum())
    positions = torch.cat([torch.arange(n) for n in lengths])
    in_prompt = positions < torch.repeat_interleave(prompts_t, lengths_t)
    mask = ~in_prompt
    gen_lp = torch.where(mask, -torch.rand(total, generator=g) * 3, torch.zeros(total))
    return TrainBatch(
        input_ids=torch.randint(0, vocab, (total,), generator=g),
        loss_mask=mask,
        gen_logprobs=gen_lp,
        weight_versions=torch.where(mask, torch.full((total,), 3), torch.full((total,), -1)),
        lengths=lengths_t,
        prompt_lengths=prompts_t,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])[: len(lengths)],
        rewards=torch.tensor([1.0, -1.0, 1.0, -1.0])[: len(lengths)],
        group_ids=torch.tensor([0, 0, 1, 1])[: len(lengths)],
        truncated=torch.zeros(len(lengths), dtype=torch.bool),
    )


def test_round_trip_in_order(tmp_path):
    stream = RolloutStream(tmp_path)
    batches = [make_batch(seed=i) for i in range(3)]
    assert [stream.put(b, {"producer": "test"}) for b in batches] == [0, 1, 2]
    for i, b in enumerate(batches):
        got, meta = stream.read(i, vocab_size=50)
        assert meta["index"] == i and meta["producer"] == "test"
        for f in dataclasses.fields(TrainBatch):
            expected = getattr(b, f.name)  # routes: None (tests/test_routing_replay.py has batches with them)
            assert getattr(got, f.name) is None if expected is None else torch.equal(getattr(got, f.name), expected)


def test_offsets_sample_views_and_loss_tokens():
    b = make_batch()
    assert b.offsets.tolist() == [0, 5, 12, 16, 22]
    assert torch.equal(b.sample(1)["input_ids"], b.input_ids[5:12])
    assert b.loss_tokens_per_sample().tolist() == [3, 4, 3, 4]  # lengths - prompt lengths


def test_a_batch_is_ready_once_written_and_a_missing_one_names_the_peer(tmp_path):
    stream = RolloutStream(tmp_path)
    assert not stream.ready(0)
    stream.put(make_batch())
    assert stream.ready(0) and not stream.ready(1)
    assert "orchestrator" in str(stream.missing(1, waited_s=0.2))


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda b: dict(loss_mask=torch.ones_like(b.loss_mask)), "loss_mask: prompt tokens"),
        (lambda b: dict(lengths=b.lengths + 1), "lengths: sum"),
        (lambda b: dict(advantages=b.advantages[:2]), "advantages: 2 entries for 4 samples"),
        (lambda b: dict(advantages=torch.tensor([1.0, float("nan"), 0.0, 0.0])), "advantages: must be finite"),
        (lambda b: dict(gen_logprobs=-b.gen_logprobs), "gen_logprobs"),
        (lambda b: dict(input_ids=b.input_ids.int()), "input_ids: dtype torch.int32"),
        (lambda b: dict(input_ids=b.input_ids + 100), "input_ids: token id outside"),
        (lambda b: dict(weight_versions=torch.full_like(b.weight_versions, -1)), "weight_versions"),
        (lambda b: dict(prompt_lengths=b.lengths), "prompt_lengths"),
    ],
)
def test_validation_names_the_field(change, fragment):
    b = make_batch()
    bad = dataclasses.replace(b, **change(b))
    with pytest.raises(BatchError, match="src: " + fragment.replace("(", r"\(")):
        bad.validate("src", vocab_size=50)


def test_corrupt_file_is_a_clear_error(tmp_path):
    stream = RolloutStream(tmp_path)
    stream.put(make_batch())
    stream.path(0).write_bytes(stream.path(0).read_bytes()[:40])
    with pytest.raises(BatchError, match="batch_00000000.safetensors: unreadable TrainBatch"):
        stream.read(0)


def test_prune_keeps_newer_batches_and_the_write_position(tmp_path):
    stream = RolloutStream(tmp_path)
    for seed in range(4):
        stream.put(make_batch(seed=seed))
    assert stream.prune(before=2) == 2
    assert sorted(p.name for p in stream.dir.iterdir()) == ["batch_00000002.safetensors", "batch_00000003.safetensors"]
    assert stream.put(make_batch()) == 4
    assert stream.read(3)[0].input_ids.dtype == torch.int64
