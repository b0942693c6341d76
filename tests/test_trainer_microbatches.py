"""DP/micro-batch splitting: every loss token lands exactly once, aligned with its next-token target."""

import pytest
import torch

from megatron_scalerl.trainer.microbatches import assign_to_ranks, build_microbatches
from tests.test_batches_stream import make_batch


def test_assignment_balances_tokens_deterministically():
    lengths = [10, 9, 8, 3, 2, 2, 1]
    ranks = assign_to_ranks(lengths, 2)
    assert sorted(i for r in ranks for i in r) == list(range(7))
    loads = [sum(lengths[i] for i in r) for r in ranks]
    assert abs(loads[0] - loads[1]) <= 2
    assert ranks == assign_to_ranks(lengths, 2)


@pytest.mark.parametrize("dp, mbs, pad", [(1, 1, 1), (1, 3, 1), (2, 1, 4), (3, 2, 2)])
def test_every_loss_token_appears_once_with_its_target(dp, mbs, pad):
    batch = make_batch()
    seen = {}
    counts, widths = set(), set()
    for rank in range(dp):
        mbs_list = build_microbatches(batch, dp_rank=rank, dp_size=dp, micro_batch_size=mbs, pad_multiple=pad)
        counts.add(len(mbs_list))
        for mb in mbs_list:
            widths.add(mb.tokens.shape[0])
            assert mb.tokens.shape[1] % pad == 0 and mb.tokens.shape[0] <= mbs
            for row, i in enumerate(mb.sample_index.tolist()):
                if i < 0:
                    assert not mb.loss_mask[row].any() and mb.group_ids[row] == -1
                    continue
                assert i not in seen
                sample = batch.sample(i)
                n = int(batch.lengths[i]) - 1
                assert torch.equal(mb.tokens[row, :n], sample["input_ids"][:-1])
                assert torch.equal(mb.targets[row, :n], sample["input_ids"][1:])
                assert torch.equal(mb.loss_mask[row, :n], sample["loss_mask"][1:])
                assert torch.equal(mb.gen_logprobs[row, :n], sample["gen_logprobs"][1:])
                assert not mb.loss_mask[row, n:].any()
                assert mb.advantages[row] == batch.advantages[i] and mb.group_ids[row] == batch.group_ids[i]
                seen[i] = rank
    assert sorted(seen) == list(range(batch.num_samples))
    assert len(counts) == 1 and len(widths) == 1  # same number and width of micro-batches on every rank


@pytest.mark.parametrize("dp, mbs, count, width", [(1, 64, 1, 4), (2, 64, 1, 2), (1, 3, 2, 2), (1, 1, 4, 1),
                                                   (2, 1, 2, 1)])
def test_micro_batches_are_as_few_and_as_narrow_as_the_size_allows(dp, mbs, count, width):
    """4 samples: a size above what a rank holds gives one micro-batch of just its rows (a filtered step is not padded
    up to the size); otherwise ceil(samples / size) micro-batches, evenly filled."""
    batch = make_batch()
    assert batch.num_samples == 4
    for rank in range(dp):
        mbs_list = build_microbatches(batch, dp_rank=rank, dp_size=dp, micro_batch_size=mbs)
        assert [mb.tokens.shape[0] for mb in mbs_list] == [width] * count
